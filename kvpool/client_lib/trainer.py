"""A training process as a tenant (kind ``trainer``): its parameters, gradients and
optimizer state are torch tensors over pool pages, its step's transient memory a grant
held only while the step runs (docs/ARCHITECTURE.md, "Trainer tenant").

    from kvpool.client_lib.trainer import connect_trainer

    with connect_trainer("policy", run_dir=...) as tr:
        model = tr.put_module(MyModel())            # parameters + gradients in the pool
        opt = tr.put_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
        for batch in data:
            with tr.step(64 << 20) as step:           # granted now, given back at the end
                loss = model(batch).sum()
                loss.backward()
                opt.step()
                tr.zero_grad()

Three arenas (:mod:`kvpool.client_lib.arena`), one region group each (``kvpool map``):

* ``state`` — parameters and gradients: granted once, held until the trainer ends;
* ``optim`` — optimizer state, the *reclaimable* part: outside a step it is reported to
  the daemon as reserve, so when another tenant needs memory the daemon's reserve ask
  makes the trainer copy it to host memory and give its pages back
  (:meth:`Arena.offload`); the next step copies it back first (:meth:`Arena.restore`).
  :meth:`Trainer.offload` does the same on request (before a rollout);
* ``step`` — the step's transient memory: :meth:`Trainer.step` grants ``nbytes`` (the
  daemon takes it from idle tenants' reserves and prefix caches first) and gives it back
  when the block ends. On CUDA the process's allocations inside the step are carved from
  it (:mod:`kvpool.client_lib.cuda_pool_alloc`); on the host backend torch's CPU
  allocator cannot be routed, so the grant holds the step's budget and its pages back
  explicit scratch tensors (:meth:`Step.empty`).

A step larger than the trainer may ever hold (``max`` or the budget, counting its state)
raises :class:`StepTooLarge` before anything is taken; one that does not fit now waits,
retrying while the daemon reclaims, up to ``wait_s`` and then raises
:class:`StepDeadline` holding nothing of the step. Nothing exits the process.

Touch the optimizer state only inside a step (a checkpoint: inside ``trainer.step(0)``):
outside one the keeper thread may offload it, swapping its storage under a reader.
The gradients are the pool tensors only as long as they are accumulated into: clear them
with :meth:`Trainer.zero_grad` (or ``optimizer.zero_grad(set_to_none=False)``), never to
None. :meth:`Trainer.close` copies every tensor to process memory before giving the pages
back (the model stays usable); a killed trainer's pages go back to the daemon, which
zeroes them for the next tenant.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator, TypeVar

from kvpool.client_lib.arena import ALIGN, Arena
from kvpool.client_lib.cuda_pool_alloc import PoolAllocator
from kvpool.client_lib.errors import NoMemory, StepDeadline, StepTooLarge
from kvpool.client_lib.tenant import Tenant

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvpool.client")

M = TypeVar("M", bound="torch.nn.Module")
O = TypeVar("O", bound="torch.optim.Optimizer")
RETRY_S = 0.05  # first pause between a step's refused grant and the next try


class Step:
    """The memory of one running step: ``nbytes`` granted (whole pages). ``empty``
    carves scratch tensors from it (host backend: the step's only pool-backed memory)."""

    def __init__(self, arena: Arena, nbytes: int):
        self.arena = arena
        self.nbytes = nbytes
        self.leaked = False  # memory of the step outlived it: its pages stay mapped

    @contextlib.contextmanager
    def cuda_pool(self) -> Iterator[PoolAllocator]:
        """(CUDA) Route the block's CUDA allocations to the step's pages not carved by
        :meth:`empty`: a ``torch.cuda.MemPool`` over a :class:`PoolAllocator`. At its end
        torch's cached segments are given back; one still live raises ``StepLeak``."""
        import torch

        alloc = PoolAllocator(self.arena, self.arena.top, self.nbytes)
        pool = torch.cuda.MemPool(alloc.torch_allocator())
        try:
            with torch.cuda.use_mem_pool(pool):
                yield alloc
        finally:
            torch.cuda.synchronize()
            del pool
            torch.cuda.empty_cache()
            if alloc.live:
                self.leaked = True
        alloc.check_released()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed scratch tensor in the step's pages (valid until the step ends).
        ``ValueError`` past the step's ``nbytes``."""
        import torch

        n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        if -(-self.arena.top // ALIGN) * ALIGN + n > self.nbytes:
            raise ValueError(f"{n} bytes more do not fit in the step's {self.nbytes} "
                             f"({self.arena.top} used)")
        return self.arena.empty(shape, dtype)


class _Reclaimable:
    """The optimizer arena's side of the daemon's reserve asks
    (:class:`~kvpool.client_lib.regions.GroupAllocator`): outside a step its pages are
    reserve, and giving them back is an offload."""

    def __init__(self, trainer: "Trainer"):
        self.trainer = trainer

    def in_use_bytes(self) -> int:
        return self.trainer.optim.mapped_bytes

    def reserve_units(self) -> list[int]:
        return [] if self.trainer.in_step else sorted(self.trainer.optim.group.mapped)

    def release_reserve(self, nbytes: int) -> int:
        return self.trainer.offload_if_idle()

    def stop(self) -> None:
        pass


class Trainer:
    """A trainer tenant (see the module). Made by :func:`connect_trainer` or over a
    tenant registered with kind ``trainer``; ``wait_s``: a step's default deadline."""

    def __init__(self, tenant: Tenant, wait_s: float = 30.0):
        self.tenant = tenant
        self.wait_s = wait_s
        cap = max(tenant.budget, tenant.page_size)
        self.state = Arena(tenant, "trainer-state", cap)
        self.optim = Arena(tenant, "trainer-optim", cap)
        self.scratch = Arena(tenant, "trainer-step", cap)
        self.optim.group.allocator = _Reclaimable(self)
        self.grads: list[torch.Tensor] = []
        self.in_step = False
        self.steps = 0
        self.offloads = 0
        self._held_ids: set[int] = set()
        self._lock = threading.Lock()  # a step, an offload: one at a time

    # ---- persistent state ---------------------------------------------------------------
    def put_module(self, module: M, params: bool = True) -> M:
        """Move ``module``'s parameters into the pool (in place: same Parameter objects)
        and give each trainable one a zeroed gradient there; returns ``module``.
        ``params=False``: the parameters stay where they are (in a mutable weight set
        the trainer writes: :mod:`kvpool.engine_adapters.bundled.inplace_trainer`), only
        the gradients are made in the pool."""
        with self._lock:
            for prm in module.parameters():
                if params:
                    self.state.hold(prm)
                if prm.requires_grad:
                    g = self.state.empty(prm.shape, prm.dtype)
                    self.state.held.append((g, g.data_ptr() - self.state.group.bases[0]))
                    prm.grad = g
                    self.grads.append(g)
            self.state.report()
        return module

    def put_optimizer(self, opt: O) -> O:
        """Keep ``opt``'s state in the reclaimable arena: Adam/AdamW's is made there now
        (zeros, as its first step would); any other optimizer's tensors are moved there
        after the step that creates them. Returns ``opt``."""
        import torch

        with self._lock:
            if isinstance(opt, torch.optim.Adam):
                for group in opt.param_groups:
                    keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"]
                                                        if group["amsgrad"] else [])
                    for prm in group["params"]:
                        st = opt.state[prm]
                        if st:
                            continue
                        dev = group["capturable"] or group["fused"]
                        st["step"] = torch.zeros((), dtype=torch.float32,
                                                 device=prm.device if dev else "cpu")
                        for k in keys:
                            st[k] = torch.zeros_like(prm)
            self._hold_state(opt)
        opt.register_step_post_hook(lambda o, args, kwargs: self._hold_state(o))
        return opt

    def _hold_state(self, opt: torch.optim.Optimizer) -> None:
        """Move every optimizer state tensor that is not in the arena yet into it (a
        0-dimensional one, a step count, stays where it is)."""
        import torch

        moved = False
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and id(v) not in self._held_ids:
                    self.optim.hold(v)
                    self._held_ids.add(id(v))
                    moved = True
        if moved:
            self.optim.report(reserve=not self.in_step)

    def zero_grad(self) -> None:
        """Zero every pool gradient in place (never to None: the pool tensors stay)."""
        for g in self.grads:
            g.zero_()

    # ---- the reclaimable part ---------------------------------------------------------
    def offload(self) -> int:
        """Copy the optimizer state to host memory and give its pages back (waits for a
        running step to end); returns the bytes given back."""
        with self._lock:
            return self._offload()

    def offload_if_idle(self) -> int:
        """(the daemon's reserve ask, keeper thread) :meth:`offload` unless a step runs."""
        if not self._lock.acquire(blocking=False):
            return 0
        try:
            return 0 if self.in_step else self._offload()
        finally:
            self._lock.release()

    def _offload(self) -> int:
        freed = self.optim.offload()
        if freed:
            self.offloads += 1
        return freed

    @property
    def held_bytes(self) -> int:
        """Pool bytes of the trainer's state, its optimizer state counted whether
        offloaded or not (what a step must fit beside)."""
        return self.state.footprint + self.optim.footprint

    @property
    def ceiling(self) -> int:
        """The most the trainer may ever hold: its ``max`` (if any), at most the budget."""
        lim, budget = self.tenant.limit, self.tenant.budget
        return min(lim, budget) if lim > 0 else budget

    # ---- the step -----------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, nbytes: int, wait_s: float | None = None) -> Iterator[Step]:
        """Hold ``nbytes`` (rounded up to pages) for the block, the optimizer state back
        in the pool; given back at its end whatever happens. See the module for the two
        refusals; ``wait_s`` (default: the trainer's) bounds the wait."""
        if nbytes < 0:
            raise ValueError(f"a step cannot take {nbytes} bytes")
        ps = self.tenant.page_size
        need = -(-nbytes // ps) * ps
        with self._lock:
            total = self.held_bytes + need
            if total > self.ceiling or need > self.scratch.capacity:
                raise StepTooLarge(
                    "OVER_LIMIT", f"a step of {need} bytes cannot ever fit: with the "
                    f"trainer's {self.held_bytes} bytes of state it needs {total} bytes, "
                    f"more than the {self.ceiling} bytes it may hold (its max, at most "
                    f"the budget); nothing was taken")
            self.in_step = True
            step: Step | None = None
            try:
                self.optim.report()  # not reserve while the step runs
                deadline = time.monotonic() + (self.wait_s if wait_s is None else wait_s)
                self._until(deadline, need, self.optim.restore)
                self._until(deadline, need, lambda: self.scratch.map_upto(need))
                self.steps += 1
                step = Step(self.scratch, need)
                yield step
            finally:
                self._end_step(step)

    def _until(self, deadline: float, need: int, take: Any) -> None:
        """Call ``take`` (a grant) until it is not refused for memory; StepDeadline at
        ``deadline``."""
        pause = RETRY_S
        while True:
            try:
                take()
                return
            except NoMemory as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StepDeadline(
                        "NO_MEMORY", f"a step of {need} bytes was not granted before its "
                        f"deadline (the other tenants did not give enough back: {e.message}); "
                        "nothing of the step is held") from None
                time.sleep(min(pause, left))
                pause = min(pause * 2, 0.5)

    def _end_step(self, step: Step | None) -> None:
        self.in_step = False
        if step is not None and step.leaked:
            log.error("a step's CUDA memory outlived it: its pages stay mapped")
            return
        try:
            if self.scratch.group.backend.caps.tensor_device != "cpu":  # device memory
                import torch

                if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # no kernel runs
                    torch.cuda.synchronize()
            self.scratch.release_all()
        finally:
            if not self.tenant.closed and self.optim.group.mapped:
                self.optim.report(reserve=True)

    # ---- the end ------------------------------------------------------------------------
    def close(self) -> None:
        """Copy every tensor to process memory, give every page back, end the session."""
        with self._lock:
            try:
                if self.tenant.connected:
                    self.state.offload()
                    self.optim.offload()
                for a in (self.scratch, self.optim, self.state):
                    a.close()
            finally:
                self.tenant.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect_trainer(name: str, device: int = 0,
                    run_dir: str | os.PathLike[str] | None = None, *,
                    wait_s: float = 30.0, timeout_s: float = 10.0, min: int | None = None,
                    max: int | None = None, shares: float | None = None,
                    group: str | None = None) -> Trainer:
    """Register a trainer tenant (kind ``trainer``) with the daemon serving ``run_dir``;
    ``min``/``max``/``shares`` as :func:`kvpool.client_lib.connect`; ``wait_s``: how long
    a step may wait for its memory by default."""
    t = Tenant(name, device=device, run_dir=run_dir, kind="trainer", timeout_s=timeout_s,
               min=min, max=max, shares=shares, group=group)
    try:
        return Trainer(t, wait_s=wait_s)
    except BaseException:
        t.close()
        raise
