"""One engine with both phases vs a prefill/decode pair (`kvpool serve --pd`) on the same
cores and KV memory: TTFT and TPOT p50/p99 for a mix of long-prompt (Azure code trace)
and chat (Azure conversation trace) requests, sent at a fixed rate, streamed.

Both setups are elastic bundled servers on one kvpool daemon (host backend); runs are
interleaved (single, pair, single, pair, ...) and the table shows each metric of the pair
as a ratio of the single engine's. Prompts are random token ids of the traces' context
lengths (scaled by --scale, capped at --max-prompt) on a synthetic model
(`kvpool make-model`-style, --layers/--hidden), so the numbers say how the two setups
schedule, not how fast a real model is.

    python benchmarks/pd_bench.py --requests 32 --rate 4 --rounds 2
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


def trace(name: str, n: int, scale: float, cap: int, out_cap: int) -> list[tuple[int, int]]:
    rows = []
    with open(DATA / f"azure_llm_2023_{name}.csv") as f:
        for r in csv.DictReader(f):
            rows.append((max(4, min(cap, int(int(r["ContextTokens"]) * scale))),
                         max(2, min(out_cap, int(r["GeneratedTokens"])))))
            if len(rows) >= n:
                break
    return rows


def workload(args) -> list[dict]:
    longs = trace("code", args.requests, args.scale, args.max_prompt, 16)
    chats = trace("conv", args.requests, args.scale / 4, 256, args.max_output)
    rng = random.Random(0)
    reqs = []
    for i in range(args.requests):
        kind = "long" if i % 4 == 0 else "chat"
        n, out = (longs if kind == "long" else chats)[i]
        reqs.append({"kind": kind, "prompt": [rng.randrange(8, 500) for _ in range(n)],
                     "max_tokens": out, "at": i / args.rate})
    return reqs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, run_dir: Path, log: Path, pd: bool, kv: str):
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")},
           "KVPOOL_RUN_DIR": str(run_dir), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "kvpool.cli.main", "serve", str(model), "--port", str(port),
           "--kv-cache-size", kv, "--log-level", "warning", "--served-model-name", "m",
           *(["--pd"] if pd else ["--elastic"])]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                            cwd=REPO)
    import httpx

    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit("server did not start")


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
    return {"kind": r["kind"], "ttft": ttft, "tpot": tpot, "tokens": len(times)}


async def drive(url: str, reqs: list[dict]) -> tuple[list[dict], float]:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        out = await asyncio.gather(*(one(client, url, r, t0) for r in reqs))
        return list(out), time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--scale", type=float, default=0.25, help="context length factor")
    ap.add_argument("--max-prompt", type=int, default=1500)
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--kv", default="64MiB")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from kvpool import launch
    from kvpool.engine.tiny import make_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="pdb-", dir="/tmp"))
    model = make_tiny_model(tmp / "model", layers=args.layers, hidden=args.hidden, heads=8,
                            kv_heads=4, vocab=512, seed=0)
    run_dir = tmp / "run"
    daemon = launch.spawn(launch.daemon_argv(run_dir, budget="512MiB", page_size=64 << 10),
                          run_dir, tmp / "daemon.log", cwd=REPO)
    reqs = workload(args)
    samples: dict[str, list[dict]] = {"single": [], "pair": []}
    wall: dict[str, list[float]] = {"single": [], "pair": []}
    try:
        launch.wait_serving(daemon.popen, run_dir, tmp / "daemon.log", 30)
        for rnd in range(args.rounds):
            for setup in ("single", "pair"):
                proc, url = start_server(model, run_dir, tmp / f"{setup}{rnd}.log",
                                         setup == "pair", args.kv)
                try:
                    asyncio.run(drive(url, reqs[:2]))  # warm-up
                    got, secs = asyncio.run(drive(url, reqs))
                finally:
                    proc.terminate()
                    proc.wait(60)
                samples[setup] += got
                wall[setup].append(secs)
                print(f"round {rnd} {setup}: {secs:.1f} s", flush=True)
    finally:
        launch.stop(daemon.popen)
        shutil.rmtree(tmp, ignore_errors=True)
    rows = {}
    for setup, got in samples.items():
        chat = [g for g in got if g["kind"] == "chat"]
        toks = sum(g["tokens"] for g in got)
        rows[setup] = {
            "ttft_p50": pct([g["ttft"] for g in got], 0.5),
            "ttft_p99": pct([g["ttft"] for g in got], 0.99),
            "tpot_p50": pct([g["tpot"] for g in chat], 0.5),
            "tpot_p99": pct([g["tpot"] for g in chat], 0.99),
            "tokens_per_s": toks / sum(wall[setup]),
        }
    print(f"\n{'metric':<14}{'single':>12}{'pair':>12}{'pair/single':>14}")
    ratios = {}
    for k in rows["single"]:
        a, b = rows["single"][k], rows["pair"][k]
        ratios[k] = b / a if a and b else None
        unit = "" if k == "tokens_per_s" else " s"
        print(f"{k:<14}{a:>10.4f}{unit:<2}{b:>10.4f}{unit:<2}{ratios[k] or 0:>12.2f}x")
    path = write_result("pd_bench", {"args": vars(args), "setups": rows,
                                     "pair_over_single": ratios,
                                     "note": "TPOT over chat requests; TTFT over all; "
                                             "same cores, same daemon budget"}, args.out)
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
