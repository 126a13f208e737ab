"""kvpool's bundled engine against a peer engine (vLLM CPU) on workloads W1-W6.

Used by ``engine_bench.py --peer vllm``. Each engine lives in its own worker process (and
its own process group), loaded once; the driver sends them the same workload in turn
(kvpool, vLLM, then vLLM, kvpool on the next repetition ...), so machine noise hits both
alike, and while one engine runs the other's process group is paused with SIGSTOP (SIGCONT
after; every exit path continues both), so the idle engine's threads cannot take a core.
Repetition 0 is a discarded warm-up unless ``warmup=0``. Before every run the worker
empties its prefix cache, so each run starts cold. Page faults are the worker's
``getrusage`` minor faults during the timed run. Every repetition's pair (both engines'
numbers, the order they ran in, the load average) is kept in the result.

Workloads (token ids, seeded; greedy, ignore_eos, fixed output lengths):
  W1  64 requests, prompts 64-256, 64 out
  W2  128 requests, prompts 64-256, outputs 16-256 (uniform)
  W3  64 requests sharing a 512-token prefix + 32 unique tokens, 32 out
  W4  one request, 512 prompt, 128 out: TPOT = (t(128 out) - t(1 out)) / 127, TTFT = t(1 out)
  W5  32 requests, prompts 1,500-2,000, 128 out (long prefills; contexts up to 2,128)
  W6  8 requests, 32-token prompts, 1,024 out each (long-context decode; contexts to 1,056)
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import random
import resource
import signal
import statistics
import time
from typing import Any

Work = list[tuple[list[int], int]]  # (prompt ids, output length)


def workloads(vocab: int, seed: int = 0) -> dict[str, Work]:
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    prefix = ids(512)
    return {
        "W1": [(ids(rng.randint(64, 256)), 64) for _ in range(64)],
        "W2": [(ids(rng.randint(64, 256)), rng.randint(16, 256)) for _ in range(128)],
        "W3": [(prefix + ids(32), 32) for _ in range(64)],
        "W4": [(ids(512), 128)],
        # drawn after W1-W4 so that those stay the same token ids as before
        "W5": [(ids(rng.randint(1500, 2000)), 128) for _ in range(32)],
        "W6": [(ids(32), 1024) for _ in range(8)],
    }


# the longest context any workload reaches (W5: 2,000 + 128); max_model_len must allow it
MAX_CONTEXT = 2128


# --- workers (run in their own process) ------------------------------------------------

class _Kvpool:
    def __init__(self, path: str, lim: dict[str, Any]) -> None:
        import torch

        from kvpool.engine import LLM, SamplingParams

        torch.set_num_threads(lim["threads"])
        self.sp = SamplingParams
        self.llm = LLM(path, device="cpu", dtype=lim.get("dtype", "float32"),
                       block_size=lim["block_size"],
                       kv_cache_size=lim["kv_bytes"], max_num_seqs=lim["max_num_seqs"],
                       max_num_batched_tokens=lim["max_num_batched_tokens"],
                       enable_prefix_caching=True, max_model_len=lim["max_model_len"])
        self.threads = torch.get_num_threads()
        self.block_size = lim["block_size"]

    def reset(self) -> None:
        self.llm.engine.pool.reset_prefix_cache()

    def generate(self, work: Work) -> list[list[int]]:
        outs = self.llm.generate([p for p, _ in work], [
            self.sp(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
            for _, n in work])
        return [o.output_token_ids for o in outs]


class _Vllm:
    def __init__(self, path: str, lim: dict[str, Any]) -> None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, lim["kv_bytes"] >> 30))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in this process: same rusage
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{lim['threads'] - 1}"
        os.environ["OMP_NUM_THREADS"] = str(lim["threads"])
        import torch
        from vllm import LLM, SamplingParams

        self.sp = SamplingParams
        # NOTE: vLLM's CPU attention wants blocks in multiples of 32: it keeps its default
        self.llm = LLM(model=path, dtype=lim.get("dtype", "float32"),
                       max_num_seqs=lim["max_num_seqs"],
                       max_num_batched_tokens=lim["max_num_batched_tokens"],
                       enable_prefix_caching=True, enforce_eager=True,
                       max_model_len=lim["max_model_len"], skip_tokenizer_init=True, seed=0)
        self.threads = torch.get_num_threads()
        self.block_size = self.llm.llm_engine.vllm_config.cache_config.block_size

    def reset(self) -> None:
        self.llm.reset_prefix_cache()

    def generate(self, work: Work) -> list[list[int]]:
        outs = self.llm.generate([{"prompt_token_ids": p} for p, _ in work], [
            self.sp(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
            for _, n in work], use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


def _worker(kind: str, path: str, lim: dict[str, Any], conn) -> None:  # noqa: ANN001
    os.setpgid(0, 0)  # its own process group: the driver pauses it (and any child) as one
    t = time.perf_counter()
    eng = (_Kvpool if kind == "kvpool" else _Vllm)(path, lim)
    eng.generate([([5, 6, 7, 8] * 16, 8)] * 4)  # warm-up
    conn.send({"startup_s": time.perf_counter() - t, "threads": eng.threads,
               "block_size": eng.block_size})
    while (work := conn.recv()) is not None:
        eng.reset()
        load = os.getloadavg()[0]
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = time.perf_counter()
        outs = eng.generate(work)
        dt = time.perf_counter() - t
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        conn.send({"seconds": dt, "page_faults": faults, "outputs": outs,
                   "load_before": load, "load_after": os.getloadavg()[0]})


class Peer:
    """A worker process serving one engine; ``run(work)`` times one cold generate.
    ``pause``/``resume`` stop and continue its whole process group; ``close`` (and the
    interpreter's exit) always continues it first."""

    def __init__(self, kind: str, path: str, lim: dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(kind, path, lim, child), daemon=True)
        self.proc.start()
        self.paused = False
        atexit.register(self.resume)  # a driver that dies never leaves a stopped engine
        self.info = self.conn.recv()  # the worker joined its own group before replying
        assert self.proc.pid is not None
        self.pgid = self.proc.pid

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.pgid, sig)
        except (ProcessLookupError, AttributeError):  # gone (or never started)
            pass

    def pause(self) -> None:
        self.paused = True
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        if getattr(self, "paused", False):
            self._signal(signal.SIGCONT)
            self.paused = False

    def run(self, work: Work) -> dict[str, Any]:
        assert not self.paused, "run on a paused engine"
        self.conn.send(work)
        return self.conn.recv()

    def close(self) -> None:
        self.resume()
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()


