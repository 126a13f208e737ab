"""``POST /kvpool/weights`` on a vLLM tenant's API server: the bundled server's publish
route (:mod:`kvpool.elastic_server.weight_routes`), done by vLLM's own weight update.

``{"checkpoint": DIR}``: the folder is checked here first (a folder of safetensors files
whose headers parse, a ``config.json`` whose shape keys equal the served model's: one-line
400 otherwise, nothing touched); then generation is paused at a step boundary (requests
in flight finish, new ones wait), vLLM's ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` run with the ``kvpool`` transfer engine
(:mod:`.weight_transfer`: the tensors through ``model.load_weights``), the prefix cache
is reset (its KV came from the old weights) and generation resumes. Answers ``{"bytes",
"bytes_copied", "seconds", "engine": "vllm"}`` (bytes: the checkpoint's tensors, each
copied once into vLLM's parameters). A server whose ``--weight-transfer-config`` names
another backend: 400. A load that fails inside the engine after the checks: 500 of one
line (the parameters may hold part of the new checkpoint: publish again).

It changes what the server serves, so it answers only what :mod:`kvpool.control_token`
admits for the address vLLM listens on (``--host``; none given: every interface, so a
token is needed), as the bundled route does.
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kvpool.control_token import ControlGate, ControlTokenError
from kvpool.engine_adapters.vllm.weight_transfer import BACKEND

#: config.json keys that fix the tensors' shapes: a checkpoint must agree on each the
#: served model has
SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "vocab_size", "head_dim", "tie_word_embeddings")
MAX_PATH = 4096
MAX_HEADER = 64 << 20  # a safetensors header larger than this is not a checkpoint of ours


class Refused(ValueError):
    """A publish refused before anything changed (one line, 400)."""


def _error(status: int, message: str, code: str) -> JSONResponse:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return JSONResponse({"error": {"message": message[:400], "type": kind, "code": code}},
                        status)


def tensor_bytes(folder: Path) -> int:
    """The bytes of every tensor in ``folder``'s safetensors files (their headers read);
    :class:`Refused` for a folder that is not a checkpoint."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise Refused(f"{str(folder)[:200]}: no .safetensors files")
    total = 0
    for f in files:
        try:
            with f.open("rb") as r:
                (n,) = struct.unpack("<Q", r.read(8))
                if n > MAX_HEADER:
                    raise Refused(f"{f.name}: not a safetensors file")
                header = json.loads(r.read(n))
        except (OSError, struct.error, ValueError, UnicodeDecodeError) as e:
            raise Refused(f"{f.name}: not a safetensors file ({type(e).__name__})") from None
        if not isinstance(header, dict):
            raise Refused(f"{f.name}: not a safetensors file")
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            offsets = meta.get("data_offsets") if isinstance(meta, dict) else None
            if (not isinstance(offsets, list) or len(offsets) != 2
                    or not all(isinstance(x, int) for x in offsets)):
                raise Refused(f"{f.name}: tensor {name[:80]!r} has no data offsets")
            total += offsets[1] - offsets[0]
    return total


def check_shape(folder: Path, served: Any) -> None:
    """:class:`Refused` unless ``folder/config.json`` agrees with ``served`` (the served
    model's Hugging Face config) on every :data:`SHAPE_KEYS` key both name."""
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise Refused(f"{str(folder)[:200]}/config.json: unreadable "
                      f"({type(e).__name__})") from None
    if not isinstance(cfg, dict):
        raise Refused(f"{str(folder)[:200]}/config.json: not a JSON object")
    for key in SHAPE_KEYS:
        theirs, ours = cfg.get(key), getattr(served, key, None)
        if theirs is not None and ours is not None and theirs != ours:
            raise Refused(f"the checkpoint's {key} is {str(theirs)[:40]}, the served "
                          f"model's {ours}")


def checked_folder(body: Any) -> Path:
    """The body's ``checkpoint`` folder, or :class:`Refused`."""
    if not isinstance(body, dict) or set(body) != {"checkpoint"}:
        raise Refused('the body must be {"checkpoint": "<folder>"}')
    raw = body["checkpoint"]
    if not isinstance(raw, str) or not raw or len(raw) > MAX_PATH or "\x00" in raw:
        raise Refused("checkpoint must be a folder path (at most 4096 characters)")
    folder = Path(raw)
    try:
        ok = folder.is_dir()
    except OSError:
        ok = False
    if not ok:
        raise Refused(f"{raw[:200]} is not a folder this server can read")
    return folder


def gate_of(request: Request) -> ControlGate | JSONResponse:
    """The control gate for the address vLLM listens on, or the 403 a broken token
    configuration answers."""
    args = getattr(request.app.state, "args", None)
    host = getattr(args, "host", None) or "0.0.0.0"
    try:
        return ControlGate.of(host, os.environ)
    except ControlTokenError as e:
        return _error(403, f"control routes are off: {e}", "forbidden")


def router() -> APIRouter:
    r = APIRouter()

    @r.post("/kvpool/weights")
    async def publish_weights(request: Request) -> Any:
        gate = gate_of(request)
        if isinstance(gate, JSONResponse):
            return gate
        refused = gate.refusal(request.headers.get("authorization"))
        if refused is not None:
            status, message = refused
            return _error(status, message, "unauthorized" if status == 401 else "forbidden")
        engine = request.app.state.engine_client
        try:
            try:
                body = json.loads(await request.body())
            except (ValueError, UnicodeDecodeError):
                raise Refused("the body is not JSON") from None
            folder = checked_folder(body)
            transfer = engine.vllm_config.weight_transfer_config
            backend = getattr(transfer, "backend", None)
            if backend != BACKEND:
                raise Refused(f"this server's weight transfer backend is {backend!r}, not "
                              f"{BACKEND!r} (--weight-transfer-config)")
            check_shape(folder, engine.model_config.hf_config)
            nbytes = tensor_bytes(folder)
        except Refused as e:
            return _error(400, str(e), "bad_checkpoint")
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        t0 = time.perf_counter()
        await engine.pause_generation(mode="wait", clear_cache=False)
        try:
            await engine.start_weight_update()
            await engine.update_weights(WeightTransferUpdateRequest(
                update_info={"checkpoint": str(folder)}))
            await engine.finish_weight_update()
            await engine.reset_prefix_cache()
        except Exception as e:  # after the checks: the engine's own failure
            line = (str(e).strip().splitlines() or [type(e).__name__])[0]
            return _error(500, f"the engine failed to load {str(folder)[:200]}: {line[:200]}"
                          " (its weights may be partly new: publish again)", "load_failed")
        finally:
            await engine.resume_generation()
        return {"bytes": nbytes, "bytes_copied": nbytes,
                "seconds": time.perf_counter() - t0, "engine": "vllm"}

    return r
