"""The baseline fleet policies end to end (issue 36 item 2): real ``kvpool fleet
--with-daemon`` processes of tiny models, each policy with its intervals shortened by its
knobs.

* ``swap``: a model that does not fit (by ``max_loaded`` or by the budget) unloads the
  least recently used idle models, and the members loaded never number more than
  ``max_loaded`` nor hold more than the budget (replayed from the fleet's log);
* ``idle-sleep``: a model that cannot load beside two idle ones does not make them sleep
  (nothing reacts to pressure); a member serving a request stays awake while others
  idle for the threshold sleep, and sleeps once idle itself;
* ``reconcile``: the members' ceilings (the daemon's ``max``, read through ``stats``)
  change only within a round of its loop, and a round gives the active member more.

Outcomes are waited for with generous deadlines, never timed.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvpool import launch
from kvpool.fleet.entries import ModelEntry
from kvpool.fleet.member import free_port
from kvpool.fleet.policies.swap import footprint

from daemon.helpers import PAGE, wait_for

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 180.0
PROMPT = [17, 301, 44, 5, 230, 99, 12, 480, 7, 63, 150, 222, 31, 8, 411, 90]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from kvpool.engine.model.tiny import make_tiny_model

    d = tmp_path_factory.mktemp("policy-models")
    return {n: make_tiny_model(d / n, layers=1, hidden=64, heads=2, kv_heads=1, vocab=512,
                               seed=i + 1)
            for i, n in enumerate(("alpha", "beta", "gamma", "delta"))}


@dataclass
class Live:
    url: str
    log: Path
    run_dir: Path = Path()

    def lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines() if self.log.exists() else []

    def states(self) -> dict[str, str]:
        data = httpx.get(f"{self.url}/v1/models", timeout=30).json()["data"]
        return {m["id"]: m["state"] for m in data}

    def tenants(self) -> dict[str, dict]:
        from kvpool.client_lib import Monitor

        with Monitor(self.run_dir) as m:
            return {t.name: {"state": t.state, "max": t.max, "weights": t.weights,
                             "mapped": t.mapped, "sleepable": t.sleepable}
                    for t in m.stats().tenants if t.group == "pol"}


def complete(live: Live, model: str, max_tokens: int = 8, prompt: list[int] = PROMPT
             ) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    return httpx.post(f"{live.url}/v1/completions", json=body, timeout=DEADLINE_S)


@contextmanager
def fleet(tmp: Path, fleet_keys: str, budget: int, models: dict[str, Path],
          kv: str = "1MiB", start_timeout_s: int = 150) -> Iterator[Live]:
    """``kvpool fleet --with-daemon`` of ``models`` (each ``kv_cache_size`` ``kv``, or its
    own ``name=size`` in ``kv``); SIGTERM to the fleet alone at the end (it must exit 0)."""
    port = free_port()
    text = (f'[fleet]\nname = "pol"\nport = {port}\nstart_timeout_s = {start_timeout_s}\n'
            f'{fleet_keys}[daemon]\nbudget = "{budget // 1024}KiB"\n'
            f'page_size = "{PAGE // 1024}KiB"\n')
    sizes = dict(x.split("=") for x in kv.split(",")) if "=" in kv else {}
    for n, p in models.items():
        text += (f'[[models]]\nname = "{n}"\ncheckpoint = "{p}"\n'
                 f'kv_cache_size = "{sizes.get(n, kv)}"\nmax_num_seqs = 4\n'
                 f'args = ["--max-model-len", "512"]\n')
    f = tmp / "fleet.toml"
    f.write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    argv = [*launch.cli_argv(), "fleet", str(f), "--with-daemon", "--log-dir", str(tmp / "logs")]
    proc = launch.spawn_process(argv, tmp / "fleet.log", cwd=REPO, new_session=True,
                                base_env=env)
    live = Live(f"http://127.0.0.1:{port}", tmp / "fleet.log")
    try:
        launch.wait_healthy(proc, live.url, "kvpool fleet", time.monotonic() + DEADLINE_S,
                            lambda: "\n".join(live.lines()))
        found = re.search(r"started a daemon on run dir (\S+)", "\n".join(live.lines()))
        assert found, live.lines()
        live.run_dir = Path(found.group(1))
        yield live
    finally:
        code = launch.stop(proc, 60.0)
        launch.stop(proc, 10.0, group=True)
    assert code == 0, "\n".join(live.lines()[-20:])


# ---- swap ------------------------------------------------------------------------------
def loaded_over_time(lines: list[str]) -> list[set[str]]:
    """The members with a process after each start or unload line of the fleet's log."""
    now: set[str] = set()
    out = []
    for line in lines:
        if m := re.match(r"fleet: starting (\S+) ", line):
            now.add(m.group(1))
        elif m := re.match(r"fleet: unloading (\S+):", line):
            now.discard(m.group(1))
        else:
            continue
        out.append(set(now))
    return out


