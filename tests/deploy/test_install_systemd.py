"""Issue 34 item 1: the README's "Install as a service" section, followed as written on a
fresh machine, ends with a unit systemd accepts.

Each test copies this checkout into a scratch clone and runs ``scripts/install-systemd.sh``
there with ``--root`` a scratch root that looks like a fresh Debian with systemd (systemd's
own units, an ``/etc/passwd`` with root alone, a ``video`` group and no ``render``): the
venv install the README line does, a system-wide pip install, a venv under ``/home``;
then ``systemd-analyze verify --root`` must be clean, and the user, directories,
configuration, documentation and enablement must be where the unit expects them. Needs
systemd's tools (Debian's ``systemd`` package; ``make venv`` installs it where it can)
and root; skipped with one line without them, or when the package index is unreachable.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS = ("systemd-analyze", "systemd-sysusers", "systemd-tmpfiles", "systemctl")
SYSTEM_UNITS = Path("/usr/lib/systemd/system")
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # sudo's secure_path
EXEC = "daemon --config /etc/kvpool/kvpool.toml --run-dir /run/kvpool"
UNREACHABLE = ("NewConnectionError", "Network is unreachable", "Temporary failure in name "
               "resolution", "Name or service not known", "ConnectTimeoutError",
               "No matching distribution found", "Could not find a version")

missing = [t for t in TOOLS if shutil.which(t, path=PATH) is None]
if missing:
    pytest.skip(f"systemd's tools are not installed ({', '.join(missing)}): apt-get install "
                f"systemd", allow_module_level=True)
if os.geteuid() != 0:
    pytest.skip("the install script runs as root", allow_module_level=True)
if not (SYSTEM_UNITS / "sysinit.target").exists():
    pytest.skip(f"no systemd units in {SYSTEM_UNITS} to build a fresh root from",
                allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    out["PATH"] = PATH
    return out


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What a fresh clone holds (and the script uses): the package, scripts, systemd/,
    docs, README."""
    root = tmp_path_factory.mktemp("clone")
    skip = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc", "build", "*.egg-info")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, root / name)
    for name in ("kvpool", "scripts", "systemd", "docs"):
        shutil.copytree(REPO / name, root / name, ignore=skip, symlinks=True)
    return root


def fresh_root(path: Path) -> Path:
    """A root like a fresh Debian with systemd: its units, root alone in /etc/passwd,
    groups root and video (not render)."""
    (path / "usr/lib/systemd").mkdir(parents=True)
    shutil.copytree(SYSTEM_UNITS, path / "usr/lib/systemd/system", symlinks=True)
    (path / "etc").mkdir()
    (path / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (path / "etc/group").write_text("root:x:0:\nvideo:x:44:\n")
    (path / "root").mkdir(mode=0o700)
    (path / "root").chmod(0o700)
    return path


def readme_install_lines() -> list[str]:
    """The commands of the README's "Install as a service" block (comments dropped)."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Install as a service", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "no bash block in the README's install section"
    lines = [x.split("#", 1)[0].strip() for x in block.group(1).splitlines()]
    return [x for x in lines if x]


def install(clone: Path, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["scripts/install-systemd.sh", *args], cwd=clone, env=env(),
                          capture_output=True, text=True, timeout=800)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 and any(marker in out for marker in UNREACHABLE):
        pytest.skip(f"the package index is unreachable: {out.strip().splitlines()[-1]}")
    return proc


def assignments(unit: Path) -> list[tuple[str, str]]:
    """Every ``Key=value`` of a unit file, in order."""
    return [(k.strip(), v.strip()) for k, v in
            (x.split("=", 1) for x in unit.read_text().splitlines()
             if "=" in x and not x.startswith(("#", ";", "[")))]


def settings(unit: Path) -> dict[str, str]:
    """A unit file's settings (the last assignment of a key wins)."""
    return dict(assignments(unit))


def verified(root: Path) -> None:
    """``systemd-analyze verify --root`` accepts the installed unit, saying nothing."""
    proc = subprocess.run(["systemd-analyze", "verify", f"--root={root}", "kvpool.service"],
                          capture_output=True, text=True, timeout=120, env=env())
    assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), proc


