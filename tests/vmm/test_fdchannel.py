"""fd passing over SOCK_SEQPACKET with SCM_RIGHTS."""

from __future__ import annotations

import os
import socket

import pytest

from kvpool import fdchannel


def open_fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    yield a, b
    a.close()
    b.close()


def test_roundtrip_and_every_fd_closed(pair):
    a, b = pair
    before = open_fd_count()
    fds = [os.memfd_create(f"t{i}") for i in range(10)]
    for i, fd in enumerate(fds):
        os.write(fd, bytes([i]))
    fdchannel.send_fds(a, b"hdr", fds)
    fdchannel.close_all(fds)
    data, got = fdchannel.recv_fds(b)
    assert data == b"hdr" and len(got) == 10
    with fdchannel.closing(got):
        assert [os.pread(fd, 1, 0)[0] for fd in got] == list(range(10))
    assert open_fd_count() == before


def test_more_than_253_are_refused_or_batched(pair):
    a, b = pair
    fds = [os.memfd_create("t") for _ in range(600)]
    with pytest.raises(fdchannel.FdChannelError, match="253"):
        fdchannel.send_fds(a, b"x", fds)
    assert fdchannel.send_fds_batched(a, b"x", fds) == 3
    got = []
    for _ in range(3):
        _, part = fdchannel.recv_fds(b)
        got += part
    assert len(got) == 600
    fdchannel.close_all(got + fds)


def test_truncated_descriptors_are_detected_and_closed(pair):
    a, b = pair
    before = open_fd_count()
    fds = [os.memfd_create("t") for _ in range(8)]
    fdchannel.send_fds(a, b"x", fds)
    fdchannel.close_all(fds)
    with pytest.raises(fdchannel.FdChannelError, match="truncated"):
        fdchannel.recv_fds(b, maxfds=2)
    assert open_fd_count() == before


def test_eof_and_peer_credentials(tmp_path):
    path = str(tmp_path / "s.sock")
    server = fdchannel.listen(path)
    assert oct(os.stat(path).st_mode & 0o777) == "0o660"
    client = fdchannel.connect(path)
    conn, _ = server.accept()
    pid, uid, _ = fdchannel.peer_credentials(conn)
    assert pid == os.getpid() and uid == os.getuid()
    client.close()
    assert fdchannel.recv_fds(conn) == (b"", [])
    conn.close()
    server.close()
