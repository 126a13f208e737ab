"""The tests' worker reader keeps its deadline whatever the worker does (issue 24): a
worker that prints nothing, or half a line, is given up on at the timeout, not when it
ends; lines split across writes, several lines in one write and a last line without its
newline all come out whole."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from .helpers import read_event, read_line

SILENT = "import sys, time; print('{\"event\": \"other\"}', flush=True); " \
         "sys.stdout.write('{\"event\": \"ha'); sys.stdout.flush(); time.sleep(120)"
SPLIT = ("import sys, time\n"
         "for part in ['{\"event\": \"a\"', ', \"n\": 1}\\n{\"event\": \"b\"}\\n{\"ev', "
         "'ent\": \"c\"}\\n', 'tail']:\n"
         "    sys.stdout.write(part); sys.stdout.flush(); time.sleep(0.01)\n")


def worker(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_silent_worker_is_given_up_on_at_the_deadline():
    proc = worker(SILENT)
    try:
        t0 = time.monotonic()
        with pytest.raises(AssertionError, match="no 'ready' from worker in 1.0 s"):
            read_event(proc, "ready", timeout=1.0)
        assert time.monotonic() - t0 < 60, "it waited for the worker, not the deadline"
    finally:
        proc.kill()
        proc.wait()


def test_lines_come_out_whole_however_they_are_written():
    proc = worker(SPLIT)
    try:
        assert read_event(proc, "a")["n"] == 1
        assert read_event(proc, "c") == {"event": "c"}  # b skipped, c whole
        assert read_line(proc) == "tail"
        assert read_line(proc) is None
    finally:
        proc.kill()
        proc.wait()
