"""TPWorkers: rank 0's handle on the other ranks of a tensor-parallel engine.

Rank 0 is the engine's own process: it schedules, samples and owns the block pool; the
other ranks (:mod:`kvpool.engine.tp.rank`, one process each) hold their share of the
weights and of every KV block and run each step's forward pass with it. Lifecycle:

1. :meth:`TPWorkers.start` opens the TCP store and the gloo group of rank 0, starts rank
   1..size-1 (``python -m`` ``EngineSeams.tp_rank_module``, by default :mod:`kvpool.engine.tp.rank`;
   their stdin a pipe from here) and
   waits until each announced itself, then joins the group. A rank that exits before it
   announced makes ``start`` raise RuntimeError (one line) at once.
2. The engine loads its own share (the ranks load theirs meanwhile), builds its pool and
   KV cache and calls :meth:`setup` with the block count: every rank builds its KV cache
   of the same blocks and reports ready (RuntimeError, one line, if one failed).
3. :meth:`step` (the runner's :class:`~kvpool.engine.model_runner.StepFollowers`) writes
   each step's entries to every rank before rank 0 runs them. :meth:`post` writes an
   adapter's message (any thread; frames never interleave): every rank handles it
   before any step written after it, so a memory grant an adapter posts before it hands
   the memory to the scheduler is in place on every rank before a step can use it.
4. :meth:`close`: Stop to every rank, then wait for them (killed after
   ``STOP_WAIT_S``); idempotent. A rank whose rank 0 died sees end of file and exits.

The block tables are rank 0's: the ranks never allocate, they follow.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import torch

from kvpool.engine.tp import messages as tp_messages
from kvpool.engine.tp.collective import GlooGroup
from kvpool.engine.errors import EngineBroken
from kvpool.engine.kv_cache import KVLayout
from kvpool.engine.step_input import StepEntry
from kvpool.launch import module_argv

if TYPE_CHECKING:
    from kvpool.engine.config import EngineConfig

#: how long a rank may take to start (import torch, connect) before start() gives up
START_WAIT_S = 300.0
#: how long close() waits for the ranks to exit before it kills them
STOP_WAIT_S = 30.0
#: how often start() looks whether a starting rank announced itself or exited
ANNOUNCE_POLL_S = 0.05


class TPWorkers:
    """Ranks 1..size-1 of one engine (see the module); :attr:`group` is rank 0's
    collective, which rank 0's model is built with."""

    def __init__(self, group: GlooGroup, procs: list[subprocess.Popen[bytes]]) -> None:
        self.group = group
        self.procs = procs
        self.closed = False
        self._write = threading.Lock()  # one frame at a time on every pipe

    @classmethod
    def start(cls, config: EngineConfig, rank_module: str, device: torch.device,
              dtype: torch.dtype) -> TPWorkers:
        """Start the other ranks of ``config.tensor_parallel_size``, each running
        ``python -m rank_module`` (see the module).

        Raises:
            RuntimeError: a rank exited before it joined (its stderr says why), or none
                joined within ``START_WAIT_S``.
        """
        size = config.tensor_parallel_size
        group = GlooGroup(0, size)
        threads = max(1, torch.get_num_threads() // size)
        procs: list[subprocess.Popen[bytes]] = []
        workers = cls(group, procs)
        try:
            for rank in range(1, size):
                spec = tp_messages.RankSpec(
                    model=str(config.model), device=str(device), dtype=str(dtype), rank=rank,
                    size=size, host="127.0.0.1", port=group.port, block_size=config.block_size,
                    attention_backend=config.attention_backend,
                    max_num_batched_tokens=config.max_num_batched_tokens,
                    prepack=config.prepack, threads=threads)
                procs.append(subprocess.Popen(
                    [*module_argv(rank_module),
                     msgspec.json.encode(spec).decode()],
                    stdin=subprocess.PIPE, env=os.environ.copy()))
            for rank, proc in enumerate(procs, start=1):
                workers._await_announce(rank, proc)
            group.join()
        except BaseException:
            workers.close()
            raise
        return workers

    def _await_announce(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + START_WAIT_S
        while not self.group.announced(rank):
            time.sleep(ANNOUNCE_POLL_S)  # a process starting (seconds): no event to wait on
            code = proc.poll()
            if code is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited with status {code} "
                                   "before it joined (its stderr says why)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel rank {rank} did not join within "
                                   f"{START_WAIT_S:.0f} s")

    def setup(self, num_blocks: int, layout: KVLayout) -> None:
        """Every rank builds its KV cache of ``num_blocks`` blocks and its runner.

        Raises:
            RuntimeError: a rank could not (one line; its stderr says why) or is gone.
        """
        self._send(tp_messages.Setup(num_blocks, layout))
        failed = self._collective(lambda: self.group.all_reduce(torch.zeros(1)))
        if failed.item():
            raise RuntimeError(f"{int(failed.item())} tensor-parallel rank(s) could not "
                               "start (their stderr says why)")

    def step(self, entries: list[StepEntry]) -> None:
        self._send(tp_messages.Step(entries))

    def post(self, payload: bytes) -> None:
        """An adapter's message to every rank's hooks (see the module); thread-safe.
        Raises RuntimeError (one line) when a rank is gone."""
        self._send(tp_messages.Adapter(payload))

    @property
    def size(self) -> int:
        """Ranks in all, this one included."""
        return len(self.procs) + 1

    def _send(self, msg: tp_messages.Message) -> None:
        with self._write:
            for rank, proc in enumerate(self.procs, start=1):
                assert proc.stdin is not None
                try:
                    tp_messages.write(proc.stdin, msg)
                except (BrokenPipeError, ValueError):  # ValueError: the pipe closed here
                    raise EngineBroken(f"tensor-parallel rank {rank} is gone (exit status "
                                       f"{proc.poll()})") from None

    def _collective(self, call: Callable[[], torch.Tensor]) -> torch.Tensor:
        try:
            return call()
        except RuntimeError as e:
            gone = [f"rank {r} (status {p.poll()})"
                    for r, p in enumerate(self.procs, start=1) if p.poll() is not None]
            first = str(e).splitlines()[0] if str(e) else repr(e)
            raise EngineBroken(f"tensor-parallel collective failed: "
                               f"{', '.join(gone) or first}") from None

    def close(self) -> None:
        """Stop every rank and wait for it (killed after ``STOP_WAIT_S``); idempotent."""
        if self.closed:
            return
        self.closed = True
        with self._write:
            for proc in self.procs:
                if proc.stdin is not None and not proc.stdin.closed:
                    try:
                        tp_messages.write(proc.stdin, tp_messages.Stop())
                        proc.stdin.close()
                    except (BrokenPipeError, ValueError, OSError):
                        pass
        deadline = time.monotonic() + STOP_WAIT_S
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.group.close()
