"""Issue 34 item 4: on a daemon serving several devices, ``ps``, ``top``, ``map`` and
``events`` show every device by default (``--device`` narrows to one), and a device the
daemon does not serve is an error (one line, nonzero), for ``check`` too. Also the
monitor commands' answer when no daemon runs: one line saying what to do, exit 1."""

from __future__ import annotations

import json

import pytest

from daemon.helpers import PAGE

MONITORS = (("ps",), ("top", "--once"), ("map",), ("events",), ("check",))


def two_devices(start_daemon):
    """A host daemon of two pools (16 pages each), tenant ``zero`` holding 2 pages on
    device 0 and ``one`` 3 pages on device 1."""
    d = start_daemon(budget=str(16 * PAGE), extra=("--devices", "2"))
    zero, one = d.connect("zero", device=0), d.connect("one", device=1)
    zero.region_group(1, 8 * PAGE).grant(range(2))
    one.region_group(1, 8 * PAGE).grant(range(3))
    return d, zero, one


def test_ps_map_top_events_show_every_device(start_daemon):
    d, zero, one = two_devices(start_daemon)
    ps = d.cli_json("ps")
    by_name = {t["name"]: t for t in ps["tenants"]}
    assert set(by_name) == {"zero", "one"}, ps
    assert by_name["zero"]["device"] == 0 and by_name["one"]["device"] == 1
    assert sorted(pool["device"] for pool in ps["pools"]) == [0, 1]
    text = d.cli("ps").stdout
    assert "DEVICE" in text and "zero" in text and "one" in text

    maps = d.cli("map").stdout
    assert "device 0" in maps and "device 1" in maps
    assert "tenant zero" in maps and "tenant one" in maps
    assert {g["device"] for g in d.cli_json("map")["groups"]} == {0, 1}

    top = d.cli("top", "--once").stdout
    rows = [line.split() for line in top.splitlines() if line.split()]
    assert any(r[0] == "zero" for r in rows) and any(r[0] == "one" for r in rows), top
    assert "pool host:0" in top and "pool host:1" in top
    assert "2 devices" in top.splitlines()[0]

    evs = [json.loads(x) for x in d.cli("events", "--json").stdout.splitlines()]
    grants = {(e["tenant"], e["device"]) for e in evs if e["kind"] == "grant"}
    assert grants == {("zero", 0), ("one", 1)}, evs
    assert [e["seq"] for e in evs] == sorted({e["seq"] for e in evs})  # one stream
    assert "dev 1" in d.cli("events").stdout
    assert d.cli("check").stdout.strip() == "ok"
    zero.close()
    one.close()


def test_device_narrows_to_one(start_daemon):
    d, zero, one = two_devices(start_daemon)
    ps = d.cli_json("ps", "--device", "1")
    assert [t["name"] for t in ps["tenants"]] == ["one"]
    assert [p_["device"] for p_ in ps["pools"]] == [1]
    maps = d.cli("map", "--device", "1").stdout
    assert "tenant one" in maps and "tenant zero" not in maps
    top = d.cli("top", "--once", "--device", "0").stdout
    assert "pool host:0" in top and "pool host:1" not in top and "zero" in top
    evs = [json.loads(x) for x in d.cli("events", "--json", "--device", "1").stdout.split("\n")
           if x]
    assert evs and {e["device"] for e in evs} == {1}
    zero.close()
    one.close()


@pytest.mark.parametrize("args", MONITORS)
def test_a_device_not_served_is_an_error(start_daemon, args):
    d = start_daemon(budget=str(16 * PAGE), extra=("--devices", "2"))
    out = d.cli(*args, "--device", "7", check=False)
    assert out.returncode in (1, 2), out
    assert "device 7 is not served" in out.stderr and "devices 0, 1" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert out.stdout == "" or "ok" not in out.stdout


@pytest.mark.parametrize("args", MONITORS)
def test_no_daemon_says_what_to_do(tmp_path, args):
    import subprocess
    import sys

    from daemon.helpers import REPO

    out = subprocess.run([sys.executable, "-m", "kvpool.cli.main", *args, "--run-dir",
                          str(tmp_path / "none")], capture_output=True, text=True, timeout=60,
                         cwd=REPO)
    assert out.returncode == 1, out
    err = out.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"no kvpool daemon at {tmp_path / 'none'}" in err
    assert "kvpool daemon" in err.split("no kvpool daemon", 1)[1]  # how to start one
    assert "--run-dir" in err
