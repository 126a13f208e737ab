"""A fleet file (``FLEET.toml``): :class:`FleetConfig` and its :class:`ModelEntry` s, read
and checked by :func:`load` before anything starts.

The file is untrusted input. Every problem is one line naming the file and the key
(``fleet.toml: models[2].max: cannot parse size 'lots' ...``) and :func:`load` reports
them all at once (:class:`FleetConfigError`); the CLI prints them and exits 2. Checked:

* unknown tables and keys (a typo never silently falls back to a default); a model's
  ``weight`` (the old name of ``shares``, :mod:`kvpool.renames`) is read as ``shares``
  with one deprecation line on stderr, and refused beside ``shares``;
* every value's type and range (a TOML boolean is not a number; sizes as
  :func:`kvpool.sizes.parse_size` reads them, no percentages: a tenant's knobs are bytes);
* model names: tenant names (``[A-Za-z0-9._@:+-]``, at most 64 characters, replica
  ``i > 0`` adds ``-i``), no two models and no two replicas' tenants alike;
* ``engine`` a server kind of :data:`kvpool.fleet.engines.KINDS`, ``routing`` a picker
  of :data:`kvpool.fleet.balance.PICKERS` (the registries' names, not copies);
* ``[daemon]``: ``budget``, ``page_size`` and ``backend`` as the daemon reads them
  (:meth:`kvpool.daemon.config.Config.read`), except that ``backend`` defaults to
  ``host``;
* ``args``: strings, none of the flags the fleet sets itself (the kind's
  ``reserved_args``: ``--port`` ...);
* ``checkpoint``: a folder the engine can load (:func:`kvpool.fleet.checkpoint.inspect`:
  config.json and weight files, read without loading the weights);
* ``[fleet] policy``: a name of :data:`kvpool.fleet.policies.FLEET_POLICIES`, its knobs
  in ``[fleet]`` each in its range (:class:`~kvpool.fleet.policies.Knob`), a knob of
  another policy refused (naming whose it is), a model key the policy sets itself
  (``FleetPolicy.decides``) refused unless given with the value the policy sets, and a
  baseline policy only with ``--with-daemon``;
* with ``--with-daemon``, ``[daemon] budget`` must hold the largest model's weights (when
  they live in the pool) plus one KV chunk: a smaller one could never serve that model
  (a vLLM member's chunk is its plugin's: whole allocation units holding two of vLLM's
  blocks, :func:`kvpool.fleet.checkpoint.vllm_kv_chunk_bytes`).
  (A percentage budget is resolved by the daemon against the device: not checked here.)
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any, Callable

from kvpool.daemon.config import Config
from kvpool.fleet.balance import PICKERS
from kvpool.fleet.checkpoint import (CheckpointInfo, holds_float32, inspect, kv_chunk_bytes,
                                     vllm_kv_chunk_bytes)
from kvpool.fleet.engines import KINDS
from kvpool.fleet.entries import DaemonSection, FleetConfig, ModelEntry
from kvpool.fleet.policies import FLEET_POLICIES, FleetPolicy, Knob, knob_owners
from kvpool.protocol.bounds import MAX_SHARES
from kvpool.renames import both_line, deprecated_line, say
from kvpool.sizes import format_size, parse_size
from kvpool.vmm.host import DEFAULT_PAGE_SIZE

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["DAEMON_KEYS", "DaemonSection", "FleetConfig", "FleetConfigError", "ModelEntry",
           "load"]

WEIGHTS = ("pool", "local")
NAME = re.compile(r"^[A-Za-z0-9._@:+-]{1,64}$")  # kvpool.protocol.bounds.Name
MAX_REPLICAS = 64
MAX_ARGS = 64
MAX_ARG_CHARS = 4096
MAX_BYTES = 1 << 50
#: the ``[daemon]`` keys, each checked as the daemon's own config reads it
DAEMON_KEYS = ("budget", "page_size", "backend")


class FleetConfigError(ValueError):
    """The fleet file is not valid: ``problems`` holds one line per bad value."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


Inspect = Callable[[Path, str, bool], CheckpointInfo]


