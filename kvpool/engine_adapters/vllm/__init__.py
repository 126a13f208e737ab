"""vLLM as a kvpool tenant: its KV cache becomes elastic memory the daemon arbitrates.

Loaded by vLLM itself through the ``vllm.general_plugins`` entry point (in the API server,
the engine core and any worker), active only with ``KVPOOL_ENABLE=1``. When active it is
never silent: each process prints one ``kvpool:`` line saying what it does (the engine core
names the tenant it registered as), and it refuses to start, with one line, when vLLM's
version is untested (``KVPOOL_VLLM_UNTESTED=1`` overrides), no daemon answers, the budget
cannot hold one KV chunk, or the server uses pipeline or data parallelism (tensor
parallelism is one gang: :mod:`kvpool.engine_adapters.vllm.tp`).

Seams (details in :mod:`kvpool.engine_adapters.vllm.patches` and docs/VLLM-ADAPTER.md):
KV allocation (region-group views, vLLM's reshape/bind untouched), memory sizing (the
virtual capacity), the scheduler's block pool (mapped blocks only, shortfalls asked of
kvpool without waiting), shrink (page-aware prefix eviction, then vLLM's own preemption).
"""

from __future__ import annotations

import os

from kvpool.engine_adapters.vllm.settings import (
    TESTED_VERSIONS,
    AdapterError,
    Settings,
    check_version,
    enabled,
    say,
)

_registered = False


def register() -> None:
    """The entry point vLLM calls in every process it starts."""
    global _registered
    if _registered or not enabled():
        return
    _registered = True
    import vllm

    from kvpool.engine_adapters.vllm.bridge import VllmBridge
    from kvpool.engine_adapters.vllm.patches import install

    try:
        s = Settings.from_env()
    except ValueError as e:  # a bad KVPOOL_* value: one line, no trace
        raise SystemExit(f"kvpool: {e}") from None
    msg = check_version(vllm.__version__, s.untested_ok)
    if msg is not None and not s.untested_ok:
        raise SystemExit(msg)
    if msg is not None:
        say(msg)
    install(VllmBridge(s))  # this process's one adapter object, held by the patches
    say(f"kvpool: vLLM {vllm.__version__} plugin active in pid {os.getpid()}")


__all__ = ["AdapterError", "Settings", "TESTED_VERSIONS", "register"]
