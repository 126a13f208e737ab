"""What every benchmark records next to its numbers: the command, the machine, the time."""

from __future__ import annotations

import json
import os
import platform
import shlex
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
