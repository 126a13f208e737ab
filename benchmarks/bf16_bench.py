"""bfloat16 vs float32 on CPU in the bundled engine (issue 21 item 3).

A SmolLM2-shaped random Llama (hidden 576, 9 heads / 3 KV heads, intermediate 1536,
``--layers`` layers, vocab 8,192) runs three workloads in three configurations, interleaved
(every repetition runs each configuration once, in turn), ``--reps`` repetitions, median
reported:

* ``fp32``: float32, native kernels + oneDNN-prepacked GEMMs (the default on CPU);
* ``bf16``: ``--dtype bfloat16``, the native kernels' bf16 variants (this issue);
* ``bf16-torch``: bfloat16 with ``attention_backend="torch"`` and the native ops off, i.e.
  what ``--dtype bfloat16`` ran before: gather + SDPA and torch's bf16 ops everywhere.

Workloads: decode with 1 and with 16 sequences (tokens/s = sequences / time per output
token) and prefill of 4 x 256-token prompts (prompt tokens/s). Also the bytes of a KV
block and of the weights, and a per-GEMM table (fp32 prepacked vs the native bf16 GEMM vs
torch's bf16 GEMM), since the GEMM is where bf16 costs on a CPU without bf16 instructions.

    python benchmarks/bf16_bench.py --threads 1   # ~5 min on 2 busy cores
    python benchmarks/bf16_bench.py --quick    # smoke run

Writes benchmarks/results/bf16_bench.json (or --out).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from common import write_result
from rich.console import Console
from rich.table import Table

from kvpool.engine import LLM, SamplingParams

from kvpool.engine.model import fused

from kvpool.engine.model import native
from kvpool.engine.model.tiny import make_tiny_model

CONFIGS = ("fp32", "bf16", "bf16-torch")


@contextlib.contextmanager
def torch_ops_only() -> Iterator[None]:
    """The engine as it ran bf16 before the native bf16 kernels: every fused op on torch."""
    with mock.patch.object(fused, "_native", lambda x, name: None), \
            mock.patch.object(fused, "_linear_bf16", lambda mod, x: None):
        yield


def make_llm(path: Path, config: str) -> LLM:
    kw: dict[str, Any] = dict(num_kv_blocks=512, max_num_batched_tokens=1024,
                              enable_prefix_caching=False)
    if config == "fp32":
        return LLM(str(path), dtype="float32", **kw)
    if config == "bf16":
        return LLM(str(path), dtype="bfloat16", **kw)
    return LLM(str(path), dtype="bfloat16", attention_backend="torch", **kw)


def run_workload(llm: LLM, config: str, name: str, quick: bool) -> float:
    """Tokens/s of one workload run."""
    g = torch.Generator().manual_seed(7)
    ctx = torch_ops_only() if config == "bf16-torch" else contextlib.nullcontext()
    with ctx:
        if name.startswith("decode"):
            n = int(name.split("x")[1])
            ps = [torch.randint(3, 8192, (64,), generator=g).tolist() for _ in range(n)]
            new = 8 if quick else 32
            outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=new,
                                                   ignore_eos=True))
            tpot = statistics.median(o.tpot for o in outs if o.tpot is not None)
            return n / tpot
        ps = [torch.randint(3, 8192, (64 if quick else 256,), generator=g).tolist()
              for _ in range(4)]
        t0 = time.perf_counter()
        llm.generate(ps, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        return sum(len(p) for p in ps) / (time.perf_counter() - t0)


def gemm_table(reps: int) -> list[dict[str, Any]]:
    """ms per GEMM for the model's shapes: fp32 via fused.linear (prepacked), bf16 via
    fused.linear (native), bf16 via F.linear (torch)."""
    rows = []
    for n, k, label in ((1536 * 2, 576, "gate_up"), (576, 1536, "down"),
                        (8192, 576, "lm_head")):
        l32 = torch.nn.Linear(k, n, bias=False)
        fused.prepack(l32)
        l16 = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16)
        for m in (1, 16, 256):
            x32 = torch.randn(m, k)
            x16 = x32.bfloat16()
            fns = {"fp32": lambda: fused.linear(l32, x32),
                   "bf16": lambda: fused.linear(l16, x16),
                   "bf16-torch": lambda: F.linear(x16, l16.weight)}
            times: dict[str, list[float]] = {c: [] for c in fns}
            inner = max(1, int(2e7 / (n * k * max(m, 4))))
            for f in fns.values():
                f()
            for _ in range(reps):
                for c, f in fns.items():
                    t0 = time.perf_counter()
                    for _ in range(inner):
                        f()
                    times[c].append((time.perf_counter() - t0) / inner * 1e3)
            rows.append({"gemm": label, "n": n, "k": k, "m": m,
                         **{f"{c}_ms": statistics.median(v) for c, v in times.items()}})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch/OpenMP threads (0: torch's default); 1 is steadier on a "
                         "shared machine")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    assert native.load() is not None, native.error()
    console = Console()
    workloads = ("decode x1", "decode x16", "prefill 4x256")
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(Path(tmp) / "m", layers=args.layers, hidden=576, heads=9,
                               kv_heads=3, intermediate=1536, vocab=8192, seed=0)
        llms = {c: make_llm(path, c) for c in CONFIGS}
        mem = {c: {"kv_block_bytes": llms[c].engine.kv_spec.block_bytes,
                   "weight_bytes": sum(p.numel() * p.element_size()
                                       for p in llms[c].engine.model.parameters()),
                   "attention_backend": llms[c].engine.runner.backend} for c in CONFIGS}
        for c in CONFIGS:  # warm-up (kernel build, allocator)
            run_workload(llms[c], c, "decode x1", True)
        samples: dict[str, dict[str, list[float]]] = {w: {c: [] for c in CONFIGS}
                                                      for w in workloads}
        for rep in range(args.reps):
            for w in workloads:
                for c in CONFIGS:
                    samples[w][c].append(run_workload(llms[c], c, w, args.quick))
            console.print(f"rep {rep + 1}/{args.reps} done")
    rows = []
    for w in workloads:
        med = {c: statistics.median(samples[w][c]) for c in CONFIGS}
        rows.append({"workload": w, **{f"{c}_tok_s": med[c] for c in CONFIGS},
                     "bf16_vs_fp32": med["bf16"] / med["fp32"],
                     "bf16_vs_bf16_torch": med["bf16"] / med["bf16-torch"],
                     "samples": samples[w]})
    t = Table(title=f"tok/s, median of {args.reps} interleaved reps ({args.layers} layers, "
                    f"{torch.get_num_threads()} threads)")
    for col in ("workload", *CONFIGS, "bf16/fp32", "bf16/bf16-torch"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["workload"], *(f"{r[f'{c}_tok_s']:.1f}" for c in CONFIGS),
                  f"{r['bf16_vs_fp32']:.2f}", f"{r['bf16_vs_bf16_torch']:.2f}")
    console.print(t)
    m = Table(title="bytes")
    for col in ("config", "KV block (all layers)", "weights", "attention"):
        m.add_column(col, justify="right")
    for c in CONFIGS:
        m.add_row(c, str(mem[c]["kv_block_bytes"]), str(mem[c]["weight_bytes"]),
                  str(mem[c]["attention_backend"]))
    console.print(m)
    gemms = gemm_table(1 if args.quick else args.reps)
    gt = Table(title="GEMM ms (median)")
    for col in ("gemm", "M", "fp32 (prepacked)", "bf16 native", "bf16 torch"):
        gt.add_column(col, justify="right")
    for g in gemms:
        gt.add_row(f"{g['gemm']} {g['n']}x{g['k']}", str(g["m"]), f"{g['fp32_ms']:.3f}",
                   f"{g['bf16_ms']:.3f}", f"{g['bf16-torch_ms']:.3f}")
    console.print(gt)
    path_out = write_result("bf16_bench", {
        "model": {"layers": args.layers, "hidden": 576, "heads": 9, "kv_heads": 3,
                  "intermediate": 1536, "vocab": 8192},
        "reps": args.reps, "threads": torch.get_num_threads(), "quick": args.quick,
        "workloads": rows, "memory": mem, "gemm_ms": gemms}, args.out)
    console.print(f"wrote {path_out}")


if __name__ == "__main__":
    main()
