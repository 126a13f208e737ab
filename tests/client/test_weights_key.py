"""A checkpoint's content key (kvpool.client_lib.weights.content_key): one byte of one
tensor changes it; a second call reads it from the cache file beside the checkpoint,
unless the files changed since (size or mtime) or the cache is not one."""

from __future__ import annotations

import json
import os
import struct

import pytest

from kvpool.client_lib.weights import cache_path, content_key


def safetensors(path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    header, data = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


def model(path, last: int = 0) -> None:
    safetensors(path, {"w": ("F32", [2, 2], bytes(range(16))),
                       "b": ("U8", [4], bytes([1, 2, 3, last]))})


def test_one_byte_changes_the_key_and_the_cache_is_read(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    model(a / "model.safetensors")
    model(b / "model.safetensors", last=1)
    ka, kb = content_key(a), content_key(b)
    assert not ka.cached and not kb.cached
    assert ka.key != kb.key and len(ka.key) == 64
    again = content_key(a)
    assert again == type(again)(ka.key, True)  # from the cache file, not rehashed
    # the cache is what was read: a forged key with matching stamps comes back as is
    cache = cache_path(a)
    data = json.loads(cache.read_text())
    data["key"] = "0" * 64
    cache.write_text(json.dumps(data))
    assert content_key(a).key == "0" * 64
    assert content_key(a, use_cache=False).key == ka.key


def test_a_changed_file_or_a_bad_cache_is_rehashed(tmp_path):
    f = tmp_path / "m.safetensors"
    model(f)
    first = content_key(f)
    assert cache_path(f).exists() and content_key(f).cached
    model(f, last=9)
    os.utime(f, ns=(1, 1))  # a different mtime (and content)
    changed = content_key(f)
    assert not changed.cached and changed.key != first.key
    for junk in ("", "{", '{"version": 1, "files": {}, "key": 5}', "[]"):
        cache_path(f).write_text(junk)
        assert content_key(f) == type(first)(changed.key, False)


def test_names_dtypes_and_shapes_count(tmp_path):
    raw = bytes(range(16))
    keys = set()
    for i, t in enumerate([("w", "F32", [2, 2]), ("v", "F32", [2, 2]), ("w", "I32", [2, 2]),
                           ("w", "F32", [4])]):
        f = tmp_path / f"{i}.safetensors"
        safetensors(f, {t[0]: (t[1], t[2], raw)})
        keys.add(content_key(f, use_cache=False).key)
    assert len(keys) == 4


def test_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError):
        content_key(tmp_path / "nope")
    with pytest.raises(FileNotFoundError):
        content_key(tmp_path)  # an empty directory
