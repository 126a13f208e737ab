"""The start-up race (issue 36 item 3), run once: two elastic engines of one fleet start
together on one device, each sized for most of its KV capacity; the first one's requests
arrive first and it grows, then the second's arrive. Sampled from the daemon (``stats``
and ``check`` through :class:`~kvpool.client_lib.Monitor`) in a loop throughout.

What is measured, the same way under every policy:

* ``C``, the KV capacity: the budget less the weight sets in use (what ``reconcile``
  divides);
* each engine's **entitled ceiling** ``fair``: the KV ceiling reconcile's controller
  assigns it once it plans for the two engines active and holding nothing yet
  (:func:`kvpool.fleet.policies.reconcile.ceilings`: its floor of ``floor_percent`` of
  ``C`` plus an equal part of the rest, C/2 each here) — the ceiling that would bind had
  it come at start; the daemon's fair share under kvpool's policy with equal shares is
  the same C/2;
* **over-commit** at a sample: the bytes of KV the engines hold above their entitled
  ceilings (``sum(max(0, held - fair))``), counted only while another engine has
  requests in flight and holds less than its own entitled ceiling, i.e. memory kept from
  an engine that is owed it while it waits (an engine borrowing memory nobody asks for
  is not over-committing). Its peak (bytes) and its integral over the samples (left
  rectangles, bytes x seconds).

Under ``kvpool`` the daemon decides at each grant: the second engine's grant makes it
take back what the first holds above its fair share (reclaim), so over-commit lasts no
longer than a reclaim (0 at most samples). Under ``reconcile`` nothing is taken back
between rounds (``first_come``: a grant free memory does not cover is refused), and a
round sets ceilings of ``max(floor, KV in use)`` plus a part of the rest, so even a
round does not shrink the first engine below what it holds: its excess stays until its
own use drops. With ``reconcile_interval`` long (the test: 600 s) no round runs in the
race at all: the window is the peer's ceilings arriving late.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from kvpool import launch
from kvpool.fleet.member import free_port
from kvpool.fleet.policies.reconcile import Engine, ceilings
from kvpool.protocol import PoolInfo

REPO = Path(__file__).resolve().parents[2]
PAGE = 64 << 10
DEADLINE_S = 240.0
ENGINES = ("alpha", "beta")
SEQS = 8  # each engine's max_num_seqs, and the requests of a burst
PROMPT_TOKENS = 200
MAX_TOKENS = 56  # 256 tokens a request: 16 blocks of 16
KV_UNITS = 8  # each engine's kv_cache_size, in units (of PAGE here): 80% of ...
CAPACITY_UNITS = 10  # ... the KV capacity the budget leaves beside the weights
FLOOR_PERCENT = 10.0


def make_models(root: Path) -> dict[str, Path]:
    from kvpool.engine.model.tiny import make_tiny_model

    return {n: make_tiny_model(root / n, layers=1, hidden=64, heads=2, kv_heads=1, vocab=512,
                               seed=i + 1)
            for i, n in enumerate(ENGINES)}


def prompt(engine: int, i: int) -> list[int]:
    """A request's distinct prompt (so nothing is shared through the prefix cache)."""
    return [1 + (engine * 7919 + i * 104729 + k * 31) % 500 for k in range(PROMPT_TOKENS)]


@dataclass
class Sample:
    t: float  # seconds since the fleet answered
    held: dict[str, int]  # each engine's KV (the daemon's ``mapped``)
    inflight: dict[str, int]  # each engine's requests of the race not yet answered
    granted: int  # the pool's granted bytes (weights counted once)
    budget: int
    problems: list[str]  # kvpool check
    fair_share: dict[str, int]  # the daemon's fair share of each (kvpool's policy)
    waiting: dict[str, int]  # bytes of each one's grants waiting for reclaim


