"""vLLM elastic (KVPOOL_ENABLE=1) vs vLLM static: decode step time and throughput.

Same tiny Llama, same workload, one run: a static server (``--kv-cache-memory-bytes``
equal to the daemon's budget) and an elastic one on a kvpool daemon with that budget,
measured in interleaved repetitions (the order alternates every repetition, one server
busy at a time). Decode step time is a streamed request's time between its first and
last token divided by the tokens in between; throughput is all completion tokens over the
wall time of a repetition. Prints a table and writes benchmarks/results/vllm_overhead_bench.json
with the ratios elastic / static (goal: decode step <= 1.03x).

    python benchmarks/vllm_overhead_bench.py --reps 6 --requests 8 --tokens 128
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


def one_rep(base: str, model: str, n: int, tokens: int) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as ex:
        res = list(ex.map(lambda i: stream_one(base, model, PROMPTS[i % len(PROMPTS)] +
                                                f" {i}", tokens), range(n)))
    wall = time.perf_counter() - t0
    return {"step_s": statistics.median(r[0] for r in res),
            "tok_per_s": sum(r[1] for r in res) / wall,
            "ttft_s": statistics.median(r[2] for r in res)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--budget", default="64MiB")
    ap.add_argument("--page-size", type=int, default=2 << 20)
    ap.add_argument("--idle-timeout", type=float, default=60.0,
                    help="KVPOOL_IDLE_TIMEOUT of the elastic server")
    ap.add_argument("--out")
    a = ap.parse_args()

    from kvpool.engine.tiny import make_tiny_model
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
        for s in (static, elastic):  # warm-up
            one_rep(s.base, s.name, 2, 16)
        runs: dict[str, list[dict]] = {"static": [], "elastic": []}
        load_before = os.getloadavg()
        for rep in range(a.reps):
            order = (static, elastic) if rep % 2 == 0 else (elastic, static)
            for s in order:
                runs[s.name].append(one_rep(s.base, s.name, a.requests, a.tokens))
        summary = {}
        for name, xs in runs.items():
            summary[name] = {"step_ms_median": 1e3 * statistics.median(x["step_s"] for x in xs),
                             "tok_per_s_median": statistics.median(x["tok_per_s"] for x in xs),
                             "ttft_ms_median": 1e3 * statistics.median(x["ttft_s"] for x in xs)}
        ratio_step = summary["elastic"]["step_ms_median"] / summary["static"]["step_ms_median"]
        ratio_tput = summary["elastic"]["tok_per_s_median"] / summary["static"][
            "tok_per_s_median"]
        # Paired: each repetition's two runs are adjacent in time (noise shared).
        paired_step = statistics.median(e["step_s"] / s_["step_s"] for e, s_ in
                                        zip(runs["elastic"], runs["static"]))
        paired_tput = statistics.median(e["tok_per_s"] / s_["tok_per_s"] for e, s_ in
                                        zip(runs["elastic"], runs["static"]))
        pairs = sorted(e["step_s"] / s_["step_s"] for e, s_ in
                       zip(runs["elastic"], runs["static"]))
        q1, _, q3 = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else (pairs * 3)
        load = {"before": load_before, "after": os.getloadavg()}
        print(f"{'server':8} {'decode step ms':>15} {'tokens/s':>10} {'TTFT ms':>9}")
        for name, v in summary.items():
            print(f"{name:8} {v['step_ms_median']:15.2f} {v['tok_per_s_median']:10.1f} "
                  f"{v['ttft_ms_median']:9.1f}")
        print(f"elastic / static: decode step {ratio_step:.3f}x (goal <= 1.03x), "
              f"throughput {ratio_tput:.3f}x; paired medians {paired_step:.3f}x / "
              f"{paired_tput:.3f}x (paired step ratios: quartiles {q1:.3f} .. {q3:.3f}); "
              f"load average {load['before'][0]:.1f} -> {load['after'][0]:.1f}")
        path = write_result("vllm_overhead_bench", {
            "params": vars(a), "runs": runs, "summary": summary,
            "ratio_decode_step_elastic_over_static": ratio_step,
            "ratio_throughput_elastic_over_static": ratio_tput,
            "paired_median_decode_step_ratio": paired_step,
            "paired_median_throughput_ratio": paired_tput,
            "paired_decode_step_ratio_quartiles": [q1, q3],
            "load_average_1_5_15": load,
            "goal_decode_step_ratio": 1.03,
        }, a.out)
        print(f"wrote {path}")
    finally:
        servers.close()
        remove_daemon(daemon)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
