"""How the fleet starts and watches each engine's OpenAI server: the :class:`ServerKind`
seam, its two kinds, and :data:`KINDS` (a :class:`kvpool.registry.Registry` keyed by a
fleet entry's ``engine``).

* ``bundled``: ``kvpool serve CKPT --elastic --sleepable ...`` (:func:`kvpool.launch.
  serve_argv`); its sleep state and counters at ``GET /kvpool/sleep`` (sleeps by
  reason: the cause of each is known); a member that is not elastic (``MemberSpec.
  elastic``: the ``swap`` policy's) is the plain ``kvpool serve CKPT --kv-cache-size``;
* ``vllm``: vLLM's OpenAI server with the kvpool plugin (``KVPOOL_ENABLE=1``) and
  ``VLLM_SERVER_DEV_MODE=1`` for vLLM's sleep routes; the plugin puts its own ``POST
  /wake_up`` (which wakes a sleep of kvpool's: the answer is the wake) and ``GET
  /kvpool/sleep`` (the bundled server's shape: sleeps by reason) before vLLM's
  (:mod:`kvpool.engine_adapters.vllm.sleep_routes`); the fleet's looks (``QUIET_PATHS``)
  are kept out of its access log (``--disable-access-log-for-endpoints``). Its weights
  stay in its own memory (``weights = "local"``: a sleep frees its KV alone). One that is
  not elastic is vLLM alone with ``--kv-cache-memory-bytes`` (the entry's
  ``kv_cache_size``; no ``/kvpool/sleep``: the fleet sees it awake).

Every member gets the tenant's knobs through the ``KVPOOL_*`` variables its adapter reads
(:mod:`kvpool.engine_adapters.env`), its tenant name (``KVPOOL_TENANT``) and the fleet's
name as its tenant group (``KVPOOL_GROUP``: ``kvpool ps`` shows it), and none of the
fleet's own ``KVPOOL_*`` settings (a member is configured by the fleet file alone).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol

from kvpool import launch
from kvpool.engine_adapters.env import TENANT_VARS
from kvpool.fleet.entries import ModelEntry
from kvpool.registry import Registry

#: variables a member never inherits from the fleet's environment
# (KVPOOL_WEIGHT: KVPOOL_SHARES's old name, which would clash with the member's own)
NOT_INHERITED = (*TENANT_VARS, "KVPOOL_WEIGHT", "KVPOOL_ENABLE", "KVPOOL_WEIGHTS",
                 "KVPOOL_GROUP")
#: the paths a fleet looks at (a vLLM member's access log leaves them out)
QUIET_PATHS = ("/health", "/kvpool/sleep", "/is_sleeping")
#: a sleep's reason as a server counts it -> the fleet's cause
CAUSE_OF = {"idle": "idle", "pressure": "pressure", "operator": "operator",
            "http": "operator"}


@dataclass(frozen=True)
class Launch:
    """A member's command line and the environment it runs in (complete, not added to
    the fleet's)."""

    argv: list[str]
    env: dict[str, str]


@dataclass(frozen=True)
class Observed:
    """What one look at a server's sleep state found. ``sleeps`` (cause -> count since
    the server started) and ``wakes`` are None when the server does not count them."""

    asleep: bool
    sleeps: Mapping[str, int] | None = None
    wakes: int | None = None


@dataclass(frozen=True)
class MemberSpec:
    """Who a member is: the entry, its tenant, its fleet (group) and daemon (run dir);
    ``elastic``: its KV in the daemon's pool (else a static KV of the entry's
    ``kv_cache_size`` in the server's own memory, weights local: the ``swap`` policy's)."""

    entry: ModelEntry
    tenant: str
    group: str
    run_dir: Path
    base_env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    elastic: bool = True


class ServerKind(Protocol):
    """One engine's server as the fleet runs it.

    Caller's obligations: ``launch`` is given a free loopback port; the fleet starts the
    command in a process group of its own and stops the group; it calls ``GET
    <state_path>`` only once ``GET /health`` answered 200, and hands the decoded JSON body
    to ``observe`` (which raises ValueError, one line, for a body it cannot read);
    ``POST /wake_up`` wakes the server (200 once awake)."""

    state_path: str
    #: where its KV figures are read (``GET``, JSON for
    #: :func:`~kvpool.fleet.router_protocol.member_kv`) after each state look; None: none
    stats_path: str | None
    #: flags of the server's command line the fleet sets from the entry's keys (a fleet
    #: file's ``args`` may not give them)
    reserved_args: tuple[str, ...]

    def launch(self, member: MemberSpec, port: int) -> Launch: ...

    def observe(self, body: Any) -> Observed: ...