class _Table:
    """Reads one TOML table's keys, each checked; problems go to ``problems``
    (``source``: the file, for lines said at once)."""

    def __init__(self, values: Any, label: str, problems: list[str], known: tuple[str, ...],
                 source: str = ""):
        self.label, self.problems, self.source = label, problems, source
        if not isinstance(values, dict):
            problems.append(f"{label}: expected a table, got {_show(values)}")
            values = {}
        self.values: dict[str, Any] = values
        for key in values:
            if key not in known:
                problems.append(f"{self.at(key)}: unknown key (known: {', '.join(known)})")

    def at(self, key: str) -> str:
        return f"{self.label}.{key}" if self.label else key

    def bad(self, key: str, why: str) -> None:
        self.problems.append(f"{self.at(key)}: {why}")

    def get(self, key: str, default: Any, kind: type | tuple[type, ...], what: str) -> Any:
        if key not in self.values:
            return default
        v = self.values[key]
        if isinstance(v, bool) and kind is not bool:
            self.bad(key, f"expected {what}, got {_show(v)}")
            return default
        if not isinstance(v, kind):
            self.bad(key, f"expected {what}, got {_show(v)}")
            return default
        return v

    def text(self, key: str, default: Any, choices: tuple[str, ...] | None = None) -> Any:
        v = self.get(key, default, str, "a string")
        if key in self.values and isinstance(v, str):
            if not v.strip():
                self.bad(key, "must not be empty")
                return default
            if choices is not None and v not in choices:
                self.bad(key, f"{_show(v)} is not one of {', '.join(choices)}")
                return default
        return v

    def integer(self, key: str, default: int, lo: int, hi: int) -> int:
        v = self.get(key, default, int, "an integer")
        if key in self.values and isinstance(v, int) and not lo <= v <= hi:
            self.bad(key, f"{v} is out of range ({lo} to {hi})")
            return default
        return int(v)

    def number(self, key: str, default: float | None, lo: float, hi: float,
               lo_open: bool = True) -> float | None:
        v = self.get(key, default, (int, float), "a number")
        if key in self.values and isinstance(v, (int, float)):
            f = float(v)
            if not math.isfinite(f) or not (f > lo if lo_open else f >= lo) or f > hi:
                self.bad(key, f"{_show(v)} is out of range ({'more than ' if lo_open else ''}"
                              f"{lo:g} to {hi:g})")
                return default
            return f
        return v if v is None else float(v)

    def flag(self, key: str, default: bool) -> bool:
        return bool(self.get(key, default, bool, "true or false"))

    def size(self, key: str, default: int | None, positive: bool) -> int | None:
        v = self.get(key, default, (int, str), "a size (e.g. \"512MiB\") or a byte count")
        if key not in self.values or not isinstance(v, (int, str)):
            return default
        if isinstance(v, str) and v.strip().endswith("%"):
            self.bad(key, f"{_show(v)}: a percentage is not allowed here (bytes: \"512MiB\")")
            return default
        try:
            n = parse_size(v)
        except ValueError as e:
            self.bad(key, str(e))
            return default
        if n > MAX_BYTES:
            self.bad(key, f"{_show(v)} is too large")
            return default
        if positive and n == 0:
            self.bad(key, "must be more than 0")
            return default
        return n


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def load(path: str | Path, with_daemon: bool = False, inspect_checkpoint: Inspect = inspect
         ) -> FleetConfig:
    """Read and check the fleet file at ``path`` (see the module); raises
    :class:`FleetConfigError` listing every problem. ``inspect_checkpoint`` reads a model
    folder (the default opens config.json and lists the weight files)."""
    path = Path(path)
    shown = str(path)
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise FleetConfigError([f"{shown}: not valid TOML: {e}"]) from None
    except OSError as e:
        raise FleetConfigError([f"{shown}: {e.strerror or e}"]) from None
    problems: list[str] = []
    top = _Table(raw, "", problems, ("fleet", "daemon", "models"))
    fleet = _Table(raw.get("fleet", {}), "fleet", problems, (*FLEET_KEYS, *knob_owners()))
    name = fleet.text("name", path.stem)
    if not NAME.match(str(name)):
        where = "fleet.name" if "name" in fleet.values else "fleet.name (the file's name)"
        problems.append(f"{where}: {_show(name)} is not a tenant group name (1 to 64 of "
                        f"A-Z a-z 0-9 . _ @ : + -)")
    host = fleet.text("host", "127.0.0.1")
    port = fleet.integer("port", 8080, 0, 65535)
    queue = fleet.integer("queue", 64, 1, 1_000_000)
    start_timeout = fleet.number("start_timeout_s", 180.0, 0, 86400)
    hung_after = fleet.number("hung_after_s", 30.0, 0, 86400)
    hung_restart = fleet.number("hung_restart_s", 120.0, 0, 86400)
    if hung_after is not None and hung_restart is not None and hung_restart < hung_after:
        fleet.bad("hung_restart_s", f"{hung_restart:g} is less than hung_after_s "
                                    f"({hung_after:g})")
    policy, knobs = _policy(fleet, with_daemon)
    daemon = _daemon(_Table(raw.get("daemon", {}), "daemon", problems, DAEMON_KEYS))
    models_raw = raw.get("models", [])
    if not isinstance(models_raw, list):
        top.bad("models", "expected [[models]] tables")
        models_raw = []
    elif not models_raw:
        problems.append("models: no [[models]] entry (a fleet serves at least one model)")
    base = path.parent
    entries: list[tuple[int, ModelEntry, CheckpointInfo | None]] = []
    for i, values in enumerate(models_raw):
        if not isinstance(values, dict):
            problems.append(f"models[{i}]: expected a table, got {_show(values)}")
            continue
        t = _Table(values, f"models[{i}]", problems, MODEL_KEYS, shown)
        got = _model(t, base, daemon.backend, inspect_checkpoint)
        if got is not None and _decided(t, got[0], policy):
            entries.append((i, *got))
    _unique(entries, problems)
    if with_daemon:  # (the models as the policy starts them: swap's weights are local)
        _fits(daemon, [(i, policy.member(e), info) for i, e, info in entries], problems)
    if problems:
        raise FleetConfigError([f"{shown}: {p}" for p in problems])
    assert start_timeout is not None and hung_after is not None and hung_restart is not None
    return FleetConfig(path=path, name=str(name), host=str(host), port=port, queue=queue,
                       start_timeout_s=start_timeout, hung_after_s=hung_after,
                       hung_restart_s=hung_restart, daemon=daemon,
                       models=tuple(e for _, e, _ in entries), policy=policy.name,
                       policy_knobs=knobs)


