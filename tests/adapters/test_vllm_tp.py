"""vLLM with tensor parallelism on kvpool (issue 26, scope 4): the test for a machine
and an adapter that can run it.

Recorded on this project's 2-core CPU host (vLLM 0.32.0 CPU, tiny llama, 4 heads / 2 KV
heads):

* ``python -m vllm.entrypoints.openai.api_server --model TINY --tensor-parallel-size 2
  --enforce-eager --max-model-len 512 --dtype float32 --max-num-seqs 8`` with
  ``VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1``: the engine core fails at start,
  ``AssertionError: Not enough allowed NUMA nodes to bind threads of 2 local
  CPUWorkers. Allowed NUMA nodes are [0].`` (vLLM's thread auto-binding).
* the same with ``VLLM_CPU_OMP_THREADS_BIND="0|1"`` (one core per rank): healthy after
  about 200 s on the loaded machine, greedy completions served by the multiprocess
  executor (gloo between the two CPU workers).
* the same with ``KVPOOL_ENABLE=1``: refused before the engine starts, one line:
  ``kvpool: KVPOOL_ENABLE=1 serves one rank per vLLM server for now; got tensor-parallel
  2, whose KV grants are not yet mapped in every worker before the scheduler uses them
  (...)`` (``vllm/checks.parallel_refusal``; tested in test_vllm.py and
  test_vllm_gang_group.py).

The refusal is not lifted yet (docs/VLLM-ADAPTER.md, "Tensor parallelism": what lifting
it needs). The scheduler-side seam exists (``vllm/gang_group.py``: the allocator's grants
and releases applied on every rank, tested in test_vllm_gang_group.py). This test is what it must pass: a TP=2 vLLM server on a two-device daemon is
one gang (the same bytes on both devices), serves the greedy tokens of a plain TP=2
vLLM, and gives everything back. It runs only with ``KVPOOL_TEST_VLLM_TP=1`` (minutes on
two cores: two TP=2 vLLM servers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from .vllm_procs import (PROMPTS, VllmServers, complete, remove_daemon, start_daemon,
                         vllm_available)

pytestmark = [
    pytest.mark.slow, pytest.mark.timeout(1800),
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
    pytest.mark.skipif(os.environ.get("KVPOOL_TEST_VLLM_TP") != "1",
                       reason="vLLM TP=2 on kvpool: the adapter still refuses more than one "
                              "rank; set KVPOOL_TEST_VLLM_TP=1 where it is lifted (minutes)"),
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
        elastic = s.start("tp", d.run_dir, TP2, **BIND)
        s.wait_healthy(elastic, timeout=900)
        got = [complete(elastic.base, "tp", p, 64)["choices"][0]["token_ids"]
               for p in PROMPTS[:4]]
        assert got == want
        held = [mapped(d.run_dir, "tp", dev) for dev in (0, 1)]
        assert held[0] == held[1] > 0, held
    finally:
        s.close()
        remove_daemon(d)