def installed_unit(root: Path, exe: str, protect_home: str = "yes") -> dict[str, str]:
    """The checks every install shares; returns the unit's settings."""
    unit = root / "etc/systemd/system/kvpool.service"
    s = settings(unit)
    assert s["ExecStart"] == f"{exe} {EXEC}", s["ExecStart"]
    assert os.access(root / exe.lstrip("/"), os.X_OK)
    # (a list setting: every assignment adds) the fresh root has video, not render
    assert " ".join(v for k, v in assignments(unit) if k == "SupplementaryGroups") == "video"
    assert s["ProtectHome"] == protect_home and s["User"] == s["Group"] == "kvpool"
    for url in s["Documentation"].split():
        assert url.startswith("file:///") and (root / url[len("file:///"):]).is_file(), url
    verified(root)
    users = {x.split(":")[0]: x.split(":") for x in (root / "etc/passwd").read_text().split()}
    groups = {x.split(":")[0]: x.split(":") for x in (root / "etc/group").read_text().split()}
    assert users["kvpool"][3] == groups["kvpool"][2]  # its primary group is kvpool
    state = (root / "var/lib/kvpool").stat()
    assert state.st_uid == int(users["kvpool"][2]) and stat.S_IMODE(state.st_mode) == 0o750
    wants = root / "etc/systemd/system/multi-user.target.wants/kvpool.service"
    assert wants.is_symlink() and os.readlink(wants) == "/etc/systemd/system/kvpool.service"
    return s


