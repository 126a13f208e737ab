"""One rank (> 0) of a tensor-parallel engine: ``python -m kvpool.engine.tp.rank SPEC``.

Rank 0 starts it (:mod:`kvpool.engine.tp.workers`) with a
:class:`~kvpool.engine.tp.messages.RankSpec` as JSON. The rank joins the gloo group
(:class:`~kvpool.engine.tp.collective.GlooGroup`) and loads its share of the checkpoint
(only its slices are read) on a thread of its own while it follows rank 0's messages on
stdin, in order:

* ``Adapter``: handed to its :class:`RankHooks` (an adapter's own messages: an elastic
  KV cache's grants and releases), at any time, in order with the steps;
* ``Setup``: (the load finished) its KV cache from the hooks (its KV heads of every
  block) and its runner; then it tells rank 0 it is ready (a one-element all-reduce:
  0 ready, 1 failed);
* ``Step``: the forward pass over the same entries as rank 0 (the ranks meet in the
  collectives; this rank's logits go to rank 0);
* ``Stop`` or end of file: the hooks close, the rank exits.

It schedules nothing and samples nothing. An adapter runs its own module instead of this
one (``EngineSeams.tp_rank_module``) whose main calls :func:`main` with a factory of
its hooks (given the rank's spec).

Exit status: 0 after ``Stop``/end of file; 1 with one line on stderr when it could not
start (its model or KV cache) or a collective failed (another rank is gone); 2 for a
bad command line.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from collections.abc import Callable
from typing import BinaryIO, Protocol, cast

import msgspec
import torch

from kvpool.engine.tp import messages as tp_messages
from kvpool.engine.model.attention import AttentionBackend
from kvpool.engine.tp.collective import GlooGroup
from kvpool.engine.kv_cache import KVCache, KVCacheSpec
from kvpool.engine.model.loader import load_model
from kvpool.engine.model.llama import LlamaForCausalLM
from kvpool.engine.model.config import ModelConfig
from kvpool.engine.model_runner import ModelRunner


class RankHooks(Protocol):
    """What an adapter adds to a rank (> 0); every method runs on the rank's one message
    thread, in the order rank 0 sent the messages.

    ``handle(payload)``: an ``Adapter`` message from rank 0's side of the adapter; it may
    block (a collective grant), but every message rank 0 sent before it has been handled
    and every ``Step`` after it waits. ``make_kv_cache(spec, num_blocks, device)``: this
    rank's KV storage (``KVCache.allocate``'s contract: ``num_blocks`` blocks of
    ``spec``). ``close()``: the rank is ending (also after a failed start)."""

    def handle(self, payload: bytes) -> None: ...

    def make_kv_cache(self, spec: KVCacheSpec, num_blocks: int,
                      device: torch.device) -> KVCache: ...

    def close(self) -> None: ...


class PlainRank:
    """The default hooks: preallocated KV memory, no adapter messages."""

    def handle(self, payload: bytes) -> None:
        raise RuntimeError("this rank runs no adapter (an Adapter message arrived)")

    def make_kv_cache(self, spec: KVCacheSpec, num_blocks: int,
                      device: torch.device) -> KVCache:
        return KVCache.allocate(spec, num_blocks, device)

    def close(self) -> None:
        pass


def dtype_named(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


class _Load:
    """The rank's share of the model, loaded on a thread of its own."""

    def __init__(self, spec: tp_messages.RankSpec, group: GlooGroup) -> None:
        self.spec, self.group = spec, group
        self.model: LlamaForCausalLM | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="kvpool-tp-load", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            path = Path(self.spec.model)
            self.model = load_model(path, torch.device(self.spec.device),
                                    dtype_named(self.spec.dtype), ModelConfig.from_dir(path),
                                    tp=self.group)
        except BaseException as e:
            self.error = e

    def result(self) -> LlamaForCausalLM:
        self.thread.join()
        if self.model is None:
            raise RuntimeError(f"cannot load the model: {self.error}")
        return self.model


def build_runner(spec: tp_messages.RankSpec, model: LlamaForCausalLM,
                 setup: tp_messages.Setup, hooks: RankHooks) -> ModelRunner:
    """This rank's KV cache (from ``hooks``) and runner."""
    c = model.config
    dtype, device = dtype_named(spec.dtype), torch.device(spec.device)
    kv_spec = KVCacheSpec(c.num_layers, spec.block_size, model.num_local_heads[1],
                          c.head_dim, dtype, setup.layout)
    kv = hooks.make_kv_cache(kv_spec, setup.num_blocks, device)
    return ModelRunner(model, kv, spec.block_size, device, dtype,
                       cast(AttentionBackend, spec.attention_backend),
                       spec.max_num_batched_tokens, prepack=spec.prepack)


def serve_rank(spec: tp_messages.RankSpec, inbox: BinaryIO, hooks: RankHooks) -> int:
    """Join, load, follow rank 0 until Stop; returns the exit status."""
    torch.set_num_threads(max(1, spec.threads))
    group = GlooGroup(spec.rank, spec.size, spec.host, spec.port)
    group.announce()
    group.join()
    try:
        return _follow(spec, inbox, hooks, group, _Load(spec, group))
    finally:
        hooks.close()
        group.close()


def _follow(spec: tp_messages.RankSpec, inbox: BinaryIO, hooks: RankHooks,
            group: GlooGroup, load: _Load) -> int:
    runner: ModelRunner | None = None
    with torch.inference_mode():
        while True:
            msg = tp_messages.read(inbox)
            if isinstance(msg, tp_messages.Adapter):
                hooks.handle(msg.payload)
            elif isinstance(msg, tp_messages.Step):
                assert runner is not None, "a step before Setup"
                runner.execute(msg.entries)
            elif isinstance(msg, tp_messages.Setup):
                try:
                    runner = build_runner(spec, load.result(), msg, hooks)
                except Exception as e:  # tell rank 0 (it waits in the ready check), then exit
                    print(f"kvpool tp rank {spec.rank}: cannot start: {e}", file=sys.stderr)
                    group.all_reduce(torch.ones(1))
                    return 1
                group.all_reduce(torch.zeros(1))  # ready
            else:  # Stop, or end of file (rank 0 is gone)
                return 0


def main(argv: list[str],
         make_hooks: Callable[[tp_messages.RankSpec], RankHooks] | None = None) -> int:
    """The rank's command line: one argument, its RankSpec as JSON; ``make_hooks(spec)``
    the rank's hooks (default: :class:`PlainRank`)."""
    if len(argv) != 1:
        print("usage: python -m kvpool.engine.tp.rank RANK_SPEC_JSON", file=sys.stderr)
        return 2
    try:
        spec = msgspec.json.decode(argv[0], type=tp_messages.RankSpec)
    except msgspec.DecodeError as e:
        print(f"kvpool tp rank: bad spec: {e}", file=sys.stderr)
        return 2
    try:
        hooks = PlainRank() if make_hooks is None else make_hooks(spec)
        return serve_rank(spec, sys.stdin.buffer, hooks)
    except Exception as e:  # a collective failed (a rank is gone), an adapter message
        print(f"kvpool tp rank {spec.rank}: {str(e).splitlines()[0] if str(e) else e!r}",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