def member_env(member: MemberSpec, extra: Mapping[str, str]) -> dict[str, str]:
    """The fleet's environment without its ``KVPOOL_*`` tenant settings, plus the
    member's tenant, group, daemon and knobs, plus ``extra``."""
    e = member.entry
    env = {k: v for k, v in member.base_env.items() if k not in NOT_INHERITED}
    env |= {"KVPOOL_RUN_DIR": str(member.run_dir), "KVPOOL_TENANT": member.tenant,
            "KVPOOL_GROUP": member.group}
    if e.min is not None:
        env["KVPOOL_MIN"] = str(e.min)
    if e.max is not None:
        env["KVPOOL_MAX"] = str(e.max)
    if e.shares is not None:
        env["KVPOOL_SHARES"] = repr(e.shares)
    return env | dict(extra)


class Bundled:
    """``kvpool serve --elastic`` (:mod:`kvpool.engine_adapters.bundled`)."""

    state_path = "/kvpool/sleep"
    stats_path: str | None = "/v1/stats"
    reserved_args: tuple[str, ...] = ("--host", "--port", "--served-model-name", "--elastic", "--sleepable",
                     "--sleep-after", "--weights", "--kv-cache-size", "--max-num-seqs",
                     "--pd", "--role")

    def launch(self, member: MemberSpec, port: int) -> Launch:
        e = member.entry
        if not member.elastic:  # a static KV, weights in the process: the plain server
            argv = launch.serve_argv(e.checkpoint, "--max-num-seqs", str(e.max_num_seqs),
                                     *e.args, port=port, name=e.name,
                                     kv_cache_size=e.kv_cache_size)
            return Launch(argv, member_env(member, {}))
        extra = ["--weights", e.weights, "--max-num-seqs", str(e.max_num_seqs)]
        if e.sleepable:
            extra.append("--sleepable")
        if e.sleep_after is not None:
            extra += ["--sleep-after", repr(e.sleep_after)]
        argv = launch.serve_argv(e.checkpoint, *extra, *e.args, port=port, name=e.name,
                                 kv_cache_size=e.kv_cache_size, elastic=True)
        return Launch(argv, member_env(member, {}))

    def observe(self, body: Any) -> Observed:
        return observe_counts(body)


def observe_counts(body: Any) -> Observed:
    """A ``GET /kvpool/sleep`` body (the bundled server's, and the vLLM plugin's: one
    shape): the state, the sleeps by cause (:data:`CAUSE_OF`), the wakes."""
    if not isinstance(body, dict) or not isinstance(body.get("is_sleeping"), bool):
        raise ValueError(f"unexpected sleep state {str(body)[:80]!r}")
    sleeps: dict[str, int] = {}
    counted = body.get("sleeps")
    for reason, n in (counted.items() if isinstance(counted, dict) else ()):
        cause = CAUSE_OF.get(str(reason))
        if cause is not None and isinstance(n, int):
            sleeps[cause] = sleeps.get(cause, 0) + n
    wakes = body.get("wakes")
    return Observed(body["is_sleeping"], sleeps, wakes if isinstance(wakes, int) else None)


class Vllm:
    """vLLM's OpenAI server with the kvpool plugin (:mod:`kvpool.engine_adapters.vllm`)."""

    state_path = "/kvpool/sleep"
    stats_path: str | None = None  # (its KV use is vLLM's own /metrics')
    reserved_args: tuple[str, ...] = ("--host", "--port", "--model", "--served-model-name",
                                      "--max-num-seqs", "--disable-access-log-for-endpoints")

    def launch(self, member: MemberSpec, port: int) -> Launch:
        e = member.entry
        argv = [*launch.module_argv("vllm.entrypoints.openai.api_server"),
                "--model", str(e.checkpoint), "--served-model-name", e.name,
                "--host", "127.0.0.1", "--port", str(port),
                "--max-num-seqs", str(e.max_num_seqs), "--disable-log-stats",
                # the fleet's looks, twice a second, kept out of the member's log
                "--disable-access-log-for-endpoints", ",".join(QUIET_PATHS), *e.args]
        if not member.elastic:  # vLLM alone, its KV fixed at kv_cache_size (after args: ours)
            argv += ["--kv-cache-memory-bytes", str(e.kv_cache_size)]
            return Launch(argv, member_env(member, {"VLLM_SERVER_DEV_MODE": "1",
                                                    "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}))
        extra = {"KVPOOL_ENABLE": "1", "VLLM_SERVER_DEV_MODE": "1",
                 "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        if e.sleepable:
            extra["KVPOOL_SLEEPABLE"] = "1"
        if e.sleep_after is not None:
            extra["KVPOOL_SLEEP_AFTER"] = repr(e.sleep_after)
        return Launch(argv, member_env(member, extra))

    def observe(self, body: Any) -> Observed:
        return observe_counts(body)


#: every server kind by a fleet entry's ``engine``
KINDS: Registry[ServerKind] = Registry("engine")
KINDS.register("bundled", Bundled())
KINDS.register("vllm", Vllm())
