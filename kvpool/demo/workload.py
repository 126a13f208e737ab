"""Bursty multi-model workloads with real prompt/output length distributions.

Lengths come from the Azure LLM inference traces of 2023 (Patel et al., "Splitwise",
ISCA 2024; CC-BY 4.0) when ``../shared/data`` (or ``$KVPOOL_TRACE_DIR``) has them,
scaled down to what a tiny model on a CPU serves: prompt tokens divided by
``prompt_scale`` and output tokens by ``output_scale``, each clipped to a range.
Without the files a seeded synthetic log-normal stands in, so a fresh clone still runs.

Arrivals are a Poisson process whose rate changes by phase: in phase ``k`` model
``k % len(models)`` runs at ``peak_rate`` while the others run at ``base_rate`` — the
models take turns peaking, which is what makes sharing memory pay. A shape with
``rates`` instead gives each model a constant rate of its own (steady mixed traffic, or
a long tail of rarely used models: ``benchmarks/fleet_vs_peers.py``).
"""

from __future__ import annotations

import csv
import os
import random
from dataclasses import dataclass
from pathlib import Path

TRACES = ("conv", "code")


@dataclass(frozen=True)
class Arrival:
    """One request of the replay: when, for which model, and how long."""

    at: float  # seconds from the start of the replay
    model: str
    prompt_len: int
    max_tokens: int


@dataclass
class WorkloadShape:
    models: list[str]
    duration_s: float = 60.0
    phase_s: float = 10.0
    base_rate: float = 0.5  # requests/s per model outside its burst
    peak_rate: float = 4.0  # requests/s of the model whose turn it is
    trace: str = "conv"
    prompt_scale: float = 8.0
    output_scale: float = 4.0
    prompt_range: tuple[int, int] = (16, 384)
    output_range: tuple[int, int] = (8, 64)
    seed: int = 0
    # each model's constant rate (requests/s), in ``models`` order; None: the turns above
    rates: tuple[float, ...] | None = None


def trace_dir() -> Path | None:
    """Where the Azure trace CSVs are, if anywhere."""
    env = os.environ.get("KVPOOL_TRACE_DIR")
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve()
    candidates += [p / "shared" / "data" for p in here.parents]
    for c in candidates:
        if (c / "azure_llm_2023_conv.csv").exists():
            return c
    return None


def load_lengths(trace: str) -> list[tuple[int, int]] | None:
    """(context tokens, generated tokens) of every row of a trace, or None if absent."""
    if trace not in TRACES:
        raise ValueError(f"unknown trace {trace!r}; choose one of {TRACES}")
    folder = trace_dir()
    if folder is None:
        return None
    with open(folder / f"azure_llm_2023_{trace}.csv", newline="") as f:
        return [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]


def _clip(x: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(round(x))))


def sample_lengths(shape: WorkloadShape, n: int, rnd: random.Random) -> list[tuple[int, int]]:
    rows = load_lengths(shape.trace)
    out = []
    for _ in range(n):
        ctx: float
        gen: float
        if rows:
            ctx, gen = rnd.choice(rows)
        else:  # synthetic stand-in shaped like the conversation trace (medians 1020 / 129)
            ctx, gen = rnd.lognormvariate(6.9, 0.8), rnd.lognormvariate(4.8, 0.9)
        out.append(
            (
                _clip(ctx / shape.prompt_scale, *shape.prompt_range),
                _clip(gen / shape.output_scale, *shape.output_range),
            )
        )
    return out


def rate_at(shape: WorkloadShape, model_index: int, t: float) -> float:
    if shape.rates is not None:
        return shape.rates[model_index]
    turn = int(t // shape.phase_s) % len(shape.models)
    return shape.peak_rate if turn == model_index else shape.base_rate


def generate(shape: WorkloadShape) -> list[Arrival]:
    """The whole replay, sorted by arrival time; the same shape gives the same list."""
    if not shape.models:
        raise ValueError("a workload needs at least one model")
    if shape.rates is not None and len(shape.rates) != len(shape.models):
        raise ValueError(f"{len(shape.rates)} rates for {len(shape.models)} models")
    rnd = random.Random(shape.seed)
    arrivals: list[tuple[float, str]] = []
    top = max(shape.peak_rate, shape.base_rate, *(shape.rates or ()))
    for i, model in enumerate(shape.models):
        t = 0.0
        while top > 0:
            # thinning: a Poisson process at the top rate, kept with probability rate/top
            t += rnd.expovariate(top)
            if t >= shape.duration_s:
                break
            if rnd.random() < rate_at(shape, i, t) / top:
                arrivals.append((t, model))
    arrivals.sort()
    lengths = sample_lengths(shape, len(arrivals), rnd)
    return [Arrival(t, m, p, o) for (t, m), (p, o) in zip(arrivals, lengths)]


def prompt_tokens(arrival: Arrival, vocab_size: int, index: int) -> list[int]:
    """Deterministic token ids for a request (tiny models have no real text to serve).

    Ids avoid the first 8 (special tokens) and the prompt of request ``index`` is always
    the same, so static and elastic runs see identical inputs.
    """
    rnd = random.Random(index * 7919 + arrival.prompt_len)
    return [rnd.randrange(8, vocab_size) for _ in range(arrival.prompt_len)]
