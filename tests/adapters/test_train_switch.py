"""Rollout and training in turns on one small budget, without sleep or wake (issue 37
item 2; docs/ARCHITECTURE.md "Trainer tenant"): a real daemon, a real ``kvpool serve``
elastic server of the tiny model with its weights in the pool, and a real trainer process
(``trainer_proc.py``) whose parameters, gradients and optimizer state are pool pages.

Rollout: the engine generates and its KV grows. Train: the trainer's step memory is
granted by taking the idle engine's KV (reserve, prefix cache) while the engine's weights
stay. Rollout again: the step memory went back, the engine grows on demand and answers
the same tokens. Several cycles leave every tenant holding what it held after the first;
a trainer killed mid-step gives everything back; an engine killed mid-switch (either
way) gives its KV back and a restarted one serves the same tokens."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from daemon.helpers import REPO, read_line, wait_for

from kvpool import launch

from .serve_procs import complete, prompt

TRAINER = Path(__file__).with_name("trainer_proc.py")
PROMPTS = [prompt(100 + i, 240) for i in range(10)]
CYCLES = 4


def tenants(d) -> dict[str, dict]:
    return {t["name"]: t for t in d.cli_json("ps")["tenants"]}


def rollout(base: str) -> list[str]:
    out = []
    for ids in PROMPTS:
        r = complete(base, ids, 16)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


def settled(d) -> None:
    """No ask outstanding and nobody waiting: the daemon is done with the last switch."""
    wait_for(lambda: d.cli_json("ps")["pool"]["waiting"] == 0
             and all(t["asked"] == 0 for t in tenants(d).values()), 30,
             what="the daemon settling")


def start_trainer(d, *extra: str) -> tuple[subprocess.Popen, dict]:
    """The trainer process, and its ``ready`` answer (its arenas' pool bytes)."""
    cmd = [sys.executable, str(TRAINER), "--run-dir", str(d.run_dir), "--wait-s", "20", *extra]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    d.workers.append(proc)
    return proc, answer(proc, "ready")


def answer(proc: subprocess.Popen, want: str, timeout: float = 60.0) -> dict:
    """The trainer's next answer, which must be ``want``."""
    line = read_line(proc, timeout)
    assert line is not None, proc.stderr.read() if proc.stderr else "no answer"
    msg = json.loads(line)
    assert msg["event"] == want, msg
    return msg


def send(proc: subprocess.Popen, line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def test_rollout_train_rollout_takes_kv_not_weights(start_daemon, servers):
    d = start_daemon(budget="5MiB")
    eng = servers.start("engine", run_dir=d.run_dir, weights=None, idle_timeout=3600.0,
                        kv_cache_size="8MiB")
    servers.wait_healthy(120)
    # the trainer's shares make the rollout's KV more than the engine's share once the
    # trainer asks: the daemon then takes it back from the idle engine (prefix cache)
    tr, ready = start_trainer(d, "--shares", "8")
    assert tenants(d)["trainer"]["kind"] == "trainer"
    assert "trainer" in d.cli("ps").stdout
    reference = rollout(eng.base)
    first = tenants(d)
    pool = d.cli_json("ps")["pool"]  # granted counts the weight set's pages
    free = pool["budget"] - pool["granted"] - pool["leased"] - pool["retained"]
    step = free + first["engine"]["mapped"] // 4  # more than is free: KV must go
    step -= step % d.page_size  # whole pages, as the trainer takes them
    weights = first["engine"]["weights"]
    # the trainer's state: parameters and gradients, and its optimizer state, which the
    # daemon may have taken back (offloaded) while the engine grew
    params, state = ready["state"], ready["state"] + ready["optim"]
    assert first["engine"]["mapped"] > 0 and weights > 0
    # what the engine may keep while the step runs: the budget less the weights and the
    # trainer's state and step
    room = pool["budget"] - weights - state - step
    during_held: list[dict[str, int]] = []
    rolled: list[dict[str, int]] = []  # after each cycle's second rollout
    losses: list[float] = []
    for cycle in range(CYCLES):
        if cycle:
            assert rollout(eng.base) == reference  # grows on demand, same tokens
            settled(d)
            now = tenants(d)
            rolled.append({"engine": now["engine"]["mapped"],
                           "weights": now["engine"]["weights"]})
        kv = tenants(d)["engine"]["mapped"]
        assert kv > room  # the rollout grew past what the step leaves it
        send(tr, f"train {step} 3")
        msg = answer(tr, "trained")
        assert msg["in_pool"]  # parameters, gradients, optimizer state: pool tensors
        losses += msg["loss"]
        during = tenants(d)
        assert during["engine"]["weights"] == weights  # the weights stayed mapped
        assert during["engine"]["mapped"] < kv  # the KV was taken
        assert during["engine"]["mapped"] <= room
        assert during["trainer"]["mapped"] == state + step
        during_held.append({n: t["mapped"] for n, t in during.items()})
        send(tr, "end")
        answer(tr, "ended")
        settled(d)
        after = tenants(d)
        assert after["trainer"]["mapped"] in (state, params)  # the step's memory went back
        assert after["engine"]["weights"] == weights
        assert d.check() == []
    assert rollout(eng.base) == reference
    settled(d)
    now = tenants(d)
    rolled.append({"engine": now["engine"]["mapped"], "weights": now["engine"]["weights"]})
    # no residual growth: every train phase holds exactly what the first did (the
    # trainer its state and step, the engine its weights and the KV the step leaves it:
    # a block the engine could not give back would show here). What a rollout ends with
    # is not compared: which prefix blocks the engine keeps depends on when its grants
    # land (measured 2.0-2.7 MiB here, in both directions, cycle to cycle); it stays
    # within what the budget leaves the engine beside the trainer's parameters.
    assert all(h == during_held[0] for h in during_held), during_held
    ceiling = pool["budget"] - weights - params
    assert all(r["weights"] == weights and 0 < r["engine"] <= ceiling for r in rolled), rolled
    assert losses[-1] < losses[0] / 2  # it learned
    send(tr, "quit")
    answer(tr, "closed")
    assert tr.wait(30) == 0
    wait_for(lambda: "trainer" not in tenants(d), 30, what="the trainer's session ending")
    assert d.check() == []


def test_trainer_killed_mid_step_gives_everything_back(start_daemon):
    d = start_daemon(budget="8MiB")
    tr, _ = start_trainer(d)
    send(tr, f"hold {2 << 20}")
    answer(tr, "in_step")
    t = tenants(d)["trainer"]
    assert t["mapped"] >= 2 << 20  # the step's pages and the state
    tr.send_signal(signal.SIGKILL)
    tr.wait(30)
    wait_for(lambda: "trainer" not in tenants(d), 30, what="the killed trainer's session")
    pool = d.cli_json("ps")["pool"]
    assert pool["granted"] == 0 and pool["retained"] == 0
    assert d.check() == []
    with d.connect("next", kind="test") as nxt:  # the next tenant reads zeros
        g = nxt.region_group(1, 2 << 20)
        g.grant(list(range(g.npages)))
        import ctypes

        data = ctypes.string_at(g.ranges[0].base, 2 << 20)
        assert data == bytes(2 << 20)
        g.close()
    assert d.check() == []


def engine_and_trainer(d, servers, *trainer_args: str):
    """An elastic engine of the tiny model (weights in the pool) and a trainer, after one
    rollout: the engine's KV grown past what a step will leave it."""
    eng = servers.start("engine", run_dir=d.run_dir, weights=None, idle_timeout=3600.0,
                        kv_cache_size="8MiB")
    servers.wait_healthy(120)
    tr, ready = start_trainer(d, "--shares", "8", *trainer_args)
    reference = rollout(eng.base)
    settled(d)
    return eng, tr, ready, reference


def step_bytes(d) -> int:
    """More than is free: a step of this size must take the engine's KV."""
    pool = d.cli_json("ps")["pool"]
    free = pool["budget"] - pool["granted"] - pool["leased"] - pool["retained"]
    step = free + tenants(d)["engine"]["mapped"] // 4
    return step - step % d.page_size


def engine_gone_nothing_leaked(d, tr_state: int, step: int) -> None:
    """The killed engine's session is gone, its KV back in the budget (the trainer holds
    exactly its state and step), and the daemon's books agree with the memory."""
    wait_for(lambda: "engine" not in tenants(d), 30, what="the killed engine's session")
    trainer = tenants(d)["trainer"]["mapped"]
    assert trainer == tr_state + step
    pool = d.cli_json("ps")["pool"]  # what stays granted: the trainer's and the weights,
    assert pool["granted"] == trainer + pool["weights_cached"]  # cached for a restart
    assert d.check() == []


def ask_dying(base: str, ids: list[int]) -> None:
    """A request to an engine the test kills: its failure is expected."""
    try:
        complete(base, ids, 16)
    except httpx.HTTPError:
        pass


def restarted_serves_the_same(d, servers, reference: list[str]) -> None:
    """A new engine of the same name, on the cached pool weights, answers ``reference``;
    the daemon's books stay clean."""
    again = servers.start("engine", run_dir=d.run_dir, weights=None, idle_timeout=3600.0,
                          kv_cache_size="8MiB")
    launch.wait_healthy(again.proc, again.base, "kvpool serve engine", time.monotonic() + 120,
                        again.logs, 0.1)
    assert rollout(again.base) == reference
    settled(d)
    assert d.check() == []


def test_engine_killed_mid_switch_to_train(start_daemon, servers):
    """Rollout → train with the engine frozen (SIGSTOP) so the daemon's ask to shrink is
    never answered: the trainer's step waits; the engine is then killed (kill -9). Its KV
    comes back to the budget, the trainer's step is granted (no exit, no error), nothing
    leaks, and a restarted engine serves the same tokens from the same pool weights."""
    d = start_daemon(budget="5MiB")
    eng, tr, ready, reference = engine_and_trainer(d, servers, "--wait-s", "120")
    state = ready["state"] + ready["optim"]
    step = step_bytes(d)
    os.killpg(eng.proc.pid, signal.SIGSTOP)
    send(tr, f"train {step} 1")
    # mid-switch: the trainer's grant is held while the daemon asks the engine for its KV
    wait_for(lambda: tenants(d)["engine"]["asked"] > 0, 60, every=0.01,
             what="the daemon asking the frozen engine for its KV")
    eng.kill(signal.SIGKILL)
    eng.proc.wait(30)
    msg = answer(tr, "trained", timeout=120)  # the step ran on the dead engine's KV
    assert msg["in_pool"]
    engine_gone_nothing_leaked(d, state, step)
    send(tr, "end")
    answer(tr, "ended")
    restarted_serves_the_same(d, servers, reference)


def test_engine_killed_mid_switch_to_rollout(start_daemon, servers):
    """Train → rollout with the trainer still in its step: the engine's requests need KV
    the step holds, and the daemon refuses its grants (the step is not reclaimable) until
    the step ends; the engine is killed (kill -9) there. Its demand dies with it, the trainer's step keeps its memory and ends normally, nothing
    leaks, and a restarted engine serves the same tokens."""
    d = start_daemon(budget="5MiB")
    eng, tr, ready, reference = engine_and_trainer(d, servers)
    state = ready["state"] + ready["optim"]
    step = step_bytes(d)
    send(tr, f"train {step} 1")
    answer(tr, "trained")  # in the step: the engine kept only what the step leaves it
    errors = d.stats().errors
    threads = [threading.Thread(target=ask_dying, args=(eng.base, ids), daemon=True)
               for ids in PROMPTS]
    for t in threads:
        t.start()
    # mid-switch: the engine asks for more KV than the budget leaves beside the step, and
    # the daemon refuses it (the step's memory is not reclaimable) until the step ends
    wait_for(lambda: d.stats().errors > errors, 60, every=0.05,
             what="the engine's grants refused during the step")
    eng.kill(signal.SIGKILL)
    eng.proc.wait(30)
    engine_gone_nothing_leaked(d, state, step)
    send(tr, "end")
    answer(tr, "ended")
    settled(d)
    assert tenants(d)["trainer"]["mapped"] in (state, ready["state"])
    assert d.check() == []
    restarted_serves_the_same(d, servers, reference)
