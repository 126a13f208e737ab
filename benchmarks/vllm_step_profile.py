"""Where a vLLM engine step spends its time, elastic (KVPOOL_ENABLE=1) vs static.

An offline, in-process vLLM (``LLM``, no API server, uniprocess executor) generates the
overhead benchmark's workload while every engine step is split into scheduler
(``schedule``), model (``execute_model`` + ``sample_tokens``) and output
(``update_from_output``) time with ``perf_counter_ns``; the block pool's calls are counted
too. One child process per configuration, alternating, ``--rounds`` each (the same run).
Prints per-part medians (µs per step) and the ratios elastic / static; writes
benchmarks/results/vllm_step_profile.json.

    python benchmarks/vllm_step_profile.py --rounds 3 --requests 8 --tokens 128
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "benchmarks")]

PARTS = ("step", "schedule", "model", "update", "pool")


def child(a) -> None:
    """Run in a fresh process: one LLM, timed steps, JSON on stdout's last line."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if a.run_dir:
        os.environ.update(KVPOOL_ENABLE="1", KVPOOL_RUN_DIR=a.run_dir,
                          KVPOOL_IDLE_TIMEOUT="60", KVPOOL_TENANT="elastic")
    import cProfile
    import pstats

    from vllm import LLM, SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    ns = time.perf_counter_ns
    cur: dict[str, int] = {}
    steps: list[dict[str, int]] = []
    counting = [False]

    def timed(cls, name, part):
        orig = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            t = ns()
            try:
                return orig(self, *args, **kwargs)
            finally:
                cur[part] = cur.get(part, 0) + ns() - t

        setattr(cls, name, wrapper)

    timed(Scheduler, "schedule", "schedule")
    timed(Scheduler, "update_from_output", "update")
    kw = dict(model=a.model, enforce_eager=True, max_model_len=512, dtype="float32",
              max_num_seqs=8, seed=0)
    if not a.run_dir:
        kw["kv_cache_memory_bytes"] = a.budget
    llm = LLM(**kw)
    if a.quiet and a.run_dir:  # background threads wake once a second instead
        import kvpool.client_lib.tenant as tenant_mod
        from kvpool.engine_adapters.vllm.bridge import current

        tenant_mod.POLL_S = 1.0
        current().allocator.tick_s = 1.0
    core = llm.llm_engine.engine_core.engine_core
    ex = core.model_executor
    for name in ("execute_model", "sample_tokens"):
        orig = getattr(ex, name)

        def wrapped(*args, _o=orig, **kwargs):
            t = ns()
            try:
                return _o(*args, **kwargs)
            finally:
                cur["model"] = cur.get("model", 0) + ns() - t

        setattr(ex, name, wrapped)
    pool = core.scheduler.kv_cache_manager.block_pool
    for name in ("get_new_blocks", "free_blocks", "touch", "get_num_free_blocks",
                 "cache_full_blocks"):
        orig = getattr(pool, name)

        def pooled(*args, _o=orig, **kwargs):
            t = ns()
            try:
                return _o(*args, **kwargs)
            finally:
                cur["pool"] = cur.get("pool", 0) + ns() - t
                cur["pool_calls"] = cur.get("pool_calls", 0) + 1

        setattr(pool, name, pooled)
    step = core.step_fn

    def step_timed():
        cur.clear()
        t = ns()
        out = step()
        if counting[0]:
            cur["step"] = ns() - t
            steps.append(dict(cur))
        return out

    core.step_fn = step_timed
    core.step = step_timed  # InprocClient calls engine_core.step()
    prompts = [f"Question {i}: what is the weather like in the town by the river? Answer: {i}"
               for i in range(a.requests)]
    sp = SamplingParams(max_tokens=a.tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    prof = cProfile.Profile() if a.cprofile else None
    counting[0] = True
    t0 = time.perf_counter()
    for _ in range(a.reps):
        if prof:
            prof.enable()
        llm.generate(prompts, sp, use_tqdm=False)
        if prof:
            prof.disable()
    wall = time.perf_counter() - t0
    counting[0] = False
    decode = [s for s in steps if s.get("step")]
    res = {p: statistics.median(s.get(p, 0) for s in decode) / 1e3 for p in PARTS}
    res["pool_calls"] = statistics.median(s.get("pool_calls", 0) for s in decode)
    res["steps"] = len(decode)
    res["tok_per_s"] = a.reps * a.requests * a.tokens / wall
    res["threads"] = sorted(t.name for t in __import__("threading").enumerate())
    if prof:
        st = pstats.Stats(prof, stream=sys.stderr)
        st.sort_stats("tottime").print_stats(35)
    print(json.dumps(res), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3, help="generate() calls per child")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--budget", default="64MiB")
    ap.add_argument("--page-size", type=int, default=2 << 20)
    ap.add_argument("--cprofile", action="store_true", help="print cProfile (tottime) to stderr")
    ap.add_argument("--out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variants", default="static,elastic",
                    help="comma list of static, elastic, elastic-quiet (threads wake 1/s)")
    a = ap.parse_args()
    if a.child:
        from kvpool.sizes import parse_size

        a.budget = parse_size(a.budget)
        child(a)
        return

    from adapters.vllm_procs import remove_daemon, start_daemon
    from common import write_result

    from kvpool.engine.model.tiny import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="vllm-prof-"))
    model = make_tiny_model(work / "tiny-llama", layers=4, hidden=256, heads=8, kv_heads=4,
                            vocab=512, seed=0)
    daemon = start_daemon(a.budget, a.page_size)
    variants = a.variants.split(",")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    try:
        for r in range(a.rounds):
            for name in (variants if r % 2 == 0 else variants[::-1]):
                cmd = [sys.executable, __file__, "--child", "--model", str(model),
                       "--budget", a.budget, "--reps", str(a.reps), "--requests",
                       str(a.requests), "--tokens", str(a.tokens)]
                if a.cprofile:
                    cmd.append("--cprofile")
                if name.startswith("elastic"):
                    cmd += ["--run-dir", str(daemon.run_dir)]
                if name == "elastic-quiet":
                    cmd.append("--quiet")
                env = {k: v for k, v in os.environ.items()
                       if not k.startswith(("KVPOOL_", "VLLM_"))}
                env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
                p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO,
                                   timeout=900)
                if p.returncode != 0:
                    raise SystemExit(f"{name} child failed:\n{p.stderr[-4000:]}")
                if a.cprofile:
                    print(f"==== cProfile {name} round {r}", file=sys.stderr)
                    print(p.stderr[p.stderr.find("Ordered by"):][:6000], file=sys.stderr)
                runs[name].append(json.loads(p.stdout.strip().splitlines()[-1]))
                print(name, {k: round(v, 1) if isinstance(v, float) else v
                             for k, v in runs[name][-1].items() if k != "threads"}, flush=True)
    finally:
        remove_daemon(daemon)
        shutil.rmtree(work, ignore_errors=True)
    summary = {n: {p: statistics.median(x[p] for x in xs) for p in (*PARTS, "tok_per_s")}
               for n, xs in runs.items()}
    base = summary[variants[0]]
    ratios = {v: {p: summary[v][p] / base[p] if base[p] else None
                  for p in (*PARTS, "tok_per_s")} for v in variants[1:]}
    print(f"{'part':10}" + "".join(f" {v:>14}" for v in variants) +
          "".join(f" {v + '/' + variants[0]:>22}" for v in variants[1:]))
    for p in (*PARTS, "tok_per_s"):
        print(f"{p:10}" + "".join(f" {summary[v][p]:14.1f}" for v in variants) +
              "".join(f" {ratios[v][p] or float('nan'):22.3f}" for v in variants[1:]))
    path = write_result("vllm_step_profile", {"params": vars(a), "runs": runs,
                                              "summary": summary, "ratios": ratios,
                                              "load_avg": os.getloadavg()}, a.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
