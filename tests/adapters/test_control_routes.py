"""Who may put a ``kvpool serve --elastic`` server to sleep or wake it (``POST /sleep``,
``POST /wake_up``) or publish new weights to it (``POST /kvpool/weights``;
:mod:`kvpool.control_token`), against real servers on a real daemon:

* on a non-loopback address with ``KVPOOL_CONTROL_TOKEN``: no header is a 401, another
  token a 403 (also when the query is bad: the check comes first), the right token
  works; serving routes need nothing — and the caller here is on loopback, so the
  peer's address is not what admits (a mesh sidecar makes every caller local);
* on a non-loopback address without a token: the routes are off (403 saying what to
  set), serving goes on;
* a token that protects nothing (too short) stops the server before it loads, one line.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from kvpool.control_token import ControlGate, ControlTokenError, headers, load

from daemon.helpers import REPO

TOKEN = "s3cret-token-of-the-test-0123456789"


def control(url: str, route: str, token: str | None = None, **params: object) -> httpx.Response:
    h = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.post(f"{url}/{route}", params=params, headers=h, timeout=120)


def one_line_error(r: httpx.Response) -> str:
    msg = r.json()["error"]["message"]
    assert "\n" not in msg and len(msg) < 200, msg
    return str(msg)


def asleep(url: str) -> bool:
    return bool(httpx.get(f"{url}/is_sleeping", timeout=30).json()["is_sleeping"])


def served(url: str) -> int:
    return httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": "t", "prompt": [20, 21, 22], "max_tokens": 2}).status_code


def test_a_token_is_required_and_checked(start_daemon, servers) -> None:
    d = start_daemon(budget="32MiB")
    s = servers.start("t", run_dir=d.run_dir, extra=("--host", "0.0.0.0", "--sleepable"),
                      env={"KVPOOL_CONTROL_TOKEN": TOKEN})
    servers.wait_healthy()
    for route in ("sleep", "wake_up", "kvpool/weights"):
        r = control(s.base, route)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
        assert "KVPOOL_CONTROL_TOKEN" in one_line_error(r)
        r = control(s.base, route, token=TOKEN + "x")
        assert r.status_code == 403 and one_line_error(r) == "control route: wrong token"
    assert control(s.base, "sleep", level=9).status_code == 401  # before the query
    assert httpx.post(f"{s.base}/sleep", headers={"Authorization": f"Basic {TOKEN}"},
                      timeout=120).status_code == 401
    assert not asleep(s.base) and served(s.base) == 200  # nothing happened; serving is open
    r = control(s.base, "sleep", token=TOKEN)
    assert r.status_code == 200 and asleep(s.base), r.text
    r = control(s.base, "wake_up", token=TOKEN)
    assert r.status_code == 200 and not asleep(s.base), r.text


def test_without_a_token_a_server_off_loopback_refuses_them(start_daemon, servers) -> None:
    d = start_daemon(budget="32MiB")
    s = servers.start("t", run_dir=d.run_dir, extra=("--host", "0.0.0.0", "--sleepable"))
    servers.wait_healthy()
    for route in ("sleep", "wake_up", "kvpool/weights"):
        r = control(s.base, route, token="anything-at-all-0123456789")
        assert r.status_code == 403, r.text
        msg = one_line_error(r)
        assert "listens on 0.0.0.0" in msg and "KVPOOL_CONTROL_TOKEN" in msg, msg
    assert not asleep(s.base) and served(s.base) == 200


def test_a_short_token_stops_the_server_before_it_loads(tiny_model) -> None:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "KVPOOL_CONTROL_TOKEN": "short",
           "KVPOOL_RUN_DIR": "/nonexistent"}
    out = subprocess.run([sys.executable, "-m", "kvpool.cli.main", "serve", str(tiny_model),
                          "--elastic", "--host", "0.0.0.0"], capture_output=True, text=True,
                         timeout=120, env=env, cwd=REPO)
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "KVPOOL_CONTROL_TOKEN" in lines[0], out.stderr
    assert "Traceback" not in out.stderr


# ---- the decision itself ------------------------------------------------------------------
def test_the_gate_decides_by_token_then_by_the_listening_address() -> None:
    assert ControlGate(None, "127.0.0.1").refusal(None) is None
    assert ControlGate(None, "::1").refusal(None) is None
    assert ControlGate(None, "localhost").refusal(None) is None
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.internal", "127.0.0.1.nip.io"):
        refused = ControlGate(None, host).refusal(f"Bearer {TOKEN}")
        assert refused is not None and refused[0] == 403, host
    gate = ControlGate(TOKEN, "127.0.0.1")  # a token binds loopback too
    assert gate.refusal(None) == (401, "control route: send Authorization: Bearer "
                                       "<KVPOOL_CONTROL_TOKEN>")
    for bad in ("", "Bearer", "Bearer ", f"Basic {TOKEN}", TOKEN):
        assert gate.refusal(bad) is not None and gate.refusal(bad)[0] == 401, bad
    assert gate.refusal(f"Bearer {TOKEN[:-1]}")[0] == 403
    assert gate.refusal(f"Bearer {TOKEN}\u00e9")[0] == 403  # (not an exception)
    assert gate.refusal(f"bearer {TOKEN}") is None


def test_the_token_is_read_from_the_environment_or_a_file(tmp_path) -> None:
    assert load({}) is None and headers({}) == {}
    assert headers({"KVPOOL_CONTROL_TOKEN": TOKEN}) == {"Authorization": f"Bearer {TOKEN}"}
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")  # a Secret's file, newline and all
    assert load({"KVPOOL_CONTROL_TOKEN_FILE": str(f)}) == TOKEN
    f.write_bytes(b"\xff" * 20)
    bad = [{"KVPOOL_CONTROL_TOKEN": TOKEN, "KVPOOL_CONTROL_TOKEN_FILE": str(f)},
           {"KVPOOL_CONTROL_TOKEN_FILE": str(f)},
           {"KVPOOL_CONTROL_TOKEN_FILE": str(tmp_path / "missing")},
           {"KVPOOL_CONTROL_TOKEN": "short"}, {"KVPOOL_CONTROL_TOKEN": "x" * 5000},
           {"KVPOOL_CONTROL_TOKEN": "has a space in it, long enough"},
           {"KVPOOL_CONTROL_TOKEN": "\x00" * 20}, {"KVPOOL_CONTROL_TOKEN": ""}]
    for env in bad:
        with pytest.raises(ControlTokenError) as e:
            load(env)
        assert "\n" not in str(e.value) and len(str(e.value)) < 200, env