FLEET_KEYS = ("name", "host", "port", "queue", "start_timeout_s", "hung_after_s",
              "hung_restart_s", "policy")  # (and every policy's knobs)


def _policy(t: _Table, with_daemon: bool) -> tuple[FleetPolicy, dict[str, float]]:
    """``[fleet] policy`` and its knobs (each checked; the defaults where none is given).
    A knob of another policy is refused, naming whose it is; a baseline needs the fleet's
    own daemon (``--with-daemon``)."""
    given = t.values.get("policy", "kvpool")
    name = t.text("policy", "kvpool", FLEET_POLICIES.names())
    if name != given:  # (refused: its line is said; the knobs are not judged against it)
        return FLEET_POLICIES.lookup("kvpool"), {}
    policy = FLEET_POLICIES.lookup(name)
    mine = {k.name for k in policy.knobs}
    for key, owners in knob_owners().items():
        if key in t.values and key not in mine:
            t.bad(key, f"a knob of policy {' and '.join(repr(o) for o in owners)}, not of "
                       f"{name!r} (fleet.policy)")
    knobs = {k.name: _knob(t, k) for k in policy.knobs}
    if policy.baseline and not with_daemon:
        t.bad("policy", f"{name!r} is a baseline: it runs only on a daemon of its own "
                        f"(kvpool fleet --with-daemon), whose whole budget it shares")
    return policy, knobs