def test_swap_unloads_the_least_recently_used_idle_models(models, tmp_path) -> None:
    """alpha, beta, gamma (a each) and delta (d: a larger static KV), max_loaded 2 and a
    budget B with 3a <= B < d + a. gamma's load unloads alpha (the count: the budget
    would hold three); delta's unloads beta (the count) and gamma (the budget); alpha's
    then unloads delta (the budget). Each time the least recently used idle ones go."""
    kv = "alpha=1MiB,beta=1MiB,gamma=1MiB,delta=3MiB"
    sizes = {n: footprint(ModelEntry(name=n, checkpoint=p, kv_cache_size=(3 if n == "delta"
                                                                          else 1) << 20),
                          "host") for n, p in models.items()}
    a, d = sizes["alpha"], sizes["delta"]
    budget = -(-max(3 * a, d) // PAGE) * PAGE
    assert 3 * a <= budget < d + a, sizes
    with fleet(tmp_path, 'policy = "swap"\nkeep_alive = -1\nmax_loaded = 2\n', budget,
               models, kv=kv) as live:
        assert set(live.states().values()) == {"stopped"}  # nothing loads at start
        expect = [("alpha", {"alpha"}), ("beta", {"alpha", "beta"}),
                  ("gamma", {"beta", "gamma"}), ("delta", {"delta"}), ("alpha", {"alpha"})]
        for name, awake in expect:
            assert complete(live, name).status_code == 200
            assert {n for n, s in live.states().items() if s != "stopped"} == awake, name
        lines = live.lines()
    unloads = [re.match(r"fleet: unloading (\S+): (.*)", x).groups()
               for x in lines if x.startswith("fleet: unloading ")]
    assert [u[0] for u in unloads] == ["alpha", "beta", "gamma", "delta"], lines
    assert all("least recently used idle model" in why for _, why in unloads), unloads
    history = loaded_over_time(lines)
    assert max(len(s) for s in history) == 2, history  # never more than max_loaded
    assert all(sum(sizes[n] for n in s) <= budget for s in history), history


# ---- idle-sleep -------------------------------------------------------------------------
def test_idle_sleep_never_sleeps_under_pressure(models, tmp_path) -> None:
    """The budget holds two models' weights and a little KV: of alpha, beta and gamma,
    started together, the one whose weights come last cannot load them (which one is the
    machine's race: first come). Under kvpool's policy the daemon would put an idle
    sleepable one to sleep for it; here nothing does (members not sleepable, the daemon's
    reclaim policy first_come, the idle threshold far away): it fails to start, the other
    two stay awake and serve."""
    three = {n: models[n] for n in ("alpha", "beta", "gamma")}
    weights = -(-footprint(ModelEntry(name="x", checkpoint=models["alpha"], kv_cache_size=1),
                           "host") // PAGE)  # pages of one model's weights
    with fleet(tmp_path, 'policy = "idle-sleep"\nidle_threshold = 3600\n'
                         'check_interval = 0.2\n', (2 * weights + 4) * PAGE, three,
               start_timeout_s=20) as live:
        wait_for(lambda: sorted(live.states().values()) == ["awake", "awake", "failed"],
                 DEADLINE_S, 0.2, "two up, one failed to start")
        states = live.states()
        loser = next(n for n, st in states.items() if st == "failed")
        served = sorted(n for n in three if n != loser)
        tenants = live.tenants()
        assert {n: t["state"] for n, t in tenants.items() if n != loser} == \
            {n: "idle" for n in served}, tenants
        assert not any(t["sleepable"] for t in tenants.values()), tenants
        assert complete(live, served[0]).status_code == 200
        r = complete(live, loser)
        assert r.status_code == 503 and "failed to start" in r.text, r.text
        assert not [x for x in live.lines() if "to sleep" in x]
        assert live.states() == states


def test_idle_sleep_sleeps_only_the_idle(models, tmp_path) -> None:
    """Threshold 1 s: both members fall asleep idle. alpha then serves a request held in
    its engine (its limit lowered below the KV the prompt needs) while beta serves one and
    falls asleep again, a threshold after alpha's request began: alpha, serving, is not
    put to sleep. Its limit raised, the request is served and alpha sleeps too."""
    from kvpool.client_lib import Monitor

    two = {n: models[n] for n in ("alpha", "beta")}
    weights = -(-footprint(ModelEntry(name="x", checkpoint=models["alpha"], kv_cache_size=1),
                           "host") // PAGE) * PAGE
    with fleet(tmp_path, 'policy = "idle-sleep"\nidle_threshold = 1\ncheck_interval = 0.2\n',
               64 * PAGE, two) as live:

        def states() -> dict[str, str]:
            return {n: t["state"] for n, t in live.tenants().items()}

        wait_for(lambda: states() == {"alpha": "asleep", "beta": "asleep"}, DEADLINE_S, 0.1,
                 "both asleep once idle")
        with Monitor(live.run_dir) as mon:
            mon.set_limit("alpha", weights + PAGE)  # its weights and one page of KV
        long = list(range(1, 401))  # 400 tokens: more than one page of KV
        with ThreadPoolExecutor(1) as ex:
            held = ex.submit(complete, live, "alpha", 4, long)
            try:
                wait_for(lambda: states()["alpha"] == "busy", DEADLINE_S, 0.05, "alpha busy")
                seen = len(live.lines())
                assert complete(live, "beta").status_code == 200
                wait_for(lambda: states()["beta"] == "asleep", DEADLINE_S, 0.1,
                         "beta asleep again")
                assert states()["alpha"] == "busy"  # (not even asked: no refusal either)
                assert not [x for x in live.lines()[seen:] if "alpha" in x and "sleep" in x]
            finally:
                with Monitor(live.run_dir) as mon:
                    mon.set_limit("alpha", 64 * PAGE)
            assert held.result().status_code == 200
        wait_for(lambda: states()["alpha"] == "asleep", DEADLINE_S, 0.1, "alpha asleep")
        slept = [re.search(r"idle for ([\d.]+) s \(at least 1 s\)", x)
                 for x in live.lines() if x.startswith("fleet: put ")]
        assert len(slept) >= 4 and all(m and float(m.group(1)) >= 1 for m in slept), slept


# ---- reconcile ---------------------------------------------------------------------------
@dataclass
class Sample:
    begun: int  # round lines before reading the ceilings
    applied: int  # "applied" lines before reading them
    ceilings: dict[str, int]
    begun_after: int  # round lines after


def count(lines: list[str], what: str) -> int:
    return sum(1 for x in lines if re.match(rf"fleet: reconcile round \d+{what}", x))


def test_reconcile_sets_ceilings_only_in_its_rounds(models, tmp_path) -> None:
    """Every 0.5 s a round: after alpha served, a round gives alpha the larger ceiling;
    after beta served, beta; then a loop with nobody active sets nothing. Throughout, the
    ceilings the daemon holds change only across a round: two readings with no round
    begun between them, and none half done, agree."""
    two = {n: models[n] for n in ("alpha", "beta")}
    with fleet(tmp_path, 'policy = "reconcile"\nreconcile_interval = 0.5\n'
                         'floor_percent = 10\nsleep_after = 3600\n', 64 * PAGE, two) as live:
        wait_for(lambda: live.states() == {"alpha": "awake", "beta": "awake"}, DEADLINE_S,
                 0.1, "both up")
        samples: list[Sample] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                before = live.lines()
                ceilings = {n: t["max"] - t["weights"] for n, t in live.tenants().items()}
                samples.append(Sample(count(before, ":"), count(before, " applied"),
                                      ceilings, count(live.lines(), ":")))

        def last_said() -> str:
            said = [x for x in live.lines() if x.startswith("fleet: reconcile")]
            return said[-1] if said else ""

        def kv() -> dict[str, int]:
            return {n: t["max"] - t["weights"] for n, t in live.tenants().items()}

        def served_then_round(name: str) -> None:
            """``name`` serves one request; a round with it alone active is applied."""
            assert complete(live, name).status_code == 200
            wait_for(lambda: re.fullmatch(rf"fleet: reconcile round (\d+) applied", last_said())
                     and [x for x in live.lines() if re.match(r"fleet: reconcile round \d+:",
                                                          x)][-1].endswith(f"(active: {name})"),
                     DEADLINE_S, 0.05, f"a round with {name} alone active")

        def quiet() -> None:
            """A loop with nobody active (said once), and a reading after it."""
            wait_for(lambda: "no engine active since round" in last_said(), DEADLINE_S, 0.05,
                     "a loop with nobody active")
            taken = len(samples)
            wait_for(lambda: len(samples) > taken + 1, DEADLINE_S, 0.05, "a reading after it")

        with ThreadPoolExecutor(1) as ex:
            watcher = ex.submit(sample)
            try:
                served_then_round("alpha")
                assert kv()["alpha"] > kv()["beta"], kv()
                quiet()
                served_then_round("beta")
                assert kv()["beta"] > kv()["alpha"], kv()
                quiet()
            finally:
                stop.set()
                watcher.result()
        between = [(s, t) for s, t in zip(samples, samples[1:])
                   if s.begun == s.applied == t.begun_after]
        assert between, "no two readings between rounds"
        assert all(s.ceilings == t.ceilings for s, t in between), \
            [(s, t) for s, t in between if s.ceilings != t.ceilings][:2]
        assert len({tuple(sorted(s.ceilings.items())) for s in samples}) >= 3, samples[-1]
