"""Issue 34 item 7: ``kvpool fleet --with-daemon`` starts its daemon on a fresh run
directory; the line that says so names the command that shows it (``kvpool ps --run-dir
DIR``), and that command, run as printed, answers."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

from kvpool import launch
from kvpool.fleet.member import free_port

from daemon.helpers import PAGE, REPO, wait_for


def test_with_daemon_names_the_ps_command_for_its_run_dir(tmp_path: Path):
    from kvpool.engine.model.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "m", layers=1, hidden=64, heads=2, kv_heads=1,
                            vocab=512, seed=1)
    f = tmp_path / "fleet.toml"
    f.write_text(f'[fleet]\nname = "hint"\nport = {free_port()}\n'
                 f'[daemon]\nbudget = "8MiB"\npage_size = "{PAGE // 1024}KiB"\n'
                 f'[[models]]\nname = "m"\ncheckpoint = "{model}"\nkv_cache_size = "1MiB"\n'
                 f'eager = false\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    log = tmp_path / "fleet.log"
    proc = launch.spawn_process([*launch.cli_argv(), "fleet", str(f), "--with-daemon",
                                 "--log-dir", str(tmp_path / "logs")], log, cwd=REPO,
                                new_session=True, base_env=env)
    try:
        line = wait_for(lambda: re.search(r".*started a daemon on run dir.*",
                                          log.read_text(errors="replace")),
                        timeout=120, what=f"the fleet's daemon line in {log}").group(0)
        found = re.search(r"started a daemon on run dir (\S+) .*`(kvpool ps [^`]*)`", line)
        assert found, line
        argv = shlex.split(found.group(2))
        assert argv == ["kvpool", "ps", "--run-dir", found.group(1)], found.group(0)
        ps = subprocess.run([*launch.cli_argv(), *argv[1:]], capture_output=True, text=True,
                            timeout=60, cwd=REPO, env=env)
        assert ps.returncode == 0 and "NAME" in ps.stdout, ps
    finally:
        code = launch.stop(proc, 60.0)
        launch.stop(proc, 10.0, group=True)
    assert code == 0, log.read_text()