def _knob(t: _Table, knob: Knob) -> float:
    v = t.get(knob.name, knob.default, (int, float), "a number")
    if knob.name not in t.values or not isinstance(v, (int, float)):
        return knob.default
    why = knob.problem(float(v))
    if why is not None:
        t.bad(knob.name, why)
        return knob.default
    return float(v)


def _decided(t: _Table, entry: ModelEntry, policy: FleetPolicy) -> bool:
    """A model key the policy sets itself may be given only with the value it sets
    (one problem each otherwise); False when one was refused."""
    ok = True
    member = policy.member(entry)
    for key in policy.decides:
        given = next((k for k in ((key, "weight") if key == "shares" else (key,))
                      if k in t.values), None)
        if given is not None and getattr(entry, key) != getattr(member, key):
            ours = getattr(member, key)
            t.bad(given, f"policy {policy.name!r} sets {key} itself "
                         f"({'unset' if ours is None else _show(ours)}; see fleet.policy)")
            ok = False
    return ok


MODEL_KEYS = ("name", "checkpoint", "engine", "replicas", "eager", "min", "max", "shares",
              "weight", "sleepable", "sleep_after", "weights", "kv_cache_size", "max_num_seqs",
              "routing", "args")


def _daemon(t: _Table) -> DaemonSection:
    """``[daemon]``: each value read by the daemon's own config (a bad one: its line, and
    the default)."""
    read: dict[str, Any] = {}
    for key in DAEMON_KEYS:
        if key in t.values:
            try:
                read[key] = Config.read(key, t.values[key])
            except ValueError as e:
                t.bad(key, f"{_show(t.values[key])}: {e}")
    budget, page = read.get("budget"), read.get("page_size")
    return DaemonSection(budget=None if budget is None else str(budget),
                         page_size=None if page is None else str(parse_size(page)),
                         backend=read.get("backend", "host"))


def _model(t: _Table, base: Path, backend: str, inspect_checkpoint: Inspect
           ) -> tuple[ModelEntry, CheckpointInfo | None] | None:
    problems_before = len(t.problems)
    name = t.text("name", None)
    if "name" not in t.values:
        t.bad("name", "missing (the model name requests give)")
    elif isinstance(name, str) and not NAME.match(name):
        t.bad("name", f"{_show(name)} is not a tenant name (1 to 64 of A-Z a-z 0-9 . _ @ : + -)")
    engine = t.text("engine", "bundled", KINDS.names())
    replicas = t.integer("replicas", 1, 1, MAX_REPLICAS)
    if isinstance(name, str) and NAME.match(name) and replicas > 1 \
            and not NAME.match(f"{name}-{replicas - 1}"):
        t.bad("name", f"{_show(name)} is too long for {replicas} replicas (tenant "
                      f"{name}-{replicas - 1} has more than 64 characters)")
    eager = t.flag("eager", False)
    mn = t.size("min", None, positive=False)
    mx = t.size("max", None, positive=True)
    if mn is not None and mx is not None and mn > mx:
        t.bad("min", f"{format_size(mn)} is more than max ({format_size(mx)})")
    shares = _shares(t)
    sleepable = t.flag("sleepable", True)
    sleep_after = t.number("sleep_after", None, 0, 86400)
    weights = t.text("weights", "pool" if engine == "bundled" else "local", WEIGHTS)
    if engine != "bundled" and "weights" in t.values and weights == "pool":
        t.bad("weights", f"a {engine} server keeps its weights in its own memory (local)")
    kv = t.size("kv_cache_size", 256 << 20, positive=True)
    seqs = t.integer("max_num_seqs", 32, 1, 4096)
    routing = t.text("routing", "least_loaded", PICKERS.names())
    args = _args(t, engine)
    ckpt = t.text("checkpoint", None)
    info: CheckpointInfo | None = None
    folder = Path()
    if "checkpoint" not in t.values:
        t.bad("checkpoint", "missing (the model's folder)")
    elif isinstance(ckpt, str):
        folder = (base / ckpt).resolve()
        try:
            info = inspect_checkpoint(folder, engine, holds_float32(backend, args, engine))
        except ValueError as e:
            t.bad("checkpoint", _one_line(e))
    if len(t.problems) > problems_before:
        return None
    assert isinstance(name, str) and kv is not None
    return ModelEntry(name=name, checkpoint=folder, engine=engine, replicas=replicas,
                      eager=eager, min=mn, max=mx, shares=shares, sleepable=sleepable,
                      sleep_after=sleep_after, weights=weights, kv_cache_size=kv,
                      max_num_seqs=seqs, routing=routing, args=args), info


