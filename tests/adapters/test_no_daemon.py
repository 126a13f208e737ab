"""Every command that needs a daemon and finds none says so in one line with what to do,
exit 1 (issue 34, item 3: ``kvpool serve --elastic`` printed a 47-line traceback).

Each command runs as a real subprocess against a run directory no daemon serves: an
empty one, and one that does not exist. (``ps``/``top``/``map``/``events``/``check`` are
covered in tests/observability.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# (label, argv after `kvpool`); MODEL is replaced by the tiny model's folder
COMMANDS: list[tuple[str, list[str]]] = [
    ("serve --elastic", ["serve", "MODEL", "--elastic"]),
    ("serve --elastic --weights local", ["serve", "MODEL", "--elastic", "--weights", "local"]),
    ("serve --elastic --sleepable", ["serve", "MODEL", "--elastic", "--sleepable"]),
    ("serve --elastic -tp 2", ["serve", "MODEL", "--elastic", "-tp", "2"]),
    ("serve --elastic --handoff-from", ["serve", "MODEL", "--elastic", "--handoff-from",
                                        "other"]),
    ("serve --role prefill", ["serve", "MODEL", "--role", "prefill"]),
    ("serve --role decode", ["serve", "MODEL", "--role", "decode", "--prefill-url",
                             "http://127.0.0.1:9"]),
    ("serve --pd", ["serve", "MODEL", "--pd"]),
    ("KVPOOL_ENABLE=1 serve", ["serve", "MODEL"]),
    ("lease", ["lease", "1MiB", "true"]),
    ("sleep", ["sleep", "someone"]),
    ("wake", ["wake", "someone"]),
    ("limit", ["limit", "someone", "1MiB"]),
    ("stop", ["stop"]),
]


def run(argv: list[str], run_dir: Path, enable: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    env.update(KVPOOL_RUN_DIR=str(run_dir), PYTHONPATH=str(REPO))
    if enable:
        env["KVPOOL_ENABLE"] = "1"
    port = ["--port", "9"] if argv[0] == "serve" else []  # never reached: no daemon
    return subprocess.run([sys.executable, "-m", "kvpool.cli.main", *argv, *port],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)


@pytest.mark.parametrize("label,argv", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_a_command_without_a_daemon_says_so_in_one_line(label, argv, tiny_model, tmp_path):
    argv = [str(tiny_model) if a == "MODEL" else a for a in argv]
    for run_dir in (tmp_path / "empty", tmp_path / "missing"):
        if run_dir.name == "empty":
            run_dir.mkdir(mode=0o755)
        out = run(argv, run_dir, enable=label.startswith("KVPOOL_ENABLE"))
        err = out.stderr.strip()
        assert out.returncode == 1, (label, out.returncode, out.stderr[-3000:])
        assert "Traceback" not in out.stderr and len(err.splitlines()) == 1, (label, err)
        assert f"no kvpool daemon at {run_dir}" in err, (label, err)
        assert "start one with `kvpool daemon" in err, (label, err)  # what to do
