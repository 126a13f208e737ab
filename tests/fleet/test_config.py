"""Fleet files that are wrong (issue 23, "Bad input and failure"): every bad value is one
line ``FILE: models[i].key: why`` on stderr, exit 2, no traceback, before anything
starts (``kvpool fleet`` run in-process: nothing here starts a process)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvpool.cli.main import cli
from kvpool.fleet.config import FleetConfigError, load

GOOD = """
[fleet]
name = "demo"
[[models]]
name = "alpha"
checkpoint = "alpha"
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with a tiny checkpoint ``alpha``, a folder ``empty`` and ``badjson``."""
    from kvpool.engine.model.tiny import make_tiny_model

    d = tmp_path_factory.mktemp("fleetcfg")
    make_tiny_model(d / "alpha", layers=1, hidden=64, heads=2, kv_heads=1, vocab=512)
    (d / "empty").mkdir()
    (d / "badjson").mkdir()
    (d / "badjson" / "config.json").write_text("{not json")
    return d


def run(folder: Path, text: str, *args: str) -> tuple[int, list[str], str]:
    f = folder / "fleet.toml"
    f.write_text(text)
    r = CliRunner().invoke(cli, ["fleet", str(f), *args])
    return r.exit_code, r.stderr.splitlines(), r.output


def test_a_good_file_loads(folder: Path) -> None:
    f = folder / "good.toml"
    f.write_text(GOOD + 'max = "64MiB"\nsleep_after = 2\nargs = ["--max-model-len", "256"]\n')
    c = load(f)
    (e,) = c.models
    assert (c.name, c.port, c.queue, e.name, e.max, e.sleep_after, e.weights) == \
        ("demo", 8080, 64, "alpha", 64 << 20, 2.0, "pool")
    assert e.checkpoint == (folder / "alpha").resolve() and e.args == ("--max-model-len", "256")
    assert [e.tenant(i) for i in range(3)] == ["alpha", "alpha-1", "alpha-2"]


BAD = [
    # (what is appended to GOOD / replaces it, the key named, a piece of the reason)
    ("wieght = 2\n", "models[0].wieght", "unknown key"),
    ("[fleat]\nname = 'x'\n", "fleat", "unknown key"),
    ("max = \"lots\"\n", "models[0].max", "cannot parse size"),
    ("min = \"30%\"\n", "models[0].min", "percentage"),
    ("replicas = true\n", "models[0].replicas", "expected an integer"),
    ("replicas = 0\n", "models[0].replicas", "out of range"),
    ("shares = 0\n", "models[0].shares", "out of range"),
    ("shares = 1\nweight = 2\n", "models[0].weight", "shares and weight are both given: weight "
     "is the old name of shares; give shares only"),
    ("sleep_after = -1\n", "models[0].sleep_after", "out of range"),
    ("sleep_after = nan\n", "models[0].sleep_after", "out of range"),
    ("routing = \"random\"\n", "models[0].routing", "least_loaded"),
    ("engine = \"tgi\"\n", "models[0].engine", "bundled, vllm"),
    ("weights = \"disk\"\n", "models[0].weights", "pool, local"),
    ("args = [\"--port\", \"9\"]\n", "models[0].args", "set by the fleet"),
    ("args = [1]\n", "models[0].args", "expected a string"),
    ("kv_cache_size = 0\n", "models[0].kv_cache_size", "more than 0"),
    ("[[models]]\nname = \"alpha\"\ncheckpoint = \"alpha\"\n", "models[1].name",
     "'alpha' is also models[0]'s name"),
    ("[[models]]\nname = \"alpha-1\"\ncheckpoint = \"alpha\"\n[[models]]\nname = \"b\"\n"
     "checkpoint = \"alpha\"\nreplicas = 1\n", None, None),  # (valid: alpha has 1 replica)
    ("replicas = 2\n[[models]]\nname = \"alpha-1\"\ncheckpoint = \"alpha\"\n", "models[1].name",
     "tenant 'alpha-1' is also models[0]"),
    ("[[models]]\nname = \"a b\"\ncheckpoint = \"alpha\"\n", "models[1].name",
     "not a tenant name"),
    ("[[models]]\nname = \"beta\"\ncheckpoint = \"missing\"\n", "models[1].checkpoint",
     "not a folder"),
    ("[[models]]\nname = \"beta\"\ncheckpoint = \"empty\"\n", "models[1].checkpoint",
     "no config.json"),
    ("[[models]]\nname = \"beta\"\ncheckpoint = \"badjson\"\n", "models[1].checkpoint",
     "not valid JSON"),
    ("[[models]]\nname = \"beta\"\n", "models[1].checkpoint", "missing"),
]


@pytest.mark.parametrize("extra,key,why", BAD)
def test_each_bad_value_is_one_line_exit_2(folder: Path, extra: str, key: str | None,
                                           why: str | None) -> None:
    f = folder / "fleet.toml"
    f.write_text(GOOD + extra)
    if key is None:
        load(f)  # a control case: this one is fine
        return
    code, lines, out = run(folder, GOOD + extra)
    assert code == 2, out
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{f}: {key}: ") and why in lines[0], lines
    assert "Traceback" not in out


@pytest.mark.parametrize("text,key,why", [
    ("[fleet]\nport = 70000\n[[models]]\nname = 'a'\ncheckpoint = 'alpha'\n", "fleet.port",
     "out of range"),
    ("[fleet]\nqueue = 0\nname = 'x'\n[[models]]\nname = 'a'\ncheckpoint = 'alpha'\n",
     "fleet.queue", "out of range"),
    ("[fleet]\nname = 'two words'\n[[models]]\nname = 'a'\ncheckpoint = 'alpha'\n",
     "fleet.name", "not a tenant group name"),
    ("[fleet]\nname = 'x'\n", "models", "no [[models]] entry"),
    ("[fleet\nname = 'x'\n", "", "not valid TOML"),
    ("[daemon]\npage_size = \"3KiB\"\n" + GOOD, "daemon.page_size", "power of two"),
    ("[fleet]\nname = 'x'\nhung_after_s = 0\n[[models]]\nname = 'a'\ncheckpoint = 'alpha'\n",
     "fleet.hung_after_s", "out of range"),
    ("[fleet]\nname = 'x'\nhung_after_s = 60\nhung_restart_s = 30\n[[models]]\nname = 'a'"
     "\ncheckpoint = 'alpha'\n", "fleet.hung_restart_s", "less than hung_after_s"),
])
def test_fleet_and_daemon_tables(folder: Path, text: str, key: str, why: str) -> None:
    code, lines, out = run(folder, text)
    assert code == 2 and len(lines) == 1 and why in lines[0], out
    assert lines[0].startswith(f"{folder / 'fleet.toml'}: {key}"), lines


def test_every_problem_gets_its_line(folder: Path) -> None:
    code, lines, out = run(folder, GOOD + "max = \"lots\"\nreplicas = 0\nshares = -1\n")
    assert code == 2 and len(lines) == 3, out
    assert [x.split(": ")[1] for x in lines] == \
        ["models[0].replicas", "models[0].max", "models[0].shares"]


def test_shares_and_the_old_weight_key(folder: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    """``shares`` is a model's part of contended memory, passed to its servers as
    ``KVPOOL_SHARES`` (an inherited ``KVPOOL_WEIGHT``, its old name, is not passed on);
    ``weight``, the old key, is read as ``shares`` for one release with one line."""
    from kvpool.fleet.engines import MemberSpec, member_env

    f = folder / "shares.toml"
    f.write_text(GOOD + "shares = 3\n")
    (e,) = load(f).models
    assert e.shares == 3.0 and capsys.readouterr().err == ""
    env = member_env(MemberSpec(entry=e, tenant="alpha", group="demo", run_dir=folder,
                                base_env={"KVPOOL_WEIGHT": "9", "PATH": "/bin"}), {})
    assert env["KVPOOL_SHARES"] == "3.0" and "KVPOOL_WEIGHT" not in env
    f.write_text(GOOD + "weight = 2\n")
    (e,) = load(f).models
    assert e.shares == 2.0
    assert capsys.readouterr().err.splitlines() == [
        f"kvpool: {f}: models[0].weight is deprecated, use shares (removed in the next "
        "release)"]


def test_a_missing_file_is_one_line(folder: Path) -> None:
    r = CliRunner().invoke(cli, ["fleet", str(folder / "nope.toml")])
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1, r.output
    assert "No such file" in r.stderr and "Traceback" not in r.output


def test_with_daemon_the_budget_must_hold_the_largest_model(folder: Path) -> None:
    text = "[daemon]\nbudget = \"64KiB\"\npage_size = \"64KiB\"\n" + GOOD
    f = folder / "fleet.toml"
    f.write_text(text)
    load(f)  # without --with-daemon the running daemon's budget is its own business
    code, lines, out = run(folder, text, "--with-daemon")
    assert code == 2 and len(lines) == 1, out
    assert lines[0].startswith(f"{f}: daemon.budget: 64 KiB cannot hold the largest model "
                               f"(alpha: "), lines
    # local weights: one KV chunk is all the budget must hold
    load(f.parent / "fleet.toml", with_daemon=False)
    f.write_text(text + "weights = \"local\"\n")
    assert load(f, with_daemon=True).models[0].weights == "local"
    f.write_text(text.replace("64KiB\"\npage", "1MiB\"\npage"))
    assert load(f, with_daemon=True).models  # ~0.4 MiB of float32 weights and a chunk fit


def test_auto_on_a_cpu_host_sizes_weights_as_the_host_backend(
        folder: Path, tmp_path: Path) -> None:
    """``backend = "auto"`` on a host without a usable GPU is the host backend: a bundled
    server there holds float32 weights, so a 16-bit checkpoint's weights count double in
    the ``--with-daemon`` budget check, exactly as with ``backend = "host"``."""
    from safetensors.torch import load_file, save_file

    from kvpool.vmm import cuda_available

    if cuda_available():
        pytest.skip("a usable GPU: auto is the cuda backend here")
    half = tmp_path / "half"
    shutil.copytree(folder / "alpha", half)
    tensors = load_file(str(half / "model.safetensors"))
    save_file({k: v.bfloat16() for k, v in tensors.items()}, str(half / "model.safetensors"))
    config = json.loads((half / "config.json").read_text())
    config.update(dtype="bfloat16", torch_dtype="bfloat16")
    (half / "config.json").write_text(json.dumps(config))
    lines = {}
    for backend in ("host", "auto"):
        f = tmp_path / f"{backend}.toml"
        f.write_text(f'[daemon]\nbudget = "64KiB"\npage_size = "64KiB"\nbackend = "{backend}"\n'
                     f'[[models]]\nname = "alpha"\ncheckpoint = "{half}"\n')
        with pytest.raises(FleetConfigError) as e:
            load(f, with_daemon=True)
        (lines[backend],) = [p.split(": ", 1)[1] for p in e.value.problems]
    assert lines["auto"] == lines["host"]
    assert "daemon.budget: 64 KiB cannot hold the largest model" in lines["auto"]


def test_without_a_daemon_it_says_so(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_RUN_DIR", str(folder / "no-daemon"))
    f = folder / "fleet.toml"
    f.write_text(GOOD)
    r = CliRunner().invoke(cli, ["fleet", str(f), "--port", "0"])
    assert r.exit_code == 1 and len(r.stderr.splitlines()) == 1, r.output
    assert "no kvpool daemon serves at" in r.stderr and "--with-daemon" in r.stderr


def test_with_daemon_a_vllm_member_needs_its_own_kv_unit(folder: Path) -> None:
    """vLLM's KV unit (the plugin's, vllm/kv_units.py: two blocks of 128 tokens on the
    CPU) is what its member needs at start, not the bundled engine's 16-token chunk: a
    budget between the two is refused with one line instead of a member dying at start."""
    daemon = "[daemon]\nbudget = \"48KiB\"\npage_size = \"16KiB\"\n"
    local = GOOD + "weights = \"local\"\n"
    f = folder / "fleet.toml"
    f.write_text(daemon + local)
    assert load(f, with_daemon=True).models  # bundled: one 16 KiB chunk fits
    vllm = daemon + GOOD + "engine = \"vllm\"\n"
    code, lines, out = run(folder, vllm, "--with-daemon")
    assert code == 2 and len(lines) == 1, out
    # alpha: 1 layer x K,V x 128 tokens x 1 head x 32 x float32 = 32 KiB a block, two
    assert lines[0] == (f"{f}: daemon.budget: 48 KiB cannot hold the largest model (alpha: "
                        f"0 B of weights in the pool plus one KV chunk of 64 KiB)"), lines
    f.write_text(vllm + "args = [\"--block-size\", \"32\"]\n")  # 8 KiB blocks: it fits
    assert load(f, with_daemon=True).models