@dataclass
class Race:
    policy: str
    capacity: int  # C
    fair: dict[str, int]  # each engine's entitled ceiling
    unit: int  # the engines' allocation unit
    samples: list[Sample] = field(default_factory=list)
    rounds: list[str] = field(default_factory=list)  # reconcile's round lines
    answered: dict[str, int] = field(default_factory=dict)  # requests answered 200
    beta_from: float = 0.0  # when beta's requests began (seconds, as Sample.t)

    def contended(self) -> list[Sample]:
        """The samples since beta's requests began with both engines' requests in
        flight."""
        return [s for s in list(self.samples)
                if s.t >= self.beta_from and all(s.inflight.values())]

    def over(self, s: Sample) -> int:
        """Over-commit at ``s`` (see the module)."""
        owed = [n for n in ENGINES if s.inflight[n] and s.held[n] < self.fair[n]]
        return sum(max(0, s.held[n] - self.fair[n]) for n in ENGINES
                   if any(o != n for o in owed))

    def peak_over(self) -> int:
        return max((self.over(s) for s in self.samples), default=0)

    def over_byte_seconds(self) -> float:
        return sum(self.over(s) * (t.t - s.t) for s, t in zip(self.samples, self.samples[1:]))

    def window_s(self) -> float:
        """Seconds of samples with over-commit (each counted to the next sample)."""
        return sum(t.t - s.t for s, t in zip(self.samples, self.samples[1:]) if self.over(s))

    def peak_held(self) -> dict[str, int]:
        return {n: max((s.held[n] for s in self.samples), default=0) for n in ENGINES}

    def summary(self) -> dict:
        return {"policy": self.policy, "capacity": self.capacity, "fair": self.fair,
                "unit": self.unit, "samples": len(self.samples),
                "peak_over_bytes": self.peak_over(),
                "over_byte_seconds": round(self.over_byte_seconds(), 1),
                "over_window_s": round(self.window_s(), 3),
                "peak_held": self.peak_held(),
                "peak_sum_held": max((sum(s.held.values()) for s in self.samples), default=0),
                "max_granted_over_budget": max((s.granted - s.budget for s in self.samples),
                                               default=0),
                "check_problems": sorted({x for s in self.samples for x in s.problems}),
                "reconcile_rounds": len(self.rounds), "answered": self.answered,
                "beta_from_s": self.beta_from,
                "duration_s": self.samples[-1].t if self.samples else 0.0}

    def trace(self) -> list[dict]:
        return [asdict(s) | {"over": self.over(s)} for s in self.samples]


@contextmanager
def race_fleet(tmp: Path, models: dict[str, Path], policy: str, knobs: str,
               budget: int) -> Iterator[tuple[str, Path, Path]]:
    """``kvpool fleet --with-daemon`` of the two engines (both ``eager``: they start
    together) under ``policy``; yields (url, run dir, fleet log); SIGTERM at the end."""
    port = free_port()
    text = (f'[fleet]\nname = "race"\nport = {port}\nstart_timeout_s = 150\n'
            f'policy = "{policy}"\n{knobs}[daemon]\nbudget = "{budget // 1024}KiB"\n'
            f'page_size = "{PAGE // 1024}KiB"\n')
    for n in ENGINES:
        text += (f'[[models]]\nname = "{n}"\ncheckpoint = "{models[n]}"\neager = true\n'
                 f'kv_cache_size = "{KV_UNITS * PAGE // 1024}KiB"\nmax_num_seqs = {SEQS}\n'
                 f'args = ["--max-model-len", "512"]\n')
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "fleet.toml").write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    argv = [*launch.cli_argv(), "fleet", str(tmp / "fleet.toml"), "--with-daemon",
            "--log-dir", str(tmp / "logs")]
    log = tmp / "fleet.log"
    proc = launch.spawn_process(argv, log, cwd=REPO, new_session=True, base_env=env)
    url = f"http://127.0.0.1:{port}"

    def lines() -> str:
        return log.read_text(errors="replace") if log.exists() else ""

    try:
        launch.wait_healthy(proc, url, "kvpool fleet", time.monotonic() + DEADLINE_S, lines)
        found = re.search(r"started a daemon on run dir (\S+)", lines())
        if not found:
            raise RuntimeError(f"no daemon run dir in the fleet's log:\n{lines()[-2000:]}")
        yield url, Path(found.group(1)), log
    finally:
        launch.stop(proc, 60.0)
        launch.stop(proc, 10.0, group=True)