def _alone(peers: dict[str, Peer], kind: str, fn):  # noqa: ANN001, ANN202
    """``fn()`` with every peer but ``kind`` paused; they are continued however fn ends."""
    others = [p for k, p in peers.items() if k != kind]
    try:
        for p in others:
            p.pause()
        return fn()
    finally:
        for p in others:
            p.resume()


# --- the comparison --------------------------------------------------------------------

def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of output positions where both engines produced the same token."""
    same = sum(x == y for p, q in zip(a, b) for x, y in zip(p, q))
    return same / max(1, sum(max(len(p), len(q)) for p, q in zip(a, b)))


def _one(peer: Peer, name: str, work: Work) -> dict[str, Any]:
    r = peer.run(work)
    if name == "W4":
        first = peer.run([(work[0][0], 1)])
        r["ttft_ms"] = 1e3 * first["seconds"]
        r["tpot_ms"] = 1e3 * (r["seconds"] - first["seconds"]) / (work[0][1] - 1)
    r["tokens_per_s"] = sum(len(o) for o in r["outputs"]) / r["seconds"]
    return r


def compare(path: str, vocab: int, lim: dict[str, Any], reps: int, names: list[str],
            log, warmup: int = 1) -> dict[str, Any]:  # noqa: ANN001
    """``warmup`` discarded, then ``reps`` measured repetitions of every workload on both
    engines, the order rotating per repetition, the idle engine paused; min/median per
    metric, kvpool / vLLM ratios of the medians, every repetition's pair, greedy agreement
    and page faults."""
    work = workloads(vocab)
    need = max(len(p) + n for w in names for p, n in work[w])
    if lim["max_model_len"] < need:
        raise SystemExit(f"max_model_len {lim['max_model_len']} < {need} tokens that "
                         f"{','.join(names)} reach")
    peers: dict[str, Peer] = {}
    runs: dict[str, dict[str, list[dict]]] = {w: {"kvpool": [], "vllm": []} for w in names}
    pairs: dict[str, list[dict[str, Any]]] = {w: [] for w in names}
    try:
        peers["kvpool"] = Peer("kvpool", path, lim)
        log(f"kvpool up in {peers['kvpool'].info['startup_s']:.1f}s")
        peers["kvpool"].pause()  # vLLM's start-up (profiling runs) alone
        peers["vllm"] = Peer("vllm", path, lim)
        peers["kvpool"].resume()
        log(f"vllm up in {peers['vllm'].info['startup_s']:.1f}s")
        for rep in range(-warmup, reps):
            order = ["kvpool", "vllm"] if rep % 2 == 0 else ["vllm", "kvpool"]
            for w in names:
                got: dict[str, dict[str, Any]] = {}
                for kind in order:
                    r = _alone(peers, kind, lambda: _one(peers[kind], w, work[w]))
                    got[kind] = r
                    log(f"rep {rep}{' (warm-up)' if rep < 0 else ''} {w} {kind}: "
                        f"{r['tokens_per_s']:.0f} tok/s"
                        + (f", TTFT {r['ttft_ms']:.1f} ms, TPOT {r['tpot_ms']:.2f} ms"
                           if "tpot_ms" in r else "")
                        + f", {r['page_faults']} faults, load {r['load_before']:.1f}")
                if rep < 0:
                    continue
                for kind in order:
                    runs[w][kind].append(got[kind])
                k, v = got["kvpool"], got["vllm"]
                pair = {"rep": rep, "order": order,
                        "kvpool_tokens_per_s": k["tokens_per_s"],
                        "vllm_tokens_per_s": v["tokens_per_s"],
                        "ratio_kvpool_over_vllm": k["tokens_per_s"] / v["tokens_per_s"],
                        "load_before": {"kvpool": k["load_before"], "vllm": v["load_before"]}}
                if "tpot_ms" in k:
                    pair.update(ttft_ms={"kvpool": k["ttft_ms"], "vllm": v["ttft_ms"]},
                                tpot_ms={"kvpool": k["tpot_ms"], "vllm": v["tpot_ms"]})
                pairs[w].append(pair)
    finally:
        for p in peers.values():
            p.close()
    out: dict[str, Any] = {"startup_s": {k: p.info["startup_s"] for k, p in peers.items()},
                           "threads": {k: p.info["threads"] for k, p in peers.items()},
                           "block_size": {k: p.info["block_size"] for k, p in peers.items()},
                           "workloads": {}}
    for w in names:
        entry: dict[str, Any] = {}
        for kind in ("kvpool", "vllm"):
            rs = runs[w][kind]
            entry[kind] = {m: _stats([r[m] for r in rs])
                           for m in ("tokens_per_s", "seconds", "page_faults", "ttft_ms",
                                     "tpot_ms", "load_before", "load_after")
                           if m in rs[0]}
        entry["ratio_kvpool_over_vllm_tokens_per_s"] = (
            entry["kvpool"]["tokens_per_s"]["median"] / entry["vllm"]["tokens_per_s"]["median"])
        # back-to-back pairs see similar machine load: their ratios are the noise-robust view
        paired = [a["tokens_per_s"] / b["tokens_per_s"]
                  for a, b in zip(runs[w]["kvpool"], runs[w]["vllm"])]
        entry["paired_ratios_kvpool_over_vllm"] = paired
        entry["paired_ratio_median"] = statistics.median(paired)
        entry["pairs"] = pairs[w]
        entry["ratio_of_max_tokens_per_s"] = (entry["kvpool"]["tokens_per_s"]["max"]
                                              / entry["vllm"]["tokens_per_s"]["max"])
        if w == "W4":
            entry["tpot_vllm_over_kvpool"] = (entry["vllm"]["tpot_ms"]["median"]
                                              / entry["kvpool"]["tpot_ms"]["median"])
            entry["ttft_kvpool_over_vllm"] = (entry["kvpool"]["ttft_ms"]["median"]
                                              / entry["vllm"]["ttft_ms"]["median"])
        entry["greedy_agreement_kvpool_vllm"] = agreement(runs[w]["kvpool"][0]["outputs"],
                                                          runs[w]["vllm"][0]["outputs"])
        entry["kvpool_outputs_stable_across_reps"] = all(
            r["outputs"] == runs[w]["kvpool"][0]["outputs"] for r in runs[w]["kvpool"])
        entry["_kvpool_outputs"] = runs[w]["kvpool"][0]["outputs"]
        out["workloads"][w] = entry
    return out


def _stats(xs: list[float]) -> dict[str, Any]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "all": xs}


def hf_floor(path: str, work: Work, batch: int, threads: int, dtype: str = "float32"
             ) -> dict[str, Any]:
    """transformers ``generate`` in static left-padded batches of ``batch`` (each runs to
    its longest output): the floor both engines must beat; returns tok/s and outputs."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    outs: list[list[int]] = []
    t = time.perf_counter()
    for i in range(0, len(work), batch):
        chunk = work[i:i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for j, (p, _) in enumerate(chunk):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=max(n for _, n in chunk), eos_token_id=None,
                                 pad_token_id=0)
        outs += [gen[j, width:width + n].tolist() for j, (_, n) in enumerate(chunk)]
    dt = time.perf_counter() - t
    return {"seconds": dt, "tokens_per_s": sum(n for _, n in work) / dt, "batch": batch,
            "outputs": outs}


