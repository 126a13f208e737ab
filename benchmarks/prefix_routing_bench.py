"""Prefix-affinity routing vs round-robin vs least-loaded among the replicas of one model:
prefix-cache hit rate, TTFT p50/p99 and throughput.

Two real ``kvpool serve`` replicas of one tiny generated model (``kvpool make-model``),
prefix caching on, each pinned to its own CPU, each with a KV cache that holds about
half of the workload's shared prefixes (``--kv-blocks``): a router that sends every
prefix group to one replica lets the two caches hold all the prefixes between them; one
that sprays requests makes each cache hold all of them, and they evict each other.

The workload: ``--groups`` prefix groups (a shared system prompt / few-shot prefix of
``--prefix-min``..``--prefix-max`` tokens each), ``--requests`` requests, each its
group's prefix plus a unique user turn; user-turn and answer lengths are rows of the
Azure conversation trace (``../shared/data``, scaled and capped). Requests go out from
``--concurrency`` closed-loop clients in one fixed order. Prompts are token ids (the
engines' 16-token blocks), so the picker's keys line up with the engines' cached blocks;
``--chat`` sends chat bodies of random words instead (the router keys their text).

Routing: the bench is its own router (an async forwarder): per request it builds the
replicas' ``ReplicaLoad`` from its own in-flight counts and calls
``kvpool.fleet.balance.choose`` with a picker from ``balance.make_picker`` -- the same
classes and calls ``kvpool fleet`` uses -- then streams straight from the chosen replica.
Runs are interleaved (every policy once per rep, the order rotated each rep); each run
uses fresh prefix tokens (same lengths, same group sequence), so no run hits another's
cache. Hit rate = prefix-hit tokens / prompt tokens from the replicas' ``/v1/stats``
(delta over the run). Ratios are against round-robin, pooled over reps.

    python benchmarks/prefix_routing_bench.py --reps 3
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from kvpool import launch  # noqa: E402
from kvpool.demo.cluster import free_port  # noqa: E402
from kvpool.fleet import balance  # noqa: E402

DATA = REPO.parent / "shared" / "data"
POLICIES = ("prefix", "round_robin", "least_loaded")
BASELINE = "round_robin"


def user_turns(n: int, scale: float, cap: int, out_cap: int) -> list[tuple[int, int]]:
    """(user-turn tokens, answer tokens) from the Azure conversation trace's first rows:
    context scaled and capped, output capped; a fixed mix when the trace is absent."""
    path = DATA / "azure_llm_2023_conv.csv"
    if not path.exists():
        rng = random.Random(1)
        return [(rng.randrange(16, cap + 1), rng.randrange(2, out_cap + 1)) for _ in range(n)]
    rows: list[tuple[int, int]] = []
    with open(path) as f:
        for r in csv.DictReader(f):
            rows.append((max(8, min(cap, int(int(r["ContextTokens"]) * scale))),
                         max(2, min(out_cap, int(r["GeneratedTokens"])))))
            if len(rows) >= n:
                break
    return rows


def shape(args: argparse.Namespace) -> dict[str, Any]:
    """What every run shares: the groups' prefix lengths, each request's group, user-turn
    length and answer length."""
    rng = random.Random(args.seed)
    lengths = [rng.randrange(args.prefix_min, args.prefix_max + 1) for _ in range(args.groups)]
    weights = [1.0 / (g + 1) ** args.zipf for g in range(args.groups)]
    groups = rng.choices(range(args.groups), weights, k=args.requests)
    turns = user_turns(args.requests, args.turn_scale, args.turn_cap, args.max_output)
    return {"prefix_lengths": lengths, "groups": groups, "turns": turns}


def requests_of(sh: dict[str, Any], salt: int, vocab: int, chat: bool = False
                ) -> list[dict[str, Any]]:
    """One run's requests: fresh token ids (from ``salt``) in the shared shape; with
    ``chat``, chat bodies instead: the prefix as the system message, the turn as the user
    message, both random words (about four tokens each: lengths are approximate)."""
    rng = random.Random(salt)
    if chat:
        words = ["".join(random.Random(w).choices("abcdefghijklmnopqrstuvwxyz", k=4))
                 for w in range(256)]
        system = [" ".join(rng.choices(words, k=max(1, n // 4))) for n in sh["prefix_lengths"]]
        return [{"group": g, "max_tokens": out, "messages": [
            {"role": "system", "content": system[g]},
            {"role": "user", "content": " ".join(rng.choices(words, k=max(1, turn // 4)))}]}
            for g, (turn, out) in zip(sh["groups"], sh["turns"])]
    prefixes = [[rng.randrange(8, vocab) for _ in range(n)] for n in sh["prefix_lengths"]]
    return [{"group": g, "max_tokens": out,
             "prompt": prefixes[g] + [rng.randrange(8, vocab) for _ in range(turn)]}
            for g, (turn, out) in zip(sh["groups"], sh["turns"])]


class Forwarder:
    """The bench's router: the fleet's picker seam over its own in-flight counts."""

    def __init__(self, picker: balance.Picker, urls: list[str], capacity: int) -> None:
        self.picker, self.urls, self.capacity = picker, urls, capacity
        self.inflight = [0] * len(urls)

    async def send(self, client: Any, req: dict[str, Any]) -> dict[str, Any]:
        chat = "messages" in req
        body = {"model": "m", "max_tokens": req["max_tokens"], "temperature": 0.0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}
        if chat:
            body |= {"messages": req["messages"], "stream_options": {"include_usage": True}}
        else:
            body["prompt"] = req["prompt"]
        loads = [balance.ReplicaLoad(i, n, self.capacity, True)
                 for i, n in enumerate(self.inflight)]
        pick = balance.choose(self.picker, balance.prompt_of(body), loads)
        self.inflight[pick.index] += 1
        sent = time.perf_counter()
        first: float | None = None
        tokens = 0
        try:
            path = "/v1/chat/completions" if chat else "/v1/completions"
            async with client.stream("POST", f"{self.urls[pick.index]}{path}",
                                     json=body) as resp:
                if resp.status_code != 200:
                    raise RuntimeError(f"replica {pick.index}: HTTP {resp.status_code}: "
                                       f"{(await resp.aread())[:300]!r}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    for c in chunk.get("choices", []):
                        n = len(c.get("token_ids") or [])
                        if (n or (c.get("delta") or {}).get("content")) and first is None:
                            first = time.perf_counter()
                        tokens += n
                    if chunk.get("usage"):
                        tokens = int(chunk["usage"]["completion_tokens"])
        finally:
            self.inflight[pick.index] -= 1
        return {"ttft": None if first is None else first - sent, "tokens": tokens,
                "replica": pick.index,
                "reason": pick.reason, "matched_blocks": pick.matched_blocks}


async def drive(fwd: Forwarder, reqs: list[dict[str, Any]], concurrency: int
                ) -> tuple[list[dict[str, Any]], float]:
    import httpx

    queue = list(reversed(reqs))
    got: list[dict[str, Any]] = []

    async def client_loop(client: Any) -> None:
        while queue:
            got.append(await fwd.send(client, queue.pop()))

    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        return got, time.perf_counter() - t0


def stats(url: str) -> dict[str, int]:
    import httpx

    s = httpx.get(f"{url}/v1/stats", timeout=60, trust_env=False).json()
    return {"prompt_tokens": int(s["prompt_tokens"]),
            "prefix_hit_tokens": int(s["prefix_hit_tokens"]),
            "preemptions": int(s.get("preemptions", 0))}


def pct(xs: list[float], q: float) -> float | None:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))] if ys else None


def summary(got: list[dict[str, Any]], secs: float, hits: int, prompt: int,
            preemptions: int) -> dict[str, Any]:
    ttfts = [g["ttft"] for g in got if g["ttft"] is not None]
    per_replica = [sum(g["replica"] == i for g in got) for i in (0, 1)]
    reasons: dict[str, int] = {}
    for g in got:
        reasons[g["reason"]] = reasons.get(g["reason"], 0) + 1
    return {"requests": len(got), "hit_rate": hits / prompt if prompt else None,
            "hit_tokens": hits, "prompt_tokens": prompt,
            "ttft_p50": pct(ttfts, 0.5), "ttft_p99": pct(ttfts, 0.99),
            "requests_per_s": len(got) / secs,
            "output_tokens_per_s": sum(g["tokens"] for g in got) / secs,
            "wall_s": secs, "per_replica": per_replica, "reasons": reasons,
            "preemptions": preemptions}


def ratio(x: float | None, base: float | None) -> float | None:
    return x / base if x is not None and base else None


def start_replicas(args: argparse.Namespace, model: Path, tmp: Path
                   ) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    procs: list[subprocess.Popen[bytes]] = []
    urls: list[str] = []
    cpus = [c for c in args.cpus.split(",") if c]
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for i in range(2):
        port = free_port()
        argv = launch.serve_argv(model, "--num-kv-blocks", str(args.kv_blocks),
                                 "--max-num-seqs", str(args.max_num_seqs),
                                 *(("--cpus", cpus[i % len(cpus)]) if cpus else ()),
                                 port=port, name="m", kv_cache_size="64MiB")
        procs.append(launch.spawn_process(argv, tmp / f"replica{i}.log", env, cwd=REPO,
                                          new_session=True))
        urls.append(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + 300
    for i, (p, url) in enumerate(zip(procs, urls)):
        log = tmp / f"replica{i}.log"
        try:
            launch.wait_healthy(p, url, f"replica {i}", deadline,
                                lambda log=log: log.read_text(errors="replace")[-2000:])
        except launch.ChildStartError as e:
            for q in procs:
                launch.stop(q, grace_s=5.0, group=True)
            raise SystemExit(f"replica did not start: {e}") from None
    return procs, urls


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--groups", type=int, default=12)
    ap.add_argument("--prefix-min", type=int, default=256)
    ap.add_argument("--prefix-max", type=int, default=512)
    ap.add_argument("--zipf", type=float, default=0.0, help="group popularity skew (0: even)")
    ap.add_argument("--requests", type=int, default=144, help="per run")
    ap.add_argument("--concurrency", type=int, default=6, help="closed-loop clients")
    ap.add_argument("--turn-scale", type=float, default=0.1)
    ap.add_argument("--turn-cap", type=int, default=128)
    ap.add_argument("--max-output", type=int, default=12)
    ap.add_argument("--kv-blocks", type=int, default=224, help="each replica's KV blocks")
    ap.add_argument("--max-num-seqs", type=int, default=8, help="each replica's (its capacity)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--cpus", default="0,1", help="replica i is pinned to the i-th ('' : none)")
    ap.add_argument("--chat", action="store_true", help="chat bodies of random words (the "
                    "router keys text by 64-character chunks) instead of token ids")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    if not policies or not set(policies) <= set(balance.PICKERS) or BASELINE not in policies:
        raise SystemExit(f"--policies: {BASELINE} plus any of {sorted(balance.PICKERS)}")
    if args.prefix_min < 16 or args.prefix_max < args.prefix_min or args.groups < 1:
        raise SystemExit("--prefix-min >= 16, --prefix-max >= --prefix-min, --groups >= 1")
    sh = shape(args)
    tmp = Path(tempfile.mkdtemp(prefix="prefix-bench-", dir="/tmp"))
    model = tmp / "model"
    made = subprocess.run([*launch.cli_argv(), "make-model", str(model), "--layers",
                           str(args.layers), "--hidden", str(args.hidden), "--heads", "4",
                           "--kv-heads", "2", "--vocab", str(args.vocab)],
                          capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if made.returncode != 0:
        raise SystemExit(f"kvpool make-model failed: {made.stderr[-2000:]}")
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    samples: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    load_before = os.getloadavg()
    started = time.monotonic()
    procs, urls = start_replicas(args, model, tmp)
    try:
        warm = requests_of(sh, 10**6, args.vocab, args.chat)[:4]
        asyncio.run(drive(Forwarder(balance.RoundRobin(), urls, args.max_num_seqs),
                          warm, 2))
        for rep in range(args.reps):
            order = policies[rep % len(policies):] + policies[:rep % len(policies)]
            for policy in order:
                reqs = requests_of(sh, 1000 * rep + POLICIES.index(policy), args.vocab,
                                   args.chat)
                before = [stats(u) for u in urls]
                fwd = Forwarder(balance.make_picker(policy), urls, args.max_num_seqs)
                load = os.getloadavg()[0]
                got, secs = asyncio.run(drive(fwd, reqs, args.concurrency))
                after = [stats(u) for u in urls]
                d = {k: sum(a[k] - b[k] for a, b in zip(after, before)) for k in after[0]}
                row = summary(got, secs, d["prefix_hit_tokens"], d["prompt_tokens"],
                              d["preemptions"]) | {"rep": rep, "load_1m": load}
                runs[policy].append(row)
                samples[policy] += got
                print(f"rep {rep} {policy:<13} {secs:5.1f} s  load {load:4.1f}  hit "
                      f"{row['hit_rate']:.2f}  ttft p50/p99 {row['ttft_p50'] * 1e3:6.0f}/"
                      f"{row['ttft_p99'] * 1e3:6.0f} ms  {row['requests_per_s']:.2f} req/s  "
                      f"split {row['per_replica']}", flush=True)
    except Exception as e:  # noqa: BLE001 - say why, with the replicas' logs
        logs = "\n".join((tmp / f"replica{i}.log").read_text(errors="replace")[-1500:]
                         for i in range(2))
        raise SystemExit(f"run failed ({e!r}); replica logs:\n{logs}") from None
    finally:
        for p in procs:
            launch.stop(p, grace_s=5.0, group=True)
        shutil.rmtree(tmp, ignore_errors=True)
    rows: dict[str, dict[str, Any]] = {}
    for policy in policies:
        rs = runs[policy]
        hits = sum(r["hit_tokens"] for r in rs)
        prompt = sum(r["prompt_tokens"] for r in rs)
        secs = sum(r["wall_s"] for r in rs)
        rows[policy] = summary(samples[policy], secs, hits, prompt,
                               sum(r["preemptions"] for r in rs))
    base = rows[BASELINE]
    keys = ("hit_rate", "ttft_p50", "ttft_p99", "requests_per_s", "output_tokens_per_s")
    over = {p: {k: ratio(rows[p][k], base[k]) for k in keys} for p in policies}
    per_rep = [{p: {k: ratio(runs[p][i][k], runs[BASELINE][i][k]) for k in keys}
                for p in policies if p != BASELINE} for i in range(args.reps)]
    print(f"\n{'policy':<14}{'hit rate':>9}{'ttft p50':>11}{'ttft p99':>11}{'req/s':>8}"
          f"{'tok/s':>8}   vs round-robin: hit, p50, p99, req/s")
    for p in policies:
        r, o = rows[p], over[p]
        print(f"{p:<14}{r['hit_rate']:>9.3f}{r['ttft_p50'] * 1e3:>8.0f} ms"
              f"{r['ttft_p99'] * 1e3:>8.0f} ms{r['requests_per_s']:>8.2f}"
              f"{r['output_tokens_per_s']:>8.1f}   {o['hit_rate']:.2f}x "
              f"{o['ttft_p50']:.2f}x {o['ttft_p99']:.2f}x {o['requests_per_s']:.2f}x")
    path = write_result("prefix_routing", {
        "args": vars(args),
        "workload": {"groups": args.groups, "prefix_lengths": sh["prefix_lengths"],
                     "requests_per_group": [sh["groups"].count(g) for g in range(args.groups)],
                     "user_turn_tokens_mean": sum(t for t, _ in sh["turns"]) / len(sh["turns"]),
                     "output_tokens": sum(o for _, o in sh["turns"]),
                     "prefix_blocks_total": sum(-(-n // 16) for n in sh["prefix_lengths"])},
        "policies": rows, "over_round_robin": over, "per_rep_over_round_robin": per_rep,
        "runs": runs, "load_before": load_before, "load_after": os.getloadavg(),
        "total_s": time.monotonic() - started,
        "note": "routed by the bench's own async forwarder through kvpool.fleet.balance "
                "(make_picker + choose, the fleet's seam), not yet through `kvpool fleet`; "
                "hit rate = prefix-hit tokens / prompt tokens (replicas' /v1/stats); TTFT "
                "to the first streamed token; closed loop, so req/s is the throughput at "
                "that concurrency; ratios pooled over reps, per-rep ratios kept"},
        args.out)
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
