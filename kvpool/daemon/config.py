"""The daemon's configuration: one dataclass, filled from defaults, a TOML file and flags,
validated once at start against a typed schema.

TOML layout (see ``systemd/kvpool.toml``)::

    backend = "auto"          # auto | host | cuda
    device = 0
    devices = "all"           # every device in one daemon: "all", a count "2" (0..1) or a
                              # list "0,1" (unset: the one ``device``; kvpool.daemon.devices)
    budget = "80%"            # bytes, a size ("24GiB") or a share of device memory (each
                              # device's, with ``devices``)
    device_budgets = {"1" = "6GiB"}  # one device's budget instead of ``budget``
    page_size = "2MiB"
    huge_pages = false        # host: pages on hugetlb memory (needs vm.nr_hugepages)
    run_dir = "/run/kvpool"
    socket_group = "kvpool"   # group owning the run directory (0750) and sockets (0660)
    admin_group = "kvpool-admin"  # members may change others' knobs and stop the daemon
    reclaim_timeout_s = 2.0   # deadline of a reclaim (a waiting grant gets NO_MEMORY after)
    recover_timeout_s = 5.0   # after a restart, wait this long for old tenants to report
    warm_min = "0"            # zeroed pages kept ready (size or page count "16p")
    warm_max = "256MiB"
    default_max = "100%"      # a tenant's hard limit unless configured (share of budget)
    # caps and loop tuning (max_sessions, burst, idle_work_s ...): see the Config
    # fields below, each documented where it is defined

    [tenants.llama-8b]        # per-tenant policy by name
    min = "4GiB"
    max = "20GiB"
    shares = 2.0              # its part of contended memory (a proportional count; the
                              # old name ``weight`` still works, with a deprecation line)
    uids = [1001]             # who may claim the name (and/or group = "llm"); neither:
                              # the daemon's own uid only (a warning at start says so)
    handoff_to = ["decode"]   # may hand pages to these tenants though another uid runs them
    sleepable = true          # may be put to sleep when idle and a grant needs its memory
                              # (unset: what the tenant asks at registration; else no)

Validation (:meth:`Config.load`): each value is converted with ``msgspec`` against the
field's annotated type (``Meta`` bounds: timers finite and positive, counts at least 1,
``device`` >= 0, ``shares`` in (0, 10000]) and sizes are parsed; every problem becomes
one line of :class:`ConfigError`. What needs the device's memory (the budget against
the device, tenants' ``min`` against the budget) is :meth:`Config.check_budget`, called
where the backend is opened. A loaded :class:`Config` never makes the daemon raise later.

``huge_pages`` (host backend): pages are hugetlb memfds, one page-table entry per huge
page instead of 512 (a handoff's unmap and the receiver's first touches stop costing
about a copy). Load refuses it with ``backend = "cuda"`` or a page size that is not a
multiple of the kernel's huge page size; :meth:`check_budget` then measures the budget
against the huge page pool (``vm.nr_hugepages``, or the ``hugepages=`` kernel
argument) and refuses a pool too small for the pages the daemon pre-creates
(``warm_min``). Pages' huge pages are reserved when created, so an exhausted pool
refuses a grant (NO_MEMORY) and never makes a process's first touch SIGBUS.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import msgspec
from msgspec import Meta

from kvpool.daemon import config_values as values_
from kvpool.protocol.bounds import Shares
from kvpool.renames import renamed_key
from kvpool.sizes import format_size, parse_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# ---- the schema's types ---------------------------------------------------------------
Seconds = Annotated[float, Meta(gt=0, le=86400)]  # rejects nan and inf too
Count = Annotated[int, Meta(ge=1, le=1 << 40)]
Size = int | str  # checked by parse_size (see config_values.SIZE_RULES)
MAX_DEVICES = 64  # devices one daemon serves


class ConfigError(ValueError):
    """Invalid configuration: ``problems`` holds one line per bad value."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclass
class TenantPolicy:
    """Arbitration knobs of a tenant (cgroup-v2 memory.min/max; ``shares`` as cgroup
    cpu.shares: a proportional count), and who may claim its name (``uids``, ``group``;
    both empty: the daemon's own uid only, :func:`kvpool.daemon.auth.may_claim`)."""

    min: Size = 0
    max: Size | None = None  # None: the daemon's default_max
    shares: Shares = 1.0
    uids: list[Annotated[int, Meta(ge=0, le=(1 << 32) - 2)]] = field(default_factory=list)
    group: str | None = None
    # tenants this one may hand pages to although they run as another uid (page handoff)
    handoff_to: list[Annotated[str, Meta(min_length=1, max_length=64)]] = field(
        default_factory=list)
    # the daemon may put it to sleep when a grant cannot be met otherwise (kvpool.daemon
    # .sleep); None: what the tenant asked at registration (Register.sleepable), else no
    sleepable: bool | None = None


