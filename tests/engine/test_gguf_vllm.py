"""vLLM (CPU build) loads the checkpoint converted from the real GGUF file (SmolLM2) and its
greedy completion equals the bundled engine's. One server start: tens of seconds to
minutes on two shared cores, hence slow."""

from __future__ import annotations

from pathlib import Path

import pytest
from real_model import smollm2_dir  # noqa: F401  (session fixture)

pytest.importorskip("vllm")

from adapters.vllm_procs import VllmServers, complete  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.real_model, pytest.mark.timeout(900)]
PROMPTS = ["The capital of France is", "Once upon a time, there was a little robot who"]
MAX_TOKENS = 16


def test_vllm_serves_converted_smollm2_like_the_engine(smollm2_dir: Path,  # noqa: F811
                                                       tmp_path: Path) -> None:
    from kvpool.engine import LLM, SamplingParams

    llm = LLM(str(smollm2_dir), num_kv_blocks=32)
    ours = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                ignore_eos=True))
    del llm
    servers = VllmServers(smollm2_dir, tmp_path)
    s = servers.start("smollm2", None, cpu=0, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    try:
        servers.wait_healthy(timeout=800)
        for p, o in zip(PROMPTS, ours):
            got = complete(s.base, "smollm2", p, MAX_TOKENS)["choices"][0]
            assert got["token_ids"] == o.output_token_ids, (p, got["text"], o.text)
            assert got["text"] == o.text
    finally:
        servers.close()