def weights_pages(models: dict[str, Path]) -> int:
    """Pages of one engine's weight set in the pool (the tiny models are alike)."""
    from kvpool.fleet.entries import ModelEntry
    from kvpool.fleet.policies.swap import footprint

    return -(-footprint(ModelEntry(name="x", checkpoint=models["alpha"], kv_cache_size=1),
                        "host") // PAGE)


def run_race(tmp: Path, models: dict[str, Path], policy: str, knobs: str = "",
             hold_s: float = 3.0, until: Callable[[Race], bool] | None = None,
             say: Callable[[str], None] = lambda _m: None) -> Race:
    """One race under ``policy`` (its ``[fleet]`` knob lines in ``knobs``): both engines
    up, alpha's requests until it holds more than its entitled ceiling, then beta's too,
    both kept busy for ``hold_s`` seconds or until ``until(race)`` (looked at every 50
    ms); sampled throughout."""
    from kvpool.client_lib import Monitor

    budget = (2 * weights_pages(models) + CAPACITY_UNITS) * PAGE
    with race_fleet(tmp, models, policy, knobs, budget) as (url, run_dir, log):
        client = httpx.Client(timeout=DEADLINE_S)
        mon = Monitor(run_dir, timeout_s=60.0)
        inflight = {n: 0 for n in ENGINES}
        answered = {n: 0 for n in ENGINES}
        lock = threading.Lock()
        stop = threading.Event()

        def post(engine: str, i: int) -> None:
            body = {"model": engine, "prompt": prompt(ENGINES.index(engine), i),
                    "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            with lock:
                inflight[engine] += 1
            try:
                r = client.post(f"{url}/v1/completions", json=body)
            finally:
                with lock:
                    inflight[engine] -= 1
            if r.status_code == 200:
                with lock:
                    answered[engine] += 1

        def read() -> tuple[dict[str, int], PoolInfo, dict[str, int], dict[str, int]]:
            st = mon.stats()
            ours = {t.name: t for t in st.tenants if t.group == "race"}
            return ({n: ours[n].mapped if n in ours else 0 for n in ENGINES}, st.pool,
                    {n: ours[n].fair_share if n in ours else 0 for n in ENGINES},
                    {n: ours[n].waiting if n in ours else 0 for n in ENGINES})

        def wait_both_up() -> None:
            deadline = time.monotonic() + DEADLINE_S
            while time.monotonic() < deadline:
                data = client.get(f"{url}/v1/models").json()["data"]
                if all(m["state"] == "awake" for m in data):
                    return
                time.sleep(0.1)
            raise RuntimeError("the two engines did not both come up")

        wait_both_up()
        held, pool, _, _ = read()
        capacity = pool.budget - (pool.weights - pool.weights_cached)
        plan = ceilings(capacity, FLOOR_PERCENT, [Engine(n, 0, 1, 0) for n in ENGINES])
        assert plan is not None
        unit = max(t.chunk for t in mon.stats().tenants if t.group == "race")
        race = Race(policy, capacity, plan, unit)
        t0 = time.monotonic()
        say(f"{policy}: KV capacity {capacity} B, entitled {plan}, unit {unit} B")

        def sample() -> None:
            while not stop.is_set():
                held, pool, shares, waiting = read()
                problems = mon.check()
                with lock:
                    flying = dict(inflight)
                race.samples.append(Sample(round(time.monotonic() - t0, 4), held, flying,
                                           pool.granted, pool.budget, problems, shares,
                                           waiting))

        def hammer(engine: str) -> None:
            """``engine``'s burst (``SEQS`` requests), each sent again as it is answered,
            until the race ends: the engine stays busy."""
            def one(i: int) -> None:
                while not stop.is_set():
                    post(engine, i)

            with ThreadPoolExecutor(SEQS) as ex:
                list(ex.map(one, range(SEQS)))

        with ThreadPoolExecutor(3) as bg:
            sampler = bg.submit(sample)
            alpha = bg.submit(hammer, "alpha")
            beta = None
            try:
                # alpha first: it grows past its entitled ceiling while nobody else asks
                deadline = time.monotonic() + DEADLINE_S
                while read()[0]["alpha"] <= plan["alpha"]:
                    if time.monotonic() > deadline or alpha.done():
                        raise RuntimeError(f"alpha never held more than {plan['alpha']} B")
                    time.sleep(0.02)
                race.beta_from = round(time.monotonic() - t0, 4)
                beta = bg.submit(hammer, "beta")  # then beta's, both busy for hold_s
                end = time.monotonic() + hold_s
                while time.monotonic() < end and not (until and until(race)):
                    if sampler.done() or alpha.done() or beta.done():
                        break  # (failed: its result() below raises)
                    time.sleep(0.05)
            finally:
                stop.set()
                for f in (alpha, beta, sampler):
                    if f is not None:
                        f.result()
                mon.close()
                client.close()
        race.answered = dict(answered)
        race.rounds = [x for x in log.read_text(errors="replace").splitlines()
                       if re.match(r"fleet: reconcile round \d+:", x)]
    return race