def profile_step(path: str, lim: dict[str, Any], vocab: int, at_step: int = 40,
                 steps: int = 3) -> tuple[str, dict[str, Any]]:
    """torch.profiler table of ``steps`` W2 steps of kvpool's engine from step ``at_step``
    (prefill and decode mixed, most of the batch decoding), plus the mean step time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvpool.engine import Engine, EngineConfig, SamplingParams

    torch.set_num_threads(lim["threads"])
    eng = Engine(EngineConfig(path, device="cpu", dtype="float32",
                              block_size=lim["block_size"], kv_cache_size=lim["kv_bytes"],
                              max_num_seqs=lim["max_num_seqs"],
                              max_num_batched_tokens=lim["max_num_batched_tokens"],
                              max_model_len=lim["max_model_len"]))
    for p, n in workloads(vocab)["W2"]:
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                          detokenize=False))
    for _ in range(at_step):
        eng.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        dt = (time.perf_counter() - t) / steps
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    return table, {"step_ms_under_profiler": 1e3 * dt, "running": len(eng.scheduler.running),
                   "at_step": at_step, "steps": steps}


def _profile_engine(path: str, lim: dict[str, Any]):  # noqa: ANN202
    import torch

    from kvpool.engine import Engine, EngineConfig

    torch.set_num_threads(lim["threads"])
    return Engine(EngineConfig(path, device="cpu", dtype="float32",
                               block_size=lim["block_size"], kv_cache_size=lim["kv_bytes"],
                               max_num_seqs=lim["max_num_seqs"],
                               max_num_batched_tokens=lim["max_num_batched_tokens"],
                               max_model_len=lim["max_model_len"]))


def profile_w3_w4(path: str, lim: dict[str, Any], vocab: int, steps: int = 3
                  ) -> tuple[str, dict[str, Any]]:
    """torch.profiler tables (issue 25): ``steps`` W3 decode steps (64 sequences over
    ~560 tokens of context, after every prefill and 4 more steps) and ``steps`` cold W4
    prefills (512 tokens, one output token), with each one's wall and thread CPU time
    per step unprofiled (median of 6) next to it."""
    from torch.profiler import ProfilerActivity, profile

    from kvpool.engine import SamplingParams

    def sp(n: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)

    def timed(fn) -> dict[str, float]:  # noqa: ANN001
        wall, cpu = [], []
        for _ in range(6):
            t, c = time.perf_counter(), time.thread_time()
            fn()
            wall.append(time.perf_counter() - t)
            cpu.append(time.thread_time() - c)
        return {"wall_ms_median": 1e3 * statistics.median(wall),
                "main_thread_cpu_ms_median": 1e3 * statistics.median(cpu)}

    work = workloads(vocab)
    eng = _profile_engine(path, lim)
    for p, n in work["W3"]:
        eng.add_request(p, sp(n))
    while any(r.num_output_tokens == 0 for r in eng.requests.values()):
        eng.step()
    for _ in range(4):
        eng.step()
    info: dict[str, Any] = {"threads": lim["threads"], "W3_decode_step": timed(eng.step),
                            "W3_running": len(eng.scheduler.running)}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            eng.step()
    w3 = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14)
    eng = _profile_engine(path, lim)
    prompt = work["W4"][0][0]

    def prefill() -> None:
        eng.add_request(prompt, sp(1))
        while eng.has_unfinished():
            eng.step()
        eng.pool.reset_prefix_cache()

    prefill()
    info["W4_prefill"] = timed(prefill)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            prefill()
    w4 = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14)
    text = (f"W3: {steps} decode steps of {info['W3_running']} sequences (~560 tokens of "
            f"context)\n{w3}\nW4: {steps} cold prefills of 512 tokens\n{w4}")
    return text, info