def steps(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return re.findall(r"^kvpool-install: (\d)/6 ", proc.stdout, re.M)


def test_readme_install_ends_with_a_unit_systemd_accepts(clone: Path, tmp_path: Path):
    python = Path("/usr/bin/python3")
    if subprocess.run([str(python), "-c", "import ensurepip, venv"], capture_output=True,
                      timeout=60).returncode != 0:
        pytest.skip(f"{python} (the script's default) has no venv module: apt-get install "
                    f"python3-venv")
    root = fresh_root(tmp_path / "root")
    lines = readme_install_lines()
    assert lines and all(x.startswith("sudo scripts/install-systemd.sh") for x in lines), lines
    for line in lines:
        proc = install(clone, *shlex.split(line)[2:], "--root", str(root))
        assert proc.returncode == 0, proc
        assert steps(proc) == ["1", "2", "3", "4", "5", "6"], proc.stdout
        assert "kvpool-install: warning" not in proc.stderr, proc.stderr  # root's alone
    installed_unit(root, "/opt/kvpool/bin/kvpool")
    config = root / "etc/kvpool/kvpool.toml"
    # the installed kvpool (not this checkout) reads the installed configuration (its
    # groups are the scratch root's, not this machine's: taken as existing)
    load = ("import sys, kvpool; from kvpool.daemon import config, config_values as v; "
            "v.group_exists = lambda name: True; c = config.Config.load(sys.argv[1]); "
            "print(kvpool.__file__, c.socket_group, c.run_dir)")
    proc = subprocess.run([str(root / "opt/kvpool/bin/python"), "-c", load, str(config)],
                          capture_output=True, text=True, timeout=60, env=env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    where, group, run_dir = proc.stdout.split()
    assert where.startswith(str(root / "opt/kvpool")) and (group, run_dir) == ("kvpool",
                                                                               "/run/kvpool")
    # a rerun (an upgrade) keeps the operator's configuration
    config.write_text(config.read_text() + "# the operator's edit\n")
    proc = install(clone, *shlex.split(lines[0])[2:], "--root", str(root))
    assert proc.returncode == 0 and "configuration /etc/kvpool/kvpool.toml: kept" in proc.stdout
    assert config.read_text().endswith("# the operator's edit\n")
    installed_unit(root, "/opt/kvpool/bin/kvpool")


def system_python() -> str | None:
    """A Python outside any venv that has pip (the system-wide install's)."""
    for py in ("/usr/bin/python3", os.path.join(sys.base_prefix, "bin", "python3")):
        if not os.access(py, os.X_OK):
            continue
        probe = subprocess.run([py, "-c", "import sys, pip; assert sys.prefix == sys.base_prefix"],
                               capture_output=True, timeout=60)
        if probe.returncode == 0:
            return py
    return None


def test_system_wide_install_runs_the_kvpool_pip_put_there(clone: Path, tmp_path: Path):
    py = system_python()
    if py is None:
        pytest.skip("no Python with pip outside a venv for a system-wide install")
    root = fresh_root(tmp_path / "root")
    proc = install(clone, "--system", "--python", py, "--root", str(root))
    assert proc.returncode == 0, proc
    assert steps(proc) == ["1", "2", "3", "4", "5", "6"], proc.stdout
    exe = settings(root / "etc/systemd/system/kvpool.service")["ExecStart"].split()[0]
    installed_unit(root, exe)
    # pip's own record of where it put the script is the ExecStart path
    records = list(root.glob("**/kvpool-*.dist-info/RECORD"))
    assert len(records) == 1, records
    entry = next(x.split(",")[0] for x in records[0].read_text().splitlines()
                 if x.split(",")[0].endswith("bin/kvpool"))
    assert (records[0].parent.parent / entry).resolve() == root / exe.lstrip("/")
    assert (root / exe.lstrip("/")).read_text().splitlines()[0] == f"#!{py}"


def test_a_venv_under_home_gets_protect_home_read_only_and_a_warning(clone: Path, tmp_path: Path):
    root = fresh_root(tmp_path / "root")
    (root / "home/ops").mkdir(parents=True, mode=0o755)
    os.chown(root / "home/ops", 65534, 65534)  # the home's owner may replace the venv
    proc = install(clone, "--venv", "/home/ops/kvpool", "--root", str(root))
    assert proc.returncode == 0, proc
    assert ("kvpool-install: warning: /home/ops (owner uid 65534, mode 755): others than "
            "root may change the code the daemon runs") in proc.stderr, proc.stderr
    installed_unit(root, "/home/ops/kvpool/bin/kvpool", protect_home="read-only")


def one_line_refusal(proc: subprocess.CompletedProcess[str], code: int) -> str:
    assert proc.returncode == code, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvpool-install: "), proc.stderr
    assert "Traceback" not in proc.stderr and not proc.stdout, proc
    return lines[0]


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if "usr/lib/systemd" not in str(p))


@pytest.mark.parametrize("args,says", [
    (["--venv", "opt/kvpool"], "an absolute path"),
    (["--venv", "/opt/kv pool"], "an absolute path"),
    (["--venv", "/opt/%n"], "an absolute path"),
    (["--venv", "/opt/../root/x"], "no . or .. components"),
    (["--venv", "/"], "an absolute path"),
    (["--venv", "/opt/x", "--system"], "exclude each other"),
    (["--bogus"], "unknown argument: --bogus"),
    (["--venv"], "--venv needs a value"),
    (["--package="], "--package needs a value"),
    (["--python", "/bin/false"], "not a Python 3.10 or later"),
    (["--root", "/nonexistent/kvpool-root"], "is not a directory"),
])
def test_bad_arguments_get_one_line_and_change_nothing(clone: Path, tmp_path: Path, args, says):
    root = fresh_root(tmp_path / "root")
    before = tree(root)
    line = one_line_refusal(install(clone, "--root", str(root), *args), 2)
    assert says in line, line
    assert tree(root) == before


def test_a_venv_the_kvpool_user_cannot_reach_is_refused_before_pip(clone: Path,
                                                                   tmp_path: Path):
    root = fresh_root(tmp_path / "root")  # /root there is 0700, as on Debian
    before = tree(root)
    line = one_line_refusal(install(clone, "--venv", "/root/kvpool", "--root", str(root)), 1)
    assert "cannot reach /root/kvpool: /root (mode 700" in line, line
    assert tree(root) == before
