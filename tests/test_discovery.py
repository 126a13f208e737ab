"""kvpool.discovery: the endpoints file's first line names its writer, and a reader tells a
live writer from a dead one (a pid gone or reused, another boot); hostile addresses and
namespaces are refused with one line."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import yaml

from kvpool.discovery import Writer, address_problem, namespace_problem, render, writer_of


def test_the_first_line_names_the_writer_and_yaml_ignores_it() -> None:
    me = Writer.me()
    text = render([{"name": "m-1", "namespace": "ns", "address": "10.0.0.1", "port": 8000,
                    "labels": {"model": "m"}}], "a header", me)
    assert writer_of(text) == me and me.alive() is True
    assert yaml.safe_load(text)["endpoints"][0]["port"] == 8000


def test_a_dead_or_reused_pid_another_boot_or_another_host() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    dead = dataclasses.replace(Writer.me(), pid=child.pid)
    child.wait()
    assert dead.alive() is False  # the pid is gone
    assert dataclasses.replace(Writer.me(), start=1).alive() is False  # pid reused
    assert dataclasses.replace(Writer.me(), boot_id="another-boot").alive() is False
    assert dataclasses.replace(Writer.me(), host="not-this-host").alive() is None


@pytest.mark.parametrize("text", [
    "", "endpoints: []\n", "# kvpool-writer: {not json}\n", "# kvpool-writer: {\"pid\": 1}\n",
    "# kvpool-writer: " + "x" * 10000,
])
def test_a_file_without_a_writer_line_names_none(text: str) -> None:
    assert writer_of(text) is None


@pytest.mark.parametrize("address, ok", [
    ("10.0.0.5", True), ("::1", True), ("node-a.example.com", True), ("node-a.", True),
    ("", False), ("a b", False), ("x\ny", False), ("-bad.example", False),
    ("a" * 64 + ".com", False), ("a." * 130, False), ("http://x", False),
])
def test_addresses(address: str, ok: bool) -> None:
    why = address_problem(address)
    assert (why is None) == ok, why
    if why is not None:
        assert "\n" not in why and len(why) < 200


@pytest.mark.parametrize("namespace, ok", [
    ("default", True), ("ns-1", True), ("NS", False), ("a_b", False), ("", False),
    ("a" * 64, False), ("-a", False),
])
def test_namespaces(namespace: str, ok: bool) -> None:
    assert (namespace_problem(namespace) is None) == ok
