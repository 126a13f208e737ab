"""What every benchmark records next to its numbers: the command, the machine, the time."""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def command() -> str:
    return " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])


def summarize(samples_ns: list[int]) -> dict:
    """Median, p99 and mean of nanosecond samples, in microseconds."""
    xs = sorted(samples_ns)
    p99 = xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]
    return {
        "n": len(xs),
        "median_us": statistics.median(xs) / 1e3,
        "p99_us": p99 / 1e3,
        "mean_us": statistics.fmean(xs) / 1e3,
    }


def best_s(run, reps: int = 3) -> float:
    """The best wall time in seconds of ``reps`` calls of ``run()``."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def write_result(name: str, payload: dict, out: str | None = None) -> Path:
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": name,
        "command": command(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        **payload,
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


SMOLLM2_NAME = "SmolLM2-135M-Instruct"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def smollm2(cache: Path) -> Path:
    """The converted SmolLM2 folder under ``cache`` (converted now unless one made from the
    same GGUF file is there); SystemExit when the package is missing."""
    from kvpool.engine.gguf.convert import convert_gguf
    from kvpool.engine.model.real_models import smollm2_gguf

    located = smollm2_gguf()
    if located.path is None:
        raise SystemExit(f"SmolLM2 unavailable: {located.reason} (or give --model DIR)")
    st = located.path.stat()
    stamp = {"file": str(located.path), "size": st.st_size, "mtime": st.st_mtime}
    out, stamp_file = cache / SMOLLM2_NAME, cache / f"{SMOLLM2_NAME}.source.json"
    if out.is_dir() and stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return out
    shutil.rmtree(out, ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)
    log(f"converting {located.path} into {out} ...")
    convert_gguf(located.path, out)
    stamp_file.write_text(json.dumps(stamp))
    return out
