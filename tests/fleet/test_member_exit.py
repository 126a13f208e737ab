"""What the fleet says of a member that exited (issue 36 item 1): the signal that killed
it, or its exit code and the last error line *that* process wrote, never a Python warning
nor a line of an earlier process in the same (appended) log. No process is started."""

from __future__ import annotations

from pathlib import Path

from kvpool.fleet.engines import QUIET_PATHS, MemberSpec, Vllm
from kvpool.fleet.entries import ModelEntry
from kvpool.fleet.member import Member

WARNING = ("/usr/lib/python3/site-packages/transformers/utils/generic.py:441: FutureWarning:"
           " _register_pytree_node is deprecated and will raise a RuntimeError in a future "
           "version")


def member(tmp_path: Path, engine: str = "bundled") -> Member:
    spec = MemberSpec(ModelEntry(name="m", checkpoint=tmp_path, engine=engine), "m", "f",
                      tmp_path)
    return Member(spec, 0, Vllm(), tmp_path / "m.log")


def test_the_reason_is_the_last_error_line_never_a_warning(tmp_path: Path) -> None:
    m = member(tmp_path)
    m.log.write_text("INFO starting\nRuntimeError: an earlier process's error\n")
    m.log_from = m.log.stat().st_size  # (what spawn records: this process starts here)
    with m.log.open("a") as f:
        f.write("INFO 12-05 04:00:01 loading\nTraceback (most recent call last):\n"
                '  File "x.py", line 3, in <module>\n'
                "kvpool.engine_adapters.vllm.settings.AdapterError: kvpool: the KV budget "
                "(131072 B) is smaller than one chunk of 1 KV blocks (262144 B)\n"
                f"{WARNING}\n  warnings.warn(\n\n")
    assert m.why_exited(1) == ("exited with code 1: kvpool.engine_adapters.vllm.settings."
                               "AdapterError: kvpool: the KV budget (131072 B) is smaller "
                               "than one chunk of 1 KV blocks (262144 B)")


def test_no_error_line_is_the_code_alone_and_a_signal_is_named(tmp_path: Path) -> None:
    m = member(tmp_path)
    m.log.write_text("ValueError: from before\n")
    m.log_from = m.log.stat().st_size
    with m.log.open("a") as f:
        f.write(f"INFO serving\n{WARNING}\n")
    assert m.why_exited(3) == "exited with code 3"
    assert m.why_exited(-9) == "killed by SIGKILL"
    assert m.why_exited(-15) == "killed by SIGTERM"


def test_a_vllm_member_counts_sleeps_by_cause_and_keeps_looks_out_of_its_log(
        tmp_path: Path) -> None:
    kind = Vllm()
    argv = kind.launch(member(tmp_path, "vllm").spec, 8000).argv
    flag = argv.index("--disable-access-log-for-endpoints")
    assert argv[flag + 1].split(",") == list(QUIET_PATHS) and kind.state_path in QUIET_PATHS
    seen = kind.observe({"is_sleeping": True, "state": "asleep", "wakes": 2,
                         "sleeps": {"idle": 1, "pressure": 2, "operator": 1, "http": 1}})
    assert (seen.asleep, dict(seen.sleeps or {}), seen.wakes) == \
        (True, {"idle": 1, "pressure": 2, "operator": 2}, 2)


def test_a_port_taken_before_the_bind_is_told_from_other_exits(tmp_path: Path) -> None:
    """The exit of a server whose port another process took (uvicorn's line: the bundled
    server; vLLM's traceback) is told apart from every other exit: another error, an
    address in use that names another port (torch's store), a signal, a clean exit, and
    an earlier process's line in the same log."""
    m = member(tmp_path)
    m.port = 41234
    uvicorn = ("ERROR:    [Errno 98] error while attempting to bind on address "
               "('127.0.0.1', 41234): address already in use")
    vllm = ('Traceback (most recent call last):\n  File "launcher.py", line 348, in '
            'create_server_socket\n    sock.bind(addr)\nOSError: [Errno 98] Address already in use')
    torch = ("torch.distributed.DistNetworkError: The server socket has failed to listen on "
             "any local network address. port: 29500, useIpv6: false, code: -98, name: "
             "EADDRINUSE, message: address already in use")
    cases = [(uvicorn, 1, True), (vllm, 1, True), (uvicorn.replace("41234", "41235"), 1, False),
             (torch, 1, False), ("ValueError: bad checkpoint", 1, False),
             ("Error: No such option: --no-such-flag", 2, False), (uvicorn, -9, False),
             (uvicorn, 0, False)]
    for text, code, taken in cases:
        m.log.write_text(f"INFO starting\n{text}\n{WARNING}\n")
        m.log_from = 0
        assert m.port_taken(code) == taken, (text, code)
    m.log.write_text(f"{uvicorn}\n")  # an earlier process's bind failure
    m.log_from = m.log.stat().st_size
    with m.log.open("a") as f:
        f.write("RuntimeError: the daemon refused\n")
    assert not m.port_taken(1)
