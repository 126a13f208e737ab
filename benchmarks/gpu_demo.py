"""A shortened ``kvpool demo`` with realistic models: static ÷ elastic TTFT on one device.

    python benchmarks/gpu_demo.py --backend cuda     # gpu_check.sh step: three 1.1B bf16
                                                     # Llamas on the GPU, KV memory binding
    python benchmarks/gpu_demo.py --backend host --model tiny --duration 6   # CPU smoke run

The three models share one random checkpoint (``benchmarks/gpu_models.py``; the demo's
model folders are links to it, so it is written and read from disk once). The budget is
``--budget-tokens`` tokens of KV for all models together, so a static third holds a few
of the workload's long requests (prompt + answer up to 640 tokens) and a burst needs
more: KV memory, not compute, binds.

* cuda (default 8192 tokens, 2 MiB pages): the engines' per-layer layout maps a unit of
  one page in each of the 2 x 16 K/V buffers, 64 MiB = 1024 tokens of the 1.1B model; 8
  units = 512 MiB: a static third holds ~6 requests, a burst borrows up to 6 units (~13
  requests; each idle model keeps at least one unit);
* host (default 2048 tokens, 64 KiB pages): the CPU demo's own 2 MiB budget.

Runs ``kvpool demo`` (the CLI, both modes), then writes
benchmarks/results/demo_<backend>.json: the demo's summary and TTFT p99 / mean / p50
static ÷ elastic.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import write_result  # noqa: E402
from gpu_models import kv_bytes_per_token, make_model, model_dir  # noqa: E402

MODELS = ("alpha", "beta", "gamma")  # the demo's DemoConfig.models


def prepare(out: Path, preset: str, dtype: str) -> None:
    """One checkpoint; each model folder of the demo links to it."""
    src = make_model(model_dir(preset, dtype, out / "checkpoint"), preset, dtype)
    models = out / "models"
    models.mkdir(parents=True, exist_ok=True)
    for name in MODELS:
        link = models / name
        if not link.exists():
            link.symlink_to(src.resolve(), target_is_directory=True)


def ratios(result: dict) -> dict:
    s, e = result["summary"]["static"]["all"], result["summary"]["elastic"]["all"]
    out = {}
    for key in ("ttft_p99", "ttft_mean", "ttft_p50"):
        if s.get(key) and e.get(key):
            out[f"{key}_static_over_elastic"] = s[key] / e[key]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["host", "cuda"], default="cuda")
    ap.add_argument("--model", default="llama-1b", help="a benchmarks/gpu_models.py preset")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on host")
    ap.add_argument("--budget-tokens", type=int, default=None,
                    help="KV tokens for all models (default 8192 on cuda, 2048 on host)")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of workload per mode")
    ap.add_argument("--workdir", default=None, help="models, logs (default: a temp dir)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = args.dtype or ("bfloat16" if args.backend == "cuda" else "float32")
    per_token = kv_bytes_per_token(args.model, 2 if dtype in ("bfloat16", "float16") else 4)
    cuda = args.backend == "cuda"
    page = 2 << 20 if cuda else 64 << 10
    tokens = args.budget_tokens or (8192 if cuda else 2048)
    budget = -(-tokens * per_token // page) * page
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvp-gpudemo-"))
    prepare(work, args.model, dtype)
    cmd = [sys.executable, "-m", "kvpool.cli.main", "demo", "--backend", args.backend,
           "--out", str(work), "--budget", str(budget), "--page-size", str(page),
           "--duration", str(args.duration), "--no-live"]
    print("$", " ".join(cmd), flush=True)
    rc = subprocess.run(cmd, cwd=REPO).returncode
    results = work / "results.json"
    if rc != 0 or not results.exists():
        sys.exit(f"error: kvpool demo failed (rc={rc}); logs under {work / 'logs'}")
    result = json.loads(results.read_text())
    payload = {"backend": args.backend, "model": args.model, "dtype": dtype,
               "kv_bytes_per_token": per_token, "budget": budget, "budget_tokens": tokens,
               "page_size": page,
               "duration_s": args.duration, **ratios(result), "summary": result["summary"],
               "config": result["config"]}
    path = write_result(f"demo_{args.backend}", payload, args.out)
    print(json.dumps({k: v for k, v in payload.items() if k.endswith("elastic")}))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
