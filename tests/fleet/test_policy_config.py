"""``[fleet] policy`` and its knobs in a fleet file (issue 36 item 2, "Bad input"): an
unknown policy or knob, a knob outside its range, a knob of another policy, a model key
the policy sets itself, a baseline without its own daemon: each one line ``FILE: key:
why`` on stderr, exit 2, nothing started (``kvpool fleet`` run in-process)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kvpool.cli.main import cli
from kvpool.fleet.config import load

MODEL = '[[models]]\nname = "alpha"\ncheckpoint = "alpha"\n'


@pytest.fixture(autouse=True)
def nothing_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """A file that passed the checks would start a fleet: fail at once instead."""
    def serve(*args: object, **kwargs: object) -> None:
        raise AssertionError("the fleet file passed its checks")

    monkeypatch.setattr("kvpool.fleet.service.serve", serve)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpool.engine.model.tiny import make_tiny_model

    d = tmp_path_factory.mktemp("policycfg")
    make_tiny_model(d / "alpha", layers=1, hidden=64, heads=2, kv_heads=1, vocab=512)
    return d


def fleet_file(folder: Path, fleet: str, model: str = "") -> Path:
    f = folder / "fleet.toml"
    f.write_text(f'[fleet]\nname = "p"\n{fleet}{MODEL}{model}')
    return f


def test_each_policy_with_its_knobs(folder: Path) -> None:
    c = load(fleet_file(folder, ""))
    assert (c.policy, dict(c.policy_knobs)) == ("kvpool", {})
    c = load(fleet_file(folder, 'policy = "swap"\nkeep_alive = -1\nmax_loaded = 2\n'),
             with_daemon=True)
    assert (c.policy, dict(c.policy_knobs)) == ("swap", {"keep_alive": -1.0, "max_loaded": 2})
    c = load(fleet_file(folder, 'policy = "idle-sleep"\nidle_threshold = 0.5\n'),
             with_daemon=True)
    assert dict(c.policy_knobs) == {"idle_threshold": 0.5, "check_interval": 60.0}
    c = load(fleet_file(folder, 'policy = "reconcile"\nfloor_percent = 0\n',
                        'sleepable = false\neager = true\n'), with_daemon=True)
    assert dict(c.policy_knobs) == {"reconcile_interval": 10.0, "floor_percent": 0.0,
                                    "sleep_after": 300.0}
    assert c.models[0].sleepable is False  # (the value the policy sets: allowed)


BAD = [
    # ([fleet] lines, model lines, the key named, a piece of the reason)
    ('policy = "lru"\n', "", "fleet.policy", "'lru' is not one of kvpool, swap, idle-sleep, "
     "reconcile"),
    ('policy = 3\n', "", "fleet.policy", "expected a string"),
    # (its knobs are not judged against a policy that does not exist: one line)
    ('policy = "lru"\nkeep_alive = 5\n', "", "fleet.policy", "is not one of"),
    ('policy = "swap"\nkeep_alvie = 5\n', "", "fleet.keep_alvie", "unknown key"),
    ('policy = "swap"\nmax_loaded = 0\n', "", "fleet.max_loaded", "out of range (1 to 1000"),
    ('policy = "swap"\nmax_loaded = 2.5\n', "", "fleet.max_loaded", "not a whole number"),
    ('policy = "swap"\nkeep_alive = -2\n', "", "fleet.keep_alive",
     "out of range (0 to 31536000 seconds, or -1 for never)"),
    ('policy = "swap"\nkeep_alive = true\n', "", "fleet.keep_alive", "expected a number"),
    ('policy = "idle-sleep"\nidle_threshold = 0\n', "", "fleet.idle_threshold",
     "out of range (more than 0"),
    ('policy = "idle-sleep"\ncheck_interval = nan\n', "", "fleet.check_interval",
     "out of range"),
    ('policy = "reconcile"\nfloor_percent = 101\n', "", "fleet.floor_percent",
     "out of range (0 to 100 percent)"),
    ('policy = "reconcile"\nreconcile_interval = -1\n', "", "fleet.reconcile_interval",
     "out of range"),
    ('policy = "idle-sleep"\nkeep_alive = 5\n', "", "fleet.keep_alive",
     "a knob of policy 'swap', not of 'idle-sleep'"),
    ("sleep_after = 5\n", "", "fleet.sleep_after", "a knob of policy 'reconcile', not of "
     "'kvpool'"),
    ('policy = "swap"\n', "sleep_after = 2\n", "models[0].sleep_after",
     "policy 'swap' sets sleep_after itself (unset"),
    ('policy = "swap"\n', 'weights = "pool"\n', "models[0].weights",
     "policy 'swap' sets weights itself ('local'"),
    ('policy = "idle-sleep"\n', "sleepable = true\n", "models[0].sleepable",
     "policy 'idle-sleep' sets sleepable itself (False"),
    ('policy = "reconcile"\n', 'max = "1MiB"\n', "models[0].max",
     "policy 'reconcile' sets max itself (unset"),
    ('policy = "swap"\n', "eager = true\n", "models[0].eager", "policy 'swap' sets eager"),
]


@pytest.mark.parametrize("fleet,model,key,why", BAD)
def test_each_bad_policy_value_is_one_line_exit_2(folder: Path, fleet: str, model: str,
                                                  key: str, why: str) -> None:
    f = fleet_file(folder, fleet, model)
    r = CliRunner().invoke(cli, ["fleet", str(f), "--with-daemon"])
    lines = r.stderr.splitlines()
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert lines[0].startswith(f"{f}: {key}: ") and why in lines[0], lines
    assert "Traceback" not in r.output


def test_a_baseline_runs_only_on_its_own_daemon(folder: Path) -> None:
    f = fleet_file(folder, 'policy = "reconcile"\n')
    r = CliRunner().invoke(cli, ["fleet", str(f)])
    lines = r.stderr.splitlines()
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert lines[0] == (f"{f}: fleet.policy: 'reconcile' is a baseline: it runs only on a "
                        f"daemon of its own (kvpool fleet --with-daemon), whose whole budget "
                        f"it shares")
