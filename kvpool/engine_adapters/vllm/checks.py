"""Start-up checks in the process that builds vLLM's config (the API server).

Each refusal is one line on stderr and a nonzero exit (``SystemExit``), before vLLM starts
its engine core: no daemon, a parallel layout kvpool cannot serve, a budget smaller than
one KV chunk of this model. On success the config's KV size becomes kvpool's virtual
capacity and, on CPU, a single rank runs in the engine-core process (tensor parallelism
keeps vLLM's multiprocess executor).
"""

from __future__ import annotations

import math
import os
import sys
from typing import TYPE_CHECKING, NoReturn

import torch

from kvpool.engine_adapters.kv_unit import plan_layers
from kvpool.engine_adapters.vllm.settings import Settings, say

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def fail(msg: str) -> NoReturn:
    raise SystemExit(msg)


def block_page_bytes(config: VllmConfig) -> tuple[int, int]:
    """(bytes of one layer's page of one block, layers with KV) for a plain decoder."""
    mc, cc, pc = config.model_config, config.cache_config, config.parallel_config
    if cc.cache_dtype not in (None, "auto"):
        itemsize = 1 if "fp8" in str(cc.cache_dtype) else 2
    else:
        dtype = mc.dtype
        assert isinstance(dtype, torch.dtype)  # ModelConfig resolves "auto" & co. at init
        itemsize = torch.empty((), dtype=dtype).element_size()
    block = cc.block_size or 16
    page = 2 * block * mc.get_num_kv_heads(pc) * mc.get_head_size() * itemsize
    return page, mc.get_num_layers(pc)


def parallel_refusal(tp: int, pp: int, dp: int) -> str | None:
    """The one-line refusal of a parallel layout kvpool cannot serve, or None: one rank,
    or tensor parallelism alone (one gang, one rank per worker: :mod:`.tp`)."""
    if pp == 1 and dp == 1:
        return None  # one rank, or tensor parallelism (one gang, :mod:`.tp`)
    if tp > 1 or pp > 1 or dp > 1:
        return (f"kvpool: KVPOOL_ENABLE=1 serves one rank per vLLM server; got "
                f"tensor-parallel {tp}, pipeline-parallel {pp}, data-parallel {dp} (run one "
                "server per device, or unset KVPOOL_ENABLE)")
    return None


def served_device(run: str | None, device: int) -> int | None:
    """The device the daemon answers for when asked about ``device`` (a daemon serving
    one device answers for it whatever is asked), or None when it refuses."""
    from kvpool.client_lib import KvpoolError, Monitor

    try:
        mon = Monitor(run, timeout_s=15.0, device=device)
        try:
            return mon.stats().pool.device
        finally:
            mon.close()
    except (KvpoolError, OSError, TimeoutError):
        return None


def check_config(config: VllmConfig) -> None:
    from kvpool.client_lib import KvpoolError, Monitor
    from kvpool.engine_adapters.vllm.bridge import served_name
    from kvpool.paths import run_dir

    s = Settings.from_env()
    pc = config.parallel_config
    why = parallel_refusal(pc.tensor_parallel_size, pc.pipeline_parallel_size,
                           pc.data_parallel_size)
    if why is not None:
        fail(why)
    where = run_dir(s.run_dir)
    try:
        mon = Monitor(s.run_dir, timeout_s=15.0)  # generous: a loaded host answers late
        try:
            pool = mon.stats().pool
        finally:
            mon.close()
    except (KvpoolError, OSError, TimeoutError) as e:
        fail(f"kvpool: no kvpool daemon answers at {where} ({type(e).__name__}: {e}); start "
             "one (`kvpool daemon`) or unset KVPOOL_ENABLE")
    tp = pc.tensor_parallel_size
    for dev in range(s.device, s.device + tp) if tp > 1 else ():
        if served_device(s.run_dir, dev) != dev:
            fail(f"kvpool: tensor-parallel {tp} needs one daemon device per rank "
                 f"({s.device}..{s.device + tp - 1}); the daemon at {where} does not serve "
                 f"device {dev} (start it with `--devices {s.device + tp}`, or unset "
                 "KVPOOL_ENABLE)")
    cap = pool.budget if not s.max_bytes else min(pool.budget, s.max_bytes)
    page, layers = block_page_bytes(config)
    unit = plan_layers(page, layers, pool.page_size, pad=s.kv_unit == "small")
    need = math.ceil(2 / unit.blocks_per_chunk) * unit.unit_bytes  # the null block and one more
    if cap < need:
        fail(f"kvpool: the daemon's budget ({cap} B) is smaller than this model's smallest "
             f"KV allocation ({need} B: {layers} layers of {page} B blocks; "
             f"{unit.describe()})")
    config.cache_config.kv_cache_memory_bytes = cap
    if config.device_config.device_type == "cpu" and pc.tensor_parallel_size == 1:
        pc.distributed_executor_backend = "uni"
    os.environ.setdefault("KVPOOL_RUN_DIR", str(where))
    say(f"kvpool: API server pid {os.getpid()}: KV cache of {served_name(s.name, config)!r} comes "
        f"from the kvpool daemon at {where} ({pool.backend} backend, budget {pool.budget} B, "
        f"page {pool.page_size} B); the engine core registers the tenant")
    sys.stderr.flush()