def _shares(t: _Table) -> float | None:
    """``shares``, or ``weight``: its old name, read with its deprecation line (for one
    release); both given: one problem."""
    if "weight" not in t.values:
        return t.number("shares", None, 0, MAX_SHARES)
    if "shares" in t.values:
        t.bad("weight", both_line("weight", "shares"))
        return None
    say(deprecated_line("weight", "shares", f"{t.source}: {t.at('')}"))
    return t.number("weight", None, 0, MAX_SHARES)


def _args(t: _Table, engine: str) -> tuple[str, ...]:
    args = t.get("args", [], list, "a list of strings")
    if len(args) > MAX_ARGS:
        t.bad("args", f"{len(args)} arguments (at most {MAX_ARGS})")
        return ()
    out: list[str] = []
    for j, a in enumerate(args):
        if not isinstance(a, str) or isinstance(a, bool):
            t.bad("args", f"[{j}]: expected a string, got {_show(a)}")
        elif len(a) > MAX_ARG_CHARS or "\0" in a:
            t.bad("args", f"[{j}]: more than {MAX_ARG_CHARS} characters, or a NUL")
        elif a.split("=", 1)[0] in KINDS.lookup(engine).reserved_args:
            t.bad("args", f"[{j}]: {_show(a)} is set by the fleet (use the entry's keys)")
        else:
            out.append(a)
    return tuple(out)


def _unique(entries: list[tuple[int, ModelEntry, CheckpointInfo | None]],
            problems: list[str]) -> None:
    """No model name twice; no tenant name (``name``, ``name-i``) twice."""
    owner: dict[str, int] = {}  # tenant name -> the model it is a replica of
    names: dict[str, int] = {}
    for i, e, _ in entries:
        if e.name in names:
            problems.append(f"models[{i}].name: {_show(e.name)} is also models[{names[e.name]}]"
                            f"'s name")
            continue
        names[e.name] = i
        clash = next((t for t in (e.tenant(r) for r in range(e.replicas)) if t in owner), None)
        if clash is not None:
            problems.append(f"models[{i}].name: its tenant {_show(clash)} is also "
                            f"models[{owner[clash]}]'s")
            continue
        for r in range(e.replicas):
            owner[e.tenant(r)] = i


def _fits(daemon: DaemonSection, entries: list[tuple[int, ModelEntry, CheckpointInfo | None]],
          problems: list[str]) -> None:
    """``--with-daemon``: the budget holds the largest model's weights (pool) plus one KV
    chunk (whole pages)."""
    if daemon.budget is None or str(daemon.budget).strip().endswith("%"):
        return  # resolved by the daemon against the device
    budget = parse_size(daemon.budget)
    # (no page_size: the host backend's default, also the usual CUDA granularity)
    page = parse_size(daemon.page_size) if daemon.page_size is not None else DEFAULT_PAGE_SIZE
    worst: tuple[int, int, ModelEntry] | None = None
    for _, e, info in entries:
        if info is None:
            continue
        weights = -(-info.weight_bytes // page) * page if e.weights == "pool" else 0
        chunk = kv_chunk_bytes(info, page) if e.engine == "bundled" else \
            vllm_kv_chunk_bytes(info, page, daemon.backend, e.args)
        if worst is None or weights + chunk > worst[0] + worst[1]:
            worst = (weights, chunk, e)
    if worst is not None and worst[0] + worst[1] > budget:
        weights, chunk, e = worst
        problems.append(
            f"daemon.budget: {format_size(budget)} cannot hold the largest model "
            f"({e.name}: {format_size(weights)} of weights in the pool plus one KV chunk "
            f"of {format_size(chunk)})")


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:300]
