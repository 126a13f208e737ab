"""The trainer tenant (kvpool.client_lib.trainer; docs/ARCHITECTURE.md "Trainer tenant")
against a real daemon (8 MiB budget, 64 KiB pages): a torch training step whose
parameters, gradients and AdamW state are pool pages, counted in ``ps`` under kind
``trainer``; the step's memory held only while it runs; the optimizer state given back on
the daemon's ask and restored for the next step; the two refusals of a step."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvpool.client_lib import connect
from kvpool.client_lib.errors import StepDeadline, StepTooLarge
from kvpool.client_lib.trainer import connect_trainer

from .conftest import PAGE, REPO

MiB = 1 << 20


def ps(run_dir) -> dict:
    out = subprocess.run([sys.executable, "-m", "kvpool.cli.main", "ps", "--json",
                          "--run-dir", str(run_dir)], capture_output=True, text=True,
                         cwd=REPO, timeout=30, check=True)
    return json.loads(out.stdout)


def mine(run_dir, name: str = "tr") -> dict:
    return next(t for t in ps(run_dir)["tenants"] if t["name"] == name)


def inside(t: torch.Tensor, arena) -> bool:
    base = arena.group.bases[0]
    return base <= t.data_ptr() < base + arena.capacity


def model_and_opt(tr, hidden: int = 64):
    torch.manual_seed(0)
    m = tr.put_module(torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.Tanh(),
                                          torch.nn.Linear(hidden, 1)))
    return m, tr.put_optimizer(torch.optim.AdamW(m.parameters(), lr=1e-2))


def test_a_training_step_runs_on_pool_tensors(run_dir):
    x = torch.randn(64, 16)
    y = x[:, :2].sum(1, keepdim=True)
    with connect_trainer("tr", run_dir=run_dir) as tr:
        m, opt = model_and_opt(tr)
        held = mine(run_dir)
        assert held["kind"] == "trainer"
        assert held["mapped"] == tr.state.footprint + tr.optim.footprint > 0
        losses = []
        for _ in range(15):
            with tr.step(MiB) as step:
                assert mine(run_dir)["mapped"] == held["mapped"] + MiB
                scratch = step.empty((1000,), torch.float32)
                assert inside(scratch, tr.scratch)
                del scratch
                with pytest.raises(ValueError, match="do not fit in the step"):
                    step.empty((MiB // 4,), torch.float32)  # 1 MiB more than the rest
                loss = ((m(x) - y) ** 2).mean()
                loss.backward()
                opt.step()
                tr.zero_grad()
                losses.append(loss.item())
            assert mine(run_dir)["mapped"] == held["mapped"]  # the step's pages went back
        assert losses[-1] < losses[0] / 2
        for prm in m.parameters():  # still the pool's, after 15 steps
            assert inside(prm, tr.state) and inside(prm.grad, tr.state)
            assert all(inside(v, tr.optim) for v in opt.state[prm].values() if v.dim())
        assert "trainer" in subprocess.run(
            [sys.executable, "-m", "kvpool.cli.main", "ps", "--run-dir", str(run_dir)],
            capture_output=True, text=True, cwd=REPO, timeout=30).stdout
    # closed: the tensors were copied out, the model still works, nothing is held
    assert m(x).shape == (64, 1)
    assert ps(run_dir)["pool"]["granted"] == 0


def test_the_optimizer_state_goes_back_on_the_daemons_ask_and_returns_for_a_step(run_dir):
    with connect_trainer("tr", run_dir=run_dir) as tr:
        m, opt = model_and_opt(tr, hidden=1024)  # its AdamW state: a few pages
        prm = next(m.parameters())
        with tr.step(0):  # one step: the state is not zeros
            m(torch.randn(8, 16)).sum().backward()
            opt.step()
            tr.zero_grad()
        before = opt.state[prm]["exp_avg"].clone()
        assert before.abs().sum() > 0
        optim = tr.optim.footprint
        budget = ps(run_dir)["pool"]["budget"]
        with connect("other", run_dir=run_dir, kind="test", shares=100) as other:
            # all but the trainer's parameters (within the other's fair share): only the
            # trainer's reclaimable part can make room
            assert tr.optim.footprint > PAGE
            g = other.region_group(1, budget)
            g.grant(list(range((budget - tr.state.footprint) // PAGE)))
            assert tr.offloads == 1 and mine(run_dir)["mapped"] == tr.state.footprint
            assert torch.equal(opt.state[prm]["exp_avg"], before)  # in host memory now
            assert not inside(opt.state[prm]["exp_avg"], tr.optim)
            g.close()
        with tr.step(0):
            assert inside(opt.state[prm]["exp_avg"], tr.optim)
            assert torch.equal(opt.state[prm]["exp_avg"], before)
            assert mine(run_dir)["mapped"] == tr.state.footprint + optim


def test_a_step_larger_than_the_budget_is_refused_at_once(run_dir):
    with connect_trainer("tr", run_dir=run_dir) as tr:
        model_and_opt(tr)
        held = mine(run_dir)["mapped"]
        with pytest.raises(StepTooLarge, match="cannot ever fit.*nothing was taken"):
            with tr.step(8 * MiB):
                raise AssertionError("the step ran")
        assert mine(run_dir)["mapped"] == held and tr.steps == 0


def test_a_step_that_does_not_fit_waits_then_raises_holding_nothing(run_dir):
    with connect_trainer("tr", run_dir=run_dir, wait_s=1.0) as tr:
        model_and_opt(tr)
        held = mine(run_dir)["mapped"]
        budget = ps(run_dir)["pool"]["budget"]
        rest = budget - held
        # a tenant whose min protects what it holds: nothing can be reclaimed from it
        with connect("other", run_dir=run_dir, kind="test", min=rest) as other:
            g = other.region_group(1, rest)
            g.grant(list(range(rest // PAGE)))
            with pytest.raises(StepDeadline, match="not granted before its deadline"):
                with tr.step(2 * PAGE):
                    raise AssertionError("the step ran")
            assert mine(run_dir)["mapped"] == held
            g.close()
        with tr.step(2 * PAGE):  # room again: the trainer went on
            assert mine(run_dir)["mapped"] == held + 2 * PAGE
