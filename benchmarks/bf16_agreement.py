"""Greedy agreement of the bundled engine in bf16 with transformers in bf16 on a real
checkpoint folder (e.g. SmolLM2-135M-Instruct converted by ``kvpool make-model
--from-gguf``), over a fixed prompt set; fp32 engine vs transformers fp32 as the control.

Control: transformers' eager attention against its own sdpa references (the spread between
two correct bf16 implementations of the same model).

Teacher-forced agreement: at each position of transformers' greedy continuation, does the
engine's greedy token, given transformers' own prefix, equal it (after a mismatch the
engine restarts from the reference prefix). Free-running: position-by-position equality of
the two independent continuations.

    python benchmarks/bf16_agreement.py MODEL_DIR [--new 32]

Writes benchmarks/results/bf16_agreement.json (or --out). Offline (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Any

import torch
from common import write_result

from kvpool.engine import LLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from engine.helpers import agreement  # noqa: E402  (the test's own measure)

PROMPTS = (
    "The capital of France is",
    "Here is a short story about a robot who learns to paint:",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea,",
)


def _hf_control(auto: Any, model_dir: str, dtype: torch.dtype, ids: list[list[int]],
                refs: list[list[int]]) -> float:
    """The spread between two correct implementations: transformers' eager attention,
    teacher-forced on the references of its sdpa attention (one forward over prompt +
    reference; position i predicts reference token i from the reference's own prefix)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = auto.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").eval()
    ok = total = 0
    with torch.no_grad():
        for p, r in zip(ids, refs):
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1:-1].float()
            ok += sum(a == b for a, b in zip(logits.argmax(-1).tolist(), r))
            total += len(r)
    return ok / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    rows: dict[str, Any] = {}
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).eval()
        refs = []
        with torch.no_grad():
            for p in ids:
                out = ref.generate(torch.tensor([p]), max_new_tokens=args.new, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
                refs.append(out[0, len(p):].tolist())
        del ref
        control = _hf_control(AutoModelForCausalLM, args.model_dir, dtype, ids, refs)
        llm = LLM(args.model_dir, dtype=name, num_kv_blocks=256)
        forced, free = agreement(llm, ids, refs)
        rows[name] = {"teacher_forced": forced, "free_running": free,
                      "tokens": sum(len(r) for r in refs),
                      "attention_backend": llm.engine.runner.backend,
                      "control_transformers_eager_vs_sdpa": control}
        print(f"{name}: engine vs transformers {name}: {forced:.1%} teacher-forced, "
              f"{free:.1%} free-running over {rows[name]['tokens']} greedy tokens; control: "
              f"transformers eager vs its own sdpa {control:.1%}")
        del llm
    path = write_result("bf16_agreement", {"model_dir": os.path.basename(
        os.path.normpath(args.model_dir)), "prompts": list(PROMPTS), "new_tokens": args.new,
        "results": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
