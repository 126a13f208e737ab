"""Decode step time of the elastic bundled engine vs the static one, no contention.

One process builds both engines on the same tiny random Llama with the same settings;
the elastic one allocates its KV cache through a kvpool daemon (a subprocess started
here, host backend, a budget far above what the engine uses, so nothing is contended).
For each batch size, both engines get the same requests, prefill is stepped through
untimed, a few decode steps warm up (the elastic engine then has its pages mapped and
takes its fast path), and then repetitions alternate A/B/B/A (elastic, static, static,
elastic, ...) so machine noise hits both alike; each ``engine.step()`` is timed alone.

Reports the median step time of each, the ratio elastic/static per batch size and
overall (geometric mean), and the elastic allocator's slow-path calls during timing.

    python benchmarks/elastic_overhead_bench.py            # ~1 min on 2 cores
    python benchmarks/elastic_overhead_bench.py --quick    # smoke run
    python benchmarks/elastic_overhead_bench.py --backend cuda --model llama-1b \
        --dtype bfloat16 --layouts per_layer,block_major    # on a GPU (gpu_check.sh)

``--backend cuda`` runs the daemon on the CUDA backend and both engines on the GPU;
``--model`` is a preset of ``benchmarks/gpu_models.py`` (the default ``tiny`` is the
engine's own tiny checkpoint); ``--layouts`` repeats the run per KV layout. Reports
tokens/s (batch / median step time) next to the ratio.

Writes benchmarks/results/elastic_overhead_bench.json (``_cuda`` with --backend cuda;
or --out).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from common import summarize, write_result
from rich.console import Console
from rich.table import Table

from kvpool.engine import Engine, EngineConfig, SamplingParams
from kvpool.demo.cluster import Cluster
from kvpool.engine.model.tiny import make_tiny_model
from kvpool.sizes import parse_size

REPO = Path(__file__).resolve().parents[1]


def make_engines(model: Path, run_dir: Path, args: argparse.Namespace,
                 layout: str = "auto") -> dict[str, Engine]:
    from kvpool.engine_adapters.bundled import Settings, enable

    def cfg() -> EngineConfig:
        return EngineConfig(model=str(model), device=args.device, dtype=args.dtype,
                            block_size=16, kv_cache_size=args.kv_cache_size,
                            max_num_seqs=256, max_num_batched_tokens=2048,
                            max_model_len=2048, kv_layout=layout)

    elastic = cfg()
    # idle timeout far above the run: the reserve never drains between repetitions
    bridge = enable(elastic, Settings(run_dir=str(run_dir), name="bench",
                                      idle_timeout_s=3600.0))
    return {"elastic": Engine(bridge.config, bridge.seams), "static": Engine(cfg())}


def decode_samples(engines: dict[str, Engine], batch: int, args: argparse.Namespace
                   ) -> dict:
    vocab = next(iter(engines.values())).model_config.vocab_size
    rng = random.Random(batch)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
    sp = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    for eng in engines.values():
        for i, p in enumerate(prompts):
            eng.add_request(p, sp, f"b{batch}-{i}")
        while any(r.num_output_tokens == 0 for r in eng.requests.values()):
            eng.step()  # prefill, untimed
        for _ in range(args.warmup):
            eng.step()
    alloc = engines["elastic"].pool.allocator
    slow_before, grants_before = alloc.slow_allocs, alloc.grants
    samples: dict[str, list[int]] = {k: [] for k in engines}
    rep_medians: dict[str, list[float]] = {k: [] for k in engines}
    names = list(engines)
    for rep in range(args.reps):
        order = names if rep % 2 == 0 else names[::-1]  # A B | B A | A B ...
        for name in order:
            eng, xs = engines[name], []
            for _ in range(args.steps):
                t = time.perf_counter_ns()
                eng.step()
                xs.append(time.perf_counter_ns() - t)
            samples[name] += xs
            rep_medians[name].append(statistics.median(xs))
    for eng in engines.values():
        assert eng.scheduler.num_preemptions == 0 and not eng.scheduler.waiting
        assert len(eng.scheduler.running) == batch
        for rid in list(eng.requests):
            eng.abort(rid)
    paired = [e / s for e, s in zip(rep_medians["elastic"], rep_medians["static"])]
    out = {"batch": batch, **{k: summarize(v) for k, v in samples.items()},
           "paired_rep_ratio_median": statistics.median(paired),
           "elastic_slow_allocs_timed": alloc.slow_allocs - slow_before,
           "elastic_grants_timed": alloc.grants - grants_before}
    out["ratio"] = out["elastic"]["median_us"] / out["static"]["median_us"]
    out["tokens_per_s"] = {k: batch / (out[k]["median_us"] / 1e6) for k in engines}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--reps", type=int, default=30, help="A/B repetitions per batch size")
    ap.add_argument("--steps", type=int, default=20, help="timed decode steps per repetition")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--kv-cache-size", default="64MiB")
    ap.add_argument("--budget", default="1GiB")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--backend", choices=["host", "cuda"], default="host",
                    help="daemon backend; cuda also puts both engines on the GPU")
    ap.add_argument("--model", default="tiny", help="tiny or a benchmarks/gpu_models.py preset")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--layouts", default="auto", help="comma list: auto,per_layer,block_major")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.device = "cuda" if args.backend == "cuda" else "cpu"
    if args.quick:
        args.reps, args.steps, args.warmup = 4, 8, 5
    import torch

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="kvp-overhead-"))
    try:
        with Cluster(tmp / "logs") as cluster:
            cluster.daemon(parse_size(args.budget), 2 << 20, backend=args.backend)
            if args.model == "tiny":
                model = make_tiny_model(tmp / "tiny", seed=0)
            else:
                from gpu_models import make_model, model_dir

                dtype = "bfloat16" if args.dtype == "auto" else args.dtype
                model = make_model(model_dir(args.model, dtype, tmp / args.model), args.model,
                                   dtype)
            results = []
            for layout in args.layouts.split(","):
                engines = make_engines(model, cluster.run_dir, args, layout)
                for b in args.batches.split(","):
                    r = decode_samples(engines, int(b), args)
                    results.append({"layout": engines["static"].kv_spec.layout, **r})
                engines["elastic"].close()  # ends its tenant
                del engines
                gc.collect()  # the next layout's engines load the weights again
                if args.device == "cuda":
                    torch.cuda.empty_cache()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    overall = math.exp(statistics.fmean(math.log(r["ratio"]) for r in results))
    paired = math.exp(statistics.fmean(math.log(r["paired_rep_ratio_median"]) for r in results))
    table = Table(title=f"decode step time, elastic vs static (no contention; {args.model}, "
                        f"{args.device})")
    for col in ("layout", "batch", "static median ms", "elastic median ms", "elastic/static",
                "paired reps", "slow allocs", "elastic tok/s"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(r["layout"], str(r["batch"]), f"{r['static']['median_us'] / 1e3:.3f}",
                      f"{r['elastic']['median_us'] / 1e3:.3f}", f"{r['ratio']:.3f}",
                      f"{r['paired_rep_ratio_median']:.3f}", str(r["elastic_slow_allocs_timed"]),
                      f"{r['tokens_per_s']['elastic']:.0f}")
    console = Console(width=120)
    console.print(table)
    by = {(r["layout"], r["batch"]): r for r in results}
    layout_effect = {  # static step time, block_major / per_layer, per batch size
        str(b): by["block_major", b]["static"]["median_us"] / by["per_layer", b]["static"]["median_us"]
        for (lay, b) in by if lay == "per_layer" and ("block_major", b) in by}
    if layout_effect:
        console.print("static step time block_major / per_layer: " + ", ".join(
            f"batch {b}: {v:.3f}" for b, v in layout_effect.items()))
    payload = {"params": {k: v for k, v in vars(args).items() if k != "out"},
               "results": results, "overall_ratio_geomean": overall,
               "overall_paired_ratio_geomean": paired, "load_avg_at_end": os.getloadavg(),
               "layout_effect_block_major_over_per_layer": layout_effect,
               "within_3_percent": overall <= 1.03 and all(r["ratio"] <= 1.03 for r in results)}
    name = "elastic_overhead_bench" + ("_cuda" if args.backend == "cuda" else "")
    path = write_result(name, payload, args.out)
    console.print(f"overall elastic/static {overall:.3f} (paired reps {paired:.3f}) -> {path}")


if __name__ == "__main__":
    main()
