"""vLLM elastic (KVPOOL_ENABLE=1) vs vLLM static: decode step time and throughput.

Same tiny Llama, same workload, one run: a static server (``--kv-cache-memory-bytes``
equal to the daemon's budget) and an elastic one on a kvpool daemon with that budget,
measured in interleaved repetitions (the order alternates every repetition, one server
busy at a time). Decode step time is the engine's mean inter-token latency over the
repetition (vLLM's ``inter_token_latency_seconds`` histogram, engine-core timestamps); the
client's view (a streamed request's time from first to last token per token) is kept
beside it, with time to first token, throughput (all completion tokens over the wall time
of a repetition) and the server processes' CPU time per token (the least sensitive to other
load on a shared machine). Prints a table and writes
benchmarks/results/vllm_overhead_bench.json with the ratios elastic / static, of the
medians and paired per repetition (goal: decode step <= 1.03x).

    python benchmarks/vllm_overhead_bench.py --reps 40 --requests 8 --tokens 128
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "benchmarks")]

from adapters.vllm_procs import (  # noqa: E402
    PROMPTS,
    VllmServers,
    remove_daemon,
    start_daemon,
)
from common import write_result  # noqa: E402


def stream_one(base: str, model: str, prompt: str, tokens: int) -> tuple[float, int, float]:
    """(seconds per decode step, completion tokens, seconds to the first token) of one
    streamed greedy request."""
    from openai import OpenAI

    c = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=600, max_retries=0)
    t0 = time.perf_counter()
    stamps = []
    for chunk in c.completions.create(model=model, prompt=prompt, max_tokens=tokens,
                                      temperature=0, stream=True,
                                      extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
    steps = len(stamps) - 1
    return ((stamps[-1] - stamps[0]) / steps if steps > 0 else float("nan")), tokens, \
        stamps[0] - t0


def engine_itl(base: str) -> tuple[float, float]:
    """(sum, count) of vLLM's ``inter_token_latency_seconds`` histogram: the engine core's
    own timestamps of consecutive tokens, so HTTP streaming does not blur them."""
    import httpx

    total = count = 0.0
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:inter_token_latency_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:inter_token_latency_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a server's process tree (API server, engine core)."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def one_rep(server, n: int, tokens: int) -> dict:
    base, model = server.base, server.name
    itl0, cpu0 = engine_itl(base), cpu_seconds(server.proc.pid)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as ex:
        res = list(ex.map(lambda i: stream_one(base, model, PROMPTS[i % len(PROMPTS)] +
                                                f" {i}", tokens), range(n)))
    wall = time.perf_counter() - t0
    itl1, cpu1 = engine_itl(base), cpu_seconds(server.proc.pid)
    done = sum(r[1] for r in res)
    return {"engine_step_s": (itl1[0] - itl0[0]) / max(1.0, itl1[1] - itl0[1]),
            "step_s": statistics.median(r[0] for r in res),
            "tok_per_s": done / wall,
            "ttft_s": statistics.median(r[2] for r in res),
            "cpu_per_token_s": (cpu1 - cpu0) / done}


METRICS = {  # key in a repetition -> (what, higher is better)
    "engine_step_s": ("decode step, engine (inter-token latency)", False),
    "step_s": ("decode step, client (streamed chunks)", False),
    "tok_per_s": ("throughput", True),
    "ttft_s": ("time to first token", False),
    "cpu_per_token_s": ("server CPU time per token", False),
}


def compare(runs: dict[str, list[dict]]) -> dict:
    """Per metric: medians, ratio of medians (elastic / static), the median and quartiles
    of the per-repetition ratios (each repetition's two runs are adjacent in time)."""
    out = {}
    for key in METRICS:
        e = [x[key] for x in runs["elastic"]]
        s_ = [x[key] for x in runs["static"]]
        pairs = sorted(a / b for a, b in zip(e, s_))
        q1, _, q3 = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else pairs * 3
        out[key] = {"static_median": statistics.median(s_),
                    "elastic_median": statistics.median(e),
                    "ratio_of_medians": statistics.median(e) / statistics.median(s_),
                    "paired_median": statistics.median(pairs), "paired_quartiles": [q1, q3]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--budget", default="64MiB")
    ap.add_argument("--page-size", type=int, default=2 << 20)
    ap.add_argument("--idle-timeout", type=float, default=60.0,
                    help="KVPOOL_IDLE_TIMEOUT of the elastic server")
    ap.add_argument("--warmup-max", type=int, default=30,
                    help="warm-up repetitions at most (until the elastic mapping is stable)")
    ap.add_argument("--out")
    a = ap.parse_args()

    from kvpool.engine.model.tiny import make_tiny_model
    from kvpool.sizes import parse_size

    work = Path(tempfile.mkdtemp(prefix="vllm-bench-"))
    model = make_tiny_model(work / "tiny-llama", layers=4, hidden=256, heads=8, kv_heads=4,
                            vocab=512, seed=0)
    daemon = start_daemon(a.budget, a.page_size)
    servers = VllmServers(model, work)
    try:
        # Both on vLLM's uniprocess executor (what KVPOOL_ENABLE=1 runs on CPU), so the
        # two differ only in where the KV memory comes from.
        # A long idle timeout: the elastic server keeps its pages while the static one
        # runs its repetition (this measures the steady-state cost, not re-granting).
        uni = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "KVPOOL_IDLE_TIMEOUT": str(a.idle_timeout)}
        static = servers.start("static", None, ("--kv-cache-memory-bytes",
                                                str(parse_size(a.budget))),
                               VLLM_CPU_KVCACHE_SPACE=None, **uni)
        elastic = servers.start("elastic", daemon.run_dir, **uni)
        servers.wait_healthy()
        # Warm-up to the steady state both are measured in: the static server zeroed its
        # whole KV cache at start; the elastic one maps chunks as its prefix cache grows
        # (it keeps cached blocks while memory is free), so repeat the workload on both
        # until the elastic tenant's mapping stops growing.
        mapped, warmup = [], 0
        while warmup < a.warmup_max:
            for s in (static, elastic):
                one_rep(s, a.requests, a.tokens)
            warmup += 1
            mapped.append((daemon.tenant("elastic") or {}).get("mapped", 0))
            if mapped[-1] >= parse_size(a.budget) or (  # it grows a chunk every ~2 reps
                    len(mapped) >= 5 and mapped[-1] == mapped[-5]):
                break
        print(f"warm-up: {warmup} repetitions each; elastic maps {mapped[-1]} B", flush=True)
        runs: dict[str, list[dict]] = {"static": [], "elastic": []}
        load_before = os.getloadavg()
        for rep in range(a.reps):
            order = (static, elastic) if rep % 2 == 0 else (elastic, static)
            for s in order:
                runs[s.name].append(one_rep(s, a.requests, a.tokens))
        load = {"before": load_before, "after": os.getloadavg()}
        cmp = compare(runs)
        print(f"{'elastic / static':42} {'static':>10} {'elastic':>10} {'ratio':>7} "
              f"{'paired':>7} {'paired quartiles':>17}")
        for key, (what, _) in METRICS.items():
            c = cmp[key]
            scale = 1.0 if key == "tok_per_s" else 1e3  # seconds -> ms
            print(f"{what:42} {c['static_median'] * scale:10.3f} "
                  f"{c['elastic_median'] * scale:10.3f} {c['ratio_of_medians']:7.3f} "
                  f"{c['paired_median']:7.3f} {c['paired_quartiles'][0]:8.3f}.."
                  f"{c['paired_quartiles'][1]:.3f}")
        step = cmp["engine_step_s"]
        print(f"decode step elastic / static: {step['ratio_of_medians']:.3f}x (paired "
              f"{step['paired_median']:.3f}x; goal <= 1.03x); load average "
              f"{load['before'][0]:.1f} -> {load['after'][0]:.1f} on {os.cpu_count()} CPUs")
        path = write_result("vllm_overhead_bench", {
            "params": vars(a), "runs": runs, "comparison": cmp,
            "ratio_decode_step_elastic_over_static": step["ratio_of_medians"],
            "paired_median_decode_step_ratio": step["paired_median"],
            "ratio_throughput_elastic_over_static": cmp["tok_per_s"]["ratio_of_medians"],
            "paired_median_throughput_ratio": cmp["tok_per_s"]["paired_median"],
            "goal_decode_step_ratio": 1.03,
            "warmup_reps": warmup, "elastic_mapped_bytes_after_warmup": mapped,
            "load_average_1_5_15": load,
        }, a.out)
        print(f"wrote {path}")
    finally:
        servers.close()
        remove_daemon(daemon)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
