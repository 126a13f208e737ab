"""A raw peer for attack tests: its own fd-channel socket and ZeroMQ DEALER, no
client_lib, so a test can do what an honest client never does (pipeline requests,
never read its fd channel, announce descriptors it never sends)."""

from __future__ import annotations

import itertools
import os

import psutil
import zmq

from kvpool import fdchannel, paths
from kvpool import protocol as p
from kvpool.limits import raise_fd_limit


class RawPeer:
    """One session: ``fd`` (the fd channel, hello already read) and ``sock`` (control)."""

    def __init__(self, run_dir, fd_channel: bool = True):
        self.run_dir = run_dir
        self.token = ""
        self.fd = None
        if fd_channel:
            self.fd = fdchannel.connect(str(paths.pages_path(run_dir)))
            self.fd.settimeout(10)
            self.token = p.decode_hello(self.fd.recv(fdchannel.MAX_DATA)).token
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(paths.control_endpoint(run_dir))
        self._ids = itertools.count(1)

    def send(self, req: p.Request) -> int:
        """Send without waiting; returns the request id."""
        req.id = next(self._ids)
        req.token = self.token
        self.sock.send(p.encode(req))
        return req.id

    def recv(self, timeout_s: float = 10.0) -> p.Reply:
        assert self.sock.poll(timeout_s * 1000), "the daemon stopped answering"
        return p.decode_reply(self.sock.recv())

    def call(self, req: p.Request, timeout_s: float = 10.0) -> p.Reply:
        rid = self.send(req)
        while True:
            reply = self.recv(timeout_s)
            if reply.id == rid:
                return reply

    def register(self, name: str, kind: str = "engine") -> p.Reply:
        reply = self.call(p.Register(name=name, kind=kind))
        assert isinstance(reply, p.Registered), reply
        return reply

    def group(self, npages: int, page: int) -> int:
        reply = self.call(p.CreateGroup(n_regions=1, capacity=npages * page))
        assert isinstance(reply, p.GroupCreated), reply
        return reply.group

    def close(self) -> None:
        self.sock.close(linger=0)
        if self.fd is not None:
            self.fd.close()


def daemon_usage(pid: int) -> tuple[int, int]:
    """(open descriptors, resident bytes) of the daemon process."""
    proc = psutil.Process(pid)
    return proc.num_fds(), proc.memory_info().rss


def allow_fds(n: int) -> None:
    """Let this test process hold ``n`` descriptors (up to the hard limit)."""
    raise_fd_limit(n)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
