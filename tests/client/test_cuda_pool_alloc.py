"""The step allocator torch's pluggable-allocator interface calls
(kvpool.client_lib.cuda_pool_alloc): its two C callbacks called through their addresses,
as torch calls them, over a trainer step's pages on the host backend (calling conventions
and bookkeeping; no GPU needed), and, marked gpu, a CUDA training step whose allocations
are the step's pool pages (run by scripts/gpu_check.sh's pytest-gpu step)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvpool.client_lib.cuda_pool_alloc import ALLOC_FN, FREE_FN, PoolAllocator, StepLeak
from kvpool.client_lib.trainer import connect_trainer

from .conftest import PAGE


def test_the_callbacks_carve_the_steps_pages_first_fit(run_dir):
    with connect_trainer("tr", run_dir=run_dir) as tr:
        with tr.step(4 * PAGE) as step:
            pa = PoolAllocator(step.arena, 0, step.nbytes)
            a_addr, f_addr = pa.fn_addresses
            alloc, free = ALLOC_FN(a_addr), FREE_FN(f_addr)
            base = step.arena.group.bases[0]
            x = alloc(100, 0, None)
            y = alloc(2 * PAGE, 0, None)
            assert (x, y) == (base, base + PAGE)  # page-aligned, first fit
            ctypes.memset(y, 0x5A, 2 * PAGE)  # the pages are mapped and writable
            assert alloc(2 * PAGE, 0, None) is None  # past the step: NULL, torch's OOM
            assert pa.refused == 1
            free(x, 100, 0, None)
            assert alloc(PAGE, 0, None) == x  # the freed extent is reused
            with pytest.raises(StepLeak, match="still live"):
                pa.check_released()
            free(x, PAGE, 0, None)
            free(y, 2 * PAGE, 0, None)
            pa.check_released()
            assert pa.free_extents == [(0, 4 * PAGE)]  # merged back into one


@pytest.mark.gpu
def test_a_cuda_step_allocates_from_its_pool_pages():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import tempfile
    from pathlib import Path

    from kvpool import launch

    run = Path(tempfile.mkdtemp(prefix="kvp-trainer-gpu-", dir="/tmp"))
    with launch.start_daemon(run, budget="1GiB", backend="cuda", log=run.with_suffix(".log")):
        with connect_trainer("tr", run_dir=run) as tr:
            m = tr.put_module(torch.nn.Linear(256, 256).cuda())
            opt = tr.put_optimizer(torch.optim.AdamW(m.parameters()))
            x = torch.randn(64, 256, device="cuda")
            with tr.step(64 << 20) as step, step.cuda_pool() as pa:
                loss = m(x).square().mean()
                loss.backward()
                opt.step()
                tr.zero_grad()
                assert pa.live_bytes > 0  # the step's tensors are the pool's pages
                del loss
            assert not step.leaked
