"""How a vLLM server joins kvpool: ``KVPOOL_*`` environment variables, read once per process.

vLLM starts its engine core (and, with several ranks, its workers) as fresh processes that
inherit the API server's environment, so the environment is the one channel that reaches
all of them with the same values.

Also what every part of the adapter says back: :class:`AdapterError` when it refuses,
:func:`say` for its one-line ``kvpool:`` notices.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

TESTED_VERSIONS = ("0.32.0",)


class AdapterError(RuntimeError):
    """vLLM, its configuration or kvpool's state is something this adapter refuses."""


def say(msg: str) -> None:
    """One ``kvpool:`` line on stderr, flushed (vLLM's processes buffer their logs)."""
    print(msg, file=sys.stderr, flush=True)


def enabled() -> bool:
    return os.environ.get("KVPOOL_ENABLE") == "1"


@dataclass
class Settings:
    name: str | None = None  # tenant name; default: --served-model-name
    run_dir: str | None = None
    device: int = 0
    min_bytes: int | None = None
    max_bytes: int | None = None
    shares: float | None = None
    low: int = 1  # reserve watermarks, in chunks
    high: int = 2
    idle_timeout_s: float = 5.0
    untested_ok: bool = False
    sleepable: bool = False  # the daemon may put it to sleep (KVPOOL_SLEEPABLE)
    sleep_after_s: float | None = None  # sleep when idle this long (KVPOOL_SLEEP_AFTER)
    group: str | None = None  # shown by kvpool ps (KVPOOL_GROUP: a fleet's name)
    # KVPOOL_KV_UNIT: "small" (blocks padded, layers interleaved when that makes the
    # allocation unit small) or "exact" (vLLM's own layout and block)
    kv_unit: str = "small"
    # KVPOOL_PORT: the port this server listens on (its ``--port``), registered as its
    # loopback endpoint so a daemon's endpoints file lists it (docs/VLLM-ADAPTER.md)
    endpoint: str | None = None

    @classmethod
    def from_env(cls) -> Settings:
        """The settings ``KVPOOL_*`` sets; a bad value raises a ValueError of one line."""
        from kvpool.engine_adapters.env import tenant_fields
        from kvpool.sizes import parse_size

        env = os.environ
        s = cls(name=env.get("KVPOOL_TENANT") or None, run_dir=env.get("KVPOOL_RUN_DIR") or None,
                untested_ok=env.get("KVPOOL_VLLM_UNTESTED") == "1",
                group=env.get("KVPOOL_GROUP") or None)
        if env.get("KVPOOL_DEVICE"):
            s.device = int(env["KVPOOL_DEVICE"])
        if env.get("KVPOOL_MIN"):
            s.min_bytes = parse_size(env["KVPOOL_MIN"])
        if env.get("KVPOOL_MAX"):
            s.max_bytes = parse_size(env["KVPOOL_MAX"])
        if env.get("KVPOOL_IDLE_TIMEOUT"):
            s.idle_timeout_s = float(env["KVPOOL_IDLE_TIMEOUT"])
        # SettingsError: one line (KVPOOL_SHARES, or KVPOOL_WEIGHT: its old name)
        read = tenant_fields(env, {"shares", "sleepable", "sleep_after_s", "kv_unit"})
        s.shares = read.get("shares")
        s.kv_unit = read.get("kv_unit", "small")
        s.sleepable = read.get("sleepable", False)
        s.sleep_after_s = read.get("sleep_after_s")
        port = env.get("KVPOOL_PORT")
        if port:
            if not port.isdigit() or not 1 <= int(port) <= 65535 or port != str(int(port)):
                raise ValueError(f"KVPOOL_PORT={port[:40]!r}: expected a port, 1..65535")
            s.endpoint = f"http://127.0.0.1:{int(port)}"
        return s


def check_version(version: str, untested_ok: bool) -> str | None:
    """None when ``version`` is tested; else the refusal (or, when allowed, the warning)."""
    if version in TESTED_VERSIONS:
        return None
    return (f"kvpool: vLLM {version} is not a version this adapter was tested with "
            f"({', '.join(TESTED_VERSIONS)})" +
            ("; KVPOOL_VLLM_UNTESTED=1 given, trying anyway" if untested_ok else
             "; set KVPOOL_VLLM_UNTESTED=1 to try it anyway"))
