"""One engine with both phases vs a prefill/decode pair (`kvpool serve --pd`) on the same
cores and KV memory budget: TTFT, chat TPOT and chat inter-token gaps (p50/p99), long
requests' TTFT and throughput, for a mix of long-prompt (Azure code trace) and chat
(Azure conversation trace) requests sent at a fixed rate, streamed.

Three setups, each an elastic bundled server on one kvpool daemon (host backend):

* ``single``: one engine, pinned to all the CPUs given (``--cpus``, default 0,1), one
  torch thread per CPU: it runs prefill and decode in the same steps, so a long prompt's
  prefill chunk delays every decoding request's next token.
* ``pair_split``: ``--pd --prefill-cpus A --decode-cpus B``: each half has its own CPU
  (one torch thread), the way one GPU can give prefill and decode their own SMs; decode
  steps never wait for a prefill, but a prefill has half the compute.
* ``pair_shared``: ``--pd --cpus A,B``: both halves on both CPUs, two threads each
  (the first recording's setup, `results/pd_bench_shared.json`): they compete.

Runs are interleaved and the order rotates each round (single, split, shared; split,
shared, single; ...); each metric of a pair is shown as a ratio of the single engine's
from the same run (pooled over rounds; the per-round ratios of the headline metrics are
kept too). Prompts are random token ids of the traces' context lengths (long: the code
trace's requests of at least --long-min tokens, scaled by --long-scale, capped at
--long-cap; chat: the conversation trace scaled by --chat-scale, capped at --chat-cap)
on a synthetic model (--layers/--hidden), so the numbers say how the setups schedule,
not how fast a real model is. The load average before and after is recorded: other
processes on the machine share the CPUs.

    python benchmarks/pd_bench.py --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
SETUPS = ("single", "pair_split", "pair_shared")
#: the metrics whose per-round ratios are kept (the headline)
HEADLINE = ("chat_itl_p99", "chat_tpot_p99", "ttft_p50", "long_ttft_p50", "tokens_per_s")


def trace(name: str, n: int, scale: float, cap: int, out_cap: int, at_least: int = 0
          ) -> list[tuple[int, int]]:
    """The first ``n`` rows of an Azure trace with ``ContextTokens >= at_least``, as
    (prompt length scaled and capped, output length capped)."""
    rows = []
    with open(DATA / f"azure_llm_2023_{name}.csv") as f:
        for r in csv.DictReader(f):
            ctx = int(r["ContextTokens"])
            if ctx < at_least:
                continue
            rows.append((max(4, min(cap, int(ctx * scale))),
                         max(2, min(out_cap, int(r["GeneratedTokens"])))))
            if len(rows) >= n:
                break
    return rows


def workload(args) -> list[dict]:
    longs = trace("code", args.requests, args.long_scale, args.long_cap, 16, args.long_min)
    chats = trace("conv", args.requests, args.chat_scale, args.chat_cap, args.max_output)
    rng = random.Random(0)
    reqs = []
    for i in range(args.requests):
        kind = "long" if args.long_every and i % args.long_every == 0 else "chat"
        n, out = (longs if kind == "long" else chats)[i]
        reqs.append({"kind": kind, "prompt": [rng.randrange(8, 500) for _ in range(n)],
                     "max_tokens": out, "at": i / args.rate})
    return reqs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_args(setup: str, cpus: list[int]) -> list[str]:
    both = ",".join(map(str, cpus))
    if setup == "single":
        return ["--elastic", "--cpus", both]
    if setup == "pair_split":
        half = len(cpus) // 2
        return ["--pd", "--prefill-cpus", ",".join(map(str, cpus[:half])),
                "--decode-cpus", ",".join(map(str, cpus[half:]))]
    return ["--pd", "--cpus", both]


def start_server(model: Path, run_dir: Path, log: Path, extra: list[str], kv: str):
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")},
           "KVPOOL_RUN_DIR": str(run_dir), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "kvpool.cli.main", "serve", str(model), "--port", str(port),
           "--kv-cache-size", kv, "--log-level", "warning", "--served-model-name", "m",
           *extra]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                            cwd=REPO)
    from kvpool import launch

    url = f"http://127.0.0.1:{port}"
    try:
        launch.wait_healthy(proc, url, "the server", time.monotonic() + 300,
                            logs=lambda: log.read_text()[-2000:])
    except Exception as e:  # noqa: BLE001
        proc.kill()
        raise SystemExit(f"server did not start: {e}") from None
    return proc, url


async def one(client, url: str, r: dict, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + r["at"] - time.perf_counter()))
    sent = time.perf_counter()
    times: list[float] = []
    body = {"prompt": r["prompt"], "max_tokens": r["max_tokens"], "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for c in chunk.get("choices", []):
                    times += [time.perf_counter()] * len(c.get("token_ids", []))
    ttft = times[0] - sent if times else None
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"kind": r["kind"], "ttft": ttft, "tpot": tpot, "gaps": gaps,
            "tokens": len(times)}


async def drive(url: str, reqs: list[dict]) -> tuple[list[dict], float]:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        out = await asyncio.gather(*(one(client, url, r, t0) for r in reqs))
        return list(out), time.perf_counter() - t0


def pct(xs: list[float | None], q: float) -> float | None:
    ys = sorted(x for x in xs if x is not None)
    return ys[min(len(ys) - 1, int(q * len(ys)))] if ys else None


def metrics(got: list[dict], secs: float) -> dict:
    """The table's metrics over the requests ``got`` served in ``secs`` of wall time."""
    chat = [g for g in got if g["kind"] == "chat"]
    long = [g for g in got if g["kind"] == "long"]
    gaps = [x for g in chat for x in g["gaps"]]
    return {
        "ttft_p50": pct([g["ttft"] for g in got], 0.5),
        "ttft_p99": pct([g["ttft"] for g in got], 0.99),
        "chat_ttft_p50": pct([g["ttft"] for g in chat], 0.5),
        "long_ttft_p50": pct([g["ttft"] for g in long], 0.5),
        "long_ttft_p99": pct([g["ttft"] for g in long], 0.99),
        "chat_tpot_p50": pct([g["tpot"] for g in chat], 0.5),
        "chat_tpot_p99": pct([g["tpot"] for g in chat], 0.99),
        "chat_itl_p50": pct(gaps, 0.5),
        "chat_itl_p99": pct(gaps, 0.99),
        "chat_itl_p999": pct(gaps, 0.999),
        "chat_itl_max": max(gaps) if gaps else None,
        "tokens_per_s": sum(g["tokens"] for g in got) / secs,
        "wall_s": secs,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return b / a if a and b is not None else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=72)
    ap.add_argument("--rate", type=float, default=2.4, help="requests per second")
    ap.add_argument("--long-every", type=int, default=8,
                    help="every Nth request is long (0: none, chat only)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--long-min", type=int, default=2048, help="code-trace rows used")
    ap.add_argument("--long-scale", type=float, default=0.5)
    ap.add_argument("--long-cap", type=int, default=2048)
    ap.add_argument("--chat-scale", type=float, default=0.125)
    ap.add_argument("--chat-cap", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--kv", default="192MiB", help="each server's --kv-cache-size")
    ap.add_argument("--budget", default="512MiB", help="the daemon's budget (all servers)")
    ap.add_argument("--cpus", default="0,1", help="the CPUs every setup gets")
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from kvpool import launch
    from kvpool.engine import cpus as pinning
    from kvpool.engine.model.tiny import make_tiny_model

    try:
        cpus = pinning.parse(args.cpus)
    except ValueError as e:
        raise SystemExit(f"--cpus {args.cpus}: {e}") from None
    setups = [s for s in args.setups.split(",") if s]
    if "single" not in setups or not set(setups) <= set(SETUPS) or len(cpus) < 2:
        raise SystemExit(f"--setups: single plus any of {SETUPS[1:]}; --cpus: two or more")
    tmp = Path(tempfile.mkdtemp(prefix="pdb-", dir="/tmp"))
    model = make_tiny_model(tmp / "model", layers=args.layers, hidden=args.hidden, heads=8,
                            kv_heads=4, vocab=512, seed=0, max_position_embeddings=8192)
    run_dir = tmp / "run"
    daemon = launch.spawn(launch.daemon_argv(run_dir, budget=args.budget, page_size=64 << 10),
                          run_dir, tmp / "daemon.log", cwd=REPO)
    reqs = workload(args)
    warm = [r | {"at": 0.0, "prompt": [t + 1 for t in r["prompt"]]}  # no cache hits
            for r in (reqs[0], reqs[1])]  # one long (if any), one chat
    samples: dict[str, list[dict]] = {s: [] for s in setups}
    wall: dict[str, float] = {s: 0.0 for s in setups}
    per_round: list[dict] = []
    load_before = os.getloadavg()
    try:
        launch.wait_serving(daemon.popen, run_dir, tmp / "daemon.log", 30)
        for rnd in range(args.rounds):
            order = setups[rnd % len(setups):] + setups[:rnd % len(setups)]
            this: dict[str, dict] = {}
            for setup in order:
                load = os.getloadavg()[0]
                proc, url = start_server(model, run_dir, tmp / f"{setup}{rnd}.log",
                                         server_args(setup, cpus), args.kv)
                try:
                    asyncio.run(drive(url, warm))
                    got, secs = asyncio.run(drive(url, reqs))
                except Exception as e:  # noqa: BLE001 - say why, with the server's log
                    log = (tmp / f"{setup}{rnd}.log").read_text()[-3000:]
                    raise SystemExit(f"round {rnd} {setup} failed ({e!r}; server exit "
                                     f"status {proc.poll()}); its log:\n{log}") from None
                finally:
                    proc.terminate()
                    proc.wait(60)
                samples[setup] += got
                wall[setup] += secs
                this[setup] = metrics(got, secs) | {"load_1m": load}
                m = this[setup]
                print(f"round {rnd} {setup:<12} {secs:5.1f} s  load {load:4.1f}  "
                      f"chat itl p50/p99 {m['chat_itl_p50'] * 1e3:6.1f}/"
                      f"{m['chat_itl_p99'] * 1e3:6.1f} ms  ttft p50 "
                      f"{m['ttft_p50'] * 1e3:6.0f} ms", flush=True)
            per_round.append({s: {k: ratio(this["single"][k], this[s][k]) for k in HEADLINE}
                              for s in setups if s != "single"})
    finally:
        launch.stop(daemon.popen)
        shutil.rmtree(tmp, ignore_errors=True)
    load_after = os.getloadavg()
    rows = {s: metrics(samples[s], wall[s]) for s in setups}
    ratios = {s: {k: ratio(rows["single"][k], rows[s][k]) for k in rows["single"]}
              for s in setups if s != "single"}
    pairs = [s for s in setups if s != "single"]
    print(f"\n{'metric':<15}{'single':>11}" + "".join(f"{s:>13}{'/single':>9}" for s in pairs))
    for k, a in rows["single"].items():
        if a is None:  # no long requests
            continue
        scale, unit = (1.0, "") if k in ("tokens_per_s", "wall_s") else (1e3, " ms")
        line = f"{k:<15}{a * scale:>9.1f}{unit:<3}"
        for s in pairs:
            b = rows[s][k] or 0.0
            line += f"{b * scale:>10.1f}{unit:<3}{ratios[s][k] or 0:>8.2f}x"
        print(line)
    single = rows["single"]
    print(f"\nsingle engine's chat stall: itl p99/p50 "
          f"{single['chat_itl_p99'] / single['chat_itl_p50']:.1f}x, "
          f"tpot p99/p50 {single['chat_tpot_p99'] / single['chat_tpot_p50']:.1f}x")
    kinds = {k: sum(r["kind"] == k for r in reqs) for k in ("long", "chat")}
    path = write_result("pd_bench", {
        "args": vars(args), "cpus": cpus,
        "workload": {**kinds, "long_prompt_tokens": [len(r["prompt"]) for r in reqs
                                                     if r["kind"] == "long"],
                     "chat_prompt_tokens_mean": sum(len(r["prompt"]) for r in reqs
                                                    if r["kind"] == "chat") / kinds["chat"],
                     "output_tokens": sum(r["max_tokens"] for r in reqs)},
        "setup_args": {s: server_args(s, cpus) for s in setups},
        "setups": rows, "over_single": ratios, "per_round_over_single": per_round,
        "load_before": load_before, "load_after": load_after,
        "note": "TTFT over all requests; chat TPOT = each chat request's mean time per "
                "output token; chat ITL = gaps between consecutive streamed tokens of chat "
                "requests (a stall shows here); tokens_per_s = output tokens / wall time of "
                "the open-loop run (the offered load while a setup keeps up); every server "
                "has the same --kv-cache-size and they share one daemon budget"}, args.out)
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
