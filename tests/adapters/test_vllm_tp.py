"""vLLM with tensor parallelism on kvpool (issue 26, scope 4; docs/VLLM-ADAPTER.md,
"Tensor parallelism"): a TP=2 vLLM server on a two-device daemon is one gang (the same
bytes on both devices), serves the greedy tokens of a plain TP=2 vLLM, and gives
everything back (nothing held once it stopped, ``kvpool check`` clean on both devices).

On this project's 2-core CPU host (vLLM 0.32.0 CPU, tiny llama, 4 heads / 2 KV heads),
vLLM's TP=2 needs ``VLLM_CPU_OMP_THREADS_BIND="0|1"`` (else: ``AssertionError: Not
enough allowed NUMA nodes to bind threads of 2 local CPUWorkers``). It runs only with
``KVPOOL_TEST_VLLM_TP=1`` (two TP=2 vLLM servers: about two minutes on two cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from .vllm_procs import (PROMPTS, VllmServers, complete, remove_daemon, start_daemon,
                         vllm_available)

pytestmark = [
    pytest.mark.slow, pytest.mark.timeout(1800),
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
    pytest.mark.skipif(os.environ.get("KVPOOL_TEST_VLLM_TP") != "1",
                       reason="vLLM TP=2 on kvpool: two TP=2 vLLM servers (minutes on two "
                              "cores); set KVPOOL_TEST_VLLM_TP=1"),
]
TP2 = ("--tensor-parallel-size", "2")
BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # vLLM's auto-binding needs a NUMA node per rank


def mapped(run_dir, name: str, device: int) -> int:  # noqa: ANN001
    out = subprocess.run([sys.executable, "-m", "kvpool.cli.main", "ps", "--json",
                          "--run-dir", str(run_dir), "--device", str(device)],
                         capture_output=True, text=True, timeout=60, check=True)
    return sum(t["mapped"] for t in json.loads(out.stdout)["tenants"] if t["name"] == name)


def test_vllm_tp2_is_one_gang_with_plain_tp2_greedy_tokens(tiny_model, tmp_path):
    d = start_daemon(budget="4MiB", extra=("--devices", "2", "--reclaim-timeout", "60"))
    s = VllmServers(tiny_model, tmp_path)
    try:
        plain = s.start("plain", None, TP2, **BIND)
        s.wait_healthy(plain, timeout=900)
        want = [complete(plain.base, "plain", p, 64)["choices"][0]["token_ids"]
                for p in PROMPTS[:4]]
        s.close()
        # no idle trim while the two devices are read one after the other
        elastic = s.start("tp", d.run_dir, TP2, KVPOOL_IDLE_TIMEOUT="600", **BIND)
        s.wait_healthy(elastic, timeout=900)
        got = [complete(elastic.base, "tp", p, 64)["choices"][0]["token_ids"]
               for p in PROMPTS[:4]]
        assert got == want
        held = [mapped(d.run_dir, "tp", dev) for dev in (0, 1)]
        assert held[0] == held[1] > 0, held
        s.close()
        deadline = time.monotonic() + 120
        while any(mapped(d.run_dir, "tp", dev) for dev in (0, 1)):
            assert time.monotonic() < deadline, "the stopped server still holds KV pages"
            time.sleep(0.5)
        for dev in (0, 1):
            r = subprocess.run([sys.executable, "-m", "kvpool.cli.main", "check",
                                "--run-dir", str(d.run_dir), "--device", str(dev)],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, r.stdout + r.stderr
    finally:
        s.close()
        remove_daemon(d)