@dataclass
class Config:
    """Everything the daemon needs. Sizes may be strings until resolved against the
    device (``budget``) or the budget (tenants' ``min``/``max``, ``default_max``)."""

    backend: str = "auto"  # "auto" or a backend of kvpool.vmm.registry.REGISTRY
    device: Annotated[int, Meta(ge=0, le=4096)] = 0
    # every device in one daemon (a pool and an arbiter each): "all", a count "N"
    # (devices 0..N-1) or a list "0,1,3"; None: the one ``device``
    devices: Optional[Annotated[str, Meta(pattern=r"^(all|[0-9]{1,4}(,[0-9]{1,4})*)$")]] = None
    budget: Size = "80%"
    # a device's own budget (by ordinal, "1" = "6GiB"), instead of ``budget``
    device_budgets: dict[Annotated[str, Meta(pattern=r"^[0-9]{1,4}$")], Size] = field(
        default_factory=dict)
    page_size: Size | None = None  # None: the backend's default
    huge_pages: bool = False  # host backend: back pages with hugetlb memory (see above)
    run_dir: str | None = None
    socket_mode: Annotated[int, Meta(ge=0, le=0o777)] = 0o660  # TOML 0o660, or "0660"
    socket_group: str | None = None
    admin_group: str | None = None  # besides root and the daemon's own uid
    warm_min: Size = 0
    warm_max: Size = "256MiB"
    default_max: Size = "100%"
    tenants: dict[str, TenantPolicy] = field(default_factory=dict)
    # timers (seconds)
    liveness_s: Seconds = 0.25  # how often to check tenant pids (pidfds cover most cases)
    register_timeout_s: Seconds = 10.0  # fd-channel sessions that never register are dropped
    send_timeout_s: Seconds = 2.0  # a tenant whose fd socket stays full this long is dropped
    # a claimed handoff waits this long for the giver to let go of the pages (host)
    handoff_letgo_s: Seconds = 2.0
    reclaim_timeout_s: Seconds = 2.0  # deadline of reclaim asks and of requests waiting on them
    # how contended memory is split: "fair_share" (weighted max-min, the default),
    # "priority" (most shares first, floors kept) or "first_come" (none: what a tenant
    # holds is its share; a fleet baseline's); kvpool/daemon/policy.py
    reclaim_policy: str = "fair_share"
    recover_timeout_s: Annotated[float, Meta(ge=0, le=86400)] = 5.0  # after a restart
    log_level: str = "INFO"  # one of config_values.LOG_LEVELS, any case
    metrics_address: str | None = None  # HOST:PORT of the Prometheus exporter (None: off)
    metrics_allow_remote: bool = False  # a non-loopback metrics_address is refused unless set
    # a router's file-discovery endpoints.yaml of the servers registered here (None: off;
    # kvpool.daemon.endpoints), the address routers reach them at (None: this machine's
    # by its host name) and the entries' namespace
    endpoints_file: Optional[Annotated[str, Meta(max_length=4096)]] = None
    endpoints_address: Optional[Annotated[str, Meta(max_length=253)]] = None
    endpoints_namespace: str = "default"
    # caps (a session or tenant past one gets a clear refusal)
    max_sessions_per_uid: Count = 64
    max_sessions: Count = 1024
    max_groups_per_tenant: Count = 64
    max_virtual_pages_per_tenant: Count = 1 << 20
    max_queued_fds: Count = 1 << 17  # descriptors queued for one tenant (two of the largest grants)
    # loop tuning: how the one thread shares its time (defaults rarely need changing)
    idle_work_s: Seconds = 0.002  # idle maintenance (retire, refill warm pool) per loop turn
    adopt_wait_s: Seconds = 1.0  # how long an Adopt waits for the descriptors it announced
    short_backoff_s: Seconds = 0.5  # a tenant that answered a shrink short is asked again after
    status_interval_s: Seconds = 5.0  # sd_notify STATUS= line
    snapshot_timeout_s: Seconds = 2.0  # the metrics exporter's wait for a loop-built snapshot
    refusal_log_interval_s: Seconds = 1.0  # refused sessions are logged at most this often
    burst: Count = 64  # messages read from one socket per loop turn
    accept_burst: Count = 8  # fd-channel connections accepted per loop turn
    interleave: Count = 8  # fd-channel events handled between two looks at the control socket
    drain_slice: Count = 4096  # frames of a refused control message discarded per turn
    control_hwm: Count = 10000  # ZeroMQ high-water marks of the control socket (messages)
    event_ring: Count = 4096  # decisions kept for `kvpool events` (older ones are lost)

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None,
             labels: dict[str, str] | None = None, **overrides: Any) -> "Config":
        """Defaults, then the TOML file at ``path``, then non-None ``overrides`` (flags);
        validated. ``labels`` names each override in messages (``{"budget": "--budget"}``).
        Raises :class:`ConfigError` listing every bad value."""
        values: dict[str, Any] = {}
        where: dict[str, str] = {}
        if path:
            try:
                with open(path, "rb") as f:
                    values = tomllib.load(f)
            except tomllib.TOMLDecodeError as e:
                raise ConfigError([f"{path}: not valid TOML: {e}"]) from None
            except OSError as e:
                raise ConfigError([f"{path}: {e.strerror or e}"]) from None
            where = {k: f"{path}: {k}" for k in values}
        for key, value in overrides.items():
            if value is not None:
                values[key] = value
                where[key] = (labels or {}).get(key, key)
        return cls.from_dict(values, where)

    @classmethod
    def from_dict(cls, values: dict[str, Any], where: dict[str, str] | None = None) -> "Config":
        """Validate ``values`` (keys of this class) and build the Config."""
        where = where or {}
        problems: list[str] = []
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            problems.append(f"unknown configuration keys: {', '.join(unknown)}")
        out: dict[str, Any] = {}
        for key in names & set(values):
            label = where.get(key, key)
            if key == "tenants":
                out[key] = _tenants(values[key], problems)
                continue
            try:
                out[key] = cls.read(key, values[key])
            except ValueError as e:
                problems.append(f"{label} = {values_.show(values[key])}: {e}")
        for key in ("socket_group", "admin_group"):
            if isinstance(out.get(key), str) and not values_.group_exists(out[key]):
                problems.append(f"{where.get(key, key)} = {out[key]!r}: no such group")
        if out.get("huge_pages") and not problems:
            problem = values_.huge_pages_problem(out.get("backend", "auto"), out.get("page_size"))
            if problem:
                problems.append(f"{where.get('huge_pages', 'huge_pages')} = true: {problem}")
        if problems:
            raise ConfigError(problems)
        return cls(**out)

    @classmethod
    def read(cls, key: str, value: Any) -> Any:
        """One top-level value (not ``tenants``) as this config reads it: normalised,
        converted to the field's type and checked (:mod:`kvpool.daemon.config_values`).
        Raises ValueError whose message is the one-line reason. Also what the fleet file's
        ``[daemon]`` table is checked with (:mod:`kvpool.fleet.config`)."""
        hint = typing.get_type_hints(cls, include_extras=True)[key]
        try:
            typed = msgspec.convert(values_.normalise(key, value), hint, strict=True)
        except msgspec.ValidationError as e:
            raise ValueError(values_.reason(e)) from None
        problem = values_.check_value(key, typed)
        if problem:
            raise ValueError(problem)
        return typed

    def check_budget(self, total: int, page_size: int, free: int | None = None,
                     share: int = 1) -> int:
        """The budget in bytes (whole pages) given the device's ``total`` memory (the huge
        page pool with ``huge_pages``, whose ``free`` bytes must then hold ``warm_min``),
        of which this device gets an equal ``share``-th (the devices of a backend that
        draw on one memory: ``Capabilities.devices_share_memory``); raises
        :class:`ConfigError` when the budget exceeds the device (its share) or is under
        one page, ``warm_min`` exceeds the budget, or the configured tenants' ``min``
        add up to more than the budget."""
        problems: list[str] = []
        whole, total = total, total // share
        free = free // share if free is not None else None
        if self.huge_pages and total < page_size:
            raise ConfigError([values_.no_huge_pages(page_size, total)])
        budget = parse_size(self.budget, total)
        device = "hugetlb pool's (vm.nr_hugepages)" if self.huge_pages else "device's"
        if budget > total and share > 1:
            problems.append(f"budget = {values_.show_size(self.budget)}: more than "
                            f"{format_size(total)}, each of the {share} devices' equal share "
                            f"of the {'hugetlb pool' if self.huge_pages else 'memory'} "
                            f"({format_size(whole)}) they all draw on (lower the budget or "
                            f"the number of devices)")
        elif budget > total:
            problems.append(f"budget = {values_.show_size(self.budget)}: more than the {device} "
                            f"{format_size(total)}")
        elif budget < page_size:
            problems.append(f"budget = {values_.show_size(self.budget)}: less than one page "
                            f"({format_size(page_size)})")
        if problems:
            raise ConfigError(problems)
        budget = budget // page_size * page_size
        if self.resolve_pages(self.warm_min, page_size, budget) > budget // page_size:
            problems.append(f"warm_min = {values_.show_size(self.warm_min)}: more than the "
                            f"budget {format_size(budget)} (zeroed pages kept ready come "
                            f"out of it)")
        mins = {n: parse_size(t.min, budget) for n, t in self.tenants.items()}
        for name, policy in self.tenants.items():
            if policy.max is not None and mins[name] > parse_size(policy.max, budget):
                problems.append(f"tenants.{name}: min {format_size(mins[name])} is above "
                                f"its max {format_size(parse_size(policy.max, budget))}")
        if self.huge_pages and free is not None:
            warm = min(self.resolve_pages(self.warm_min, page_size, budget), budget // page_size)
            if warm * page_size > free:  # (none free is fine: a restart's tenants hold them)
                problems.append(values_.few_huge_pages(warm, page_size, free))
        if sum(mins.values()) > budget:
            problems.append(f"tenants: the guaranteed min add up to "
                            f"{format_size(sum(mins.values()))}, more than the budget "
                            f"{format_size(budget)} (" + ", ".join(
                                f"{n} {format_size(m)}" for n, m in mins.items() if m) + ")")
        if problems:
            raise ConfigError(problems)
        return budget

    def device_ordinals(self, count: Callable[[], int]) -> list[int]:
        """The devices this daemon serves: ``devices`` resolved (``count()`` is how many
        the backend sees, asked only for ``all``), else ``[device]``. Raises
        :class:`ConfigError` for a device named twice or none at all."""
        text = self.devices
        if text is None:
            return [self.device]
        if text == "all":
            out = list(range(count()))
        elif "," not in text:
            out = list(range(int(text)))
        else:
            out = [int(x) for x in text.split(",")]
        if not out:
            raise ConfigError([f"devices = {text!r}: no device to serve"])
        if len(set(out)) != len(out):
            raise ConfigError([f"devices = {text!r}: a device is named twice"])
        if len(out) > MAX_DEVICES:
            raise ConfigError([f"devices = {text!r}: more than {MAX_DEVICES} devices"])
        return out

    def for_device(self, device: int) -> "Config":
        """This config as one device's stack sees it: ``device`` and its budget."""
        return dataclasses.replace(self, device=device,
                                   budget=self.device_budgets.get(str(device), self.budget))

    def resolve_pages(self, value: int | str, page_size: int, total: int) -> int:
        """A size (or ``Np`` page count) as a number of pages, rounded down."""
        if isinstance(value, str) and value.strip().endswith("p") and value.strip()[:-1].isdigit():
            return int(value.strip()[:-1])
        return parse_size(value, total) // page_size

    def handoff_pairs(self) -> set[tuple[str, str]]:
        """``(giver, receiver)`` tenant names allowed to hand pages over across uids."""
        return {(name, to) for name, pol in self.tenants.items() for to in pol.handoff_to}

    def unbound_names(self) -> list[str]:
        """Configured tenant names without ``uids`` or ``group``: only the daemon's own
        uid may register them (the daemon warns at start)."""
        return sorted(n for n, pol in self.tenants.items() if not pol.uids and not pol.group)

    def policy(self, name: str) -> TenantPolicy:
        return self.tenants.get(name, TenantPolicy())

    @property
    def run_path(self) -> Path:
        from kvpool.paths import run_dir

        return run_dir(self.run_dir)


def _tenants(raw: Any, problems: list[str]) -> dict[str, TenantPolicy]:
    if not isinstance(raw, dict):
        problems.append("[tenants] must be a table of tables ([tenants.NAME])")
        return {}
    hints = typing.get_type_hints(TenantPolicy, include_extras=True)
    names = {f.name for f in dataclasses.fields(TenantPolicy)}
    out: dict[str, TenantPolicy] = {}
    for name, policy in raw.items():
        if isinstance(policy, TenantPolicy):
            policy = dataclasses.asdict(policy)
        if not isinstance(policy, dict):
            problems.append(f"tenants.{name}: expected a table, got {values_.show(policy)}")
            continue
        policy, both = renamed_key(policy, "weight", "shares", f"tenants.{name}.")
        if both:
            problems.append(f"tenants.{name}: {both}")
            continue
        unknown = sorted(set(policy) - names)
        if unknown:
            problems.append(f"tenants.{name}: unknown keys {', '.join(unknown)}")
        bad = bool(unknown)
        values: dict[str, Any] = {}
        for key in names & set(policy):
            label = f"tenants.{name}.{key}"
            try:
                values[key] = msgspec.convert(policy[key], hints[key], strict=True)
            except msgspec.ValidationError as e:
                problems.append(f"{label} = {values_.show(policy[key])}: {values_.reason(e)}")
                bad = True
                continue
            problem = values_.check_value(key, values[key])
            group = values[key] if key == "group" else None
            if isinstance(group, str) and not values_.group_exists(group):
                problem = "no such group"
            if problem:
                problems.append(f"{label} = {values_.show(policy[key])}: {problem}")
                bad = True
        if not bad:
            out[name] = TenantPolicy(**values)
    return out
