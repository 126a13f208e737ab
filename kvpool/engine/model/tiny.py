"""Tiny random-weight Llama-family checkpoints (Mixture-of-Experts ones too: Mixtral,
Qwen2-MoE, Qwen3-MoE) with a trained ByteLevel BPE tokenizer.

Written with safetensors + tokenizers only (no transformers), in the Hugging Face layout,
so tests, demos and benchmarks run offline. ``initializer_range`` 0.2 (not the usual
0.02) keeps greedy outputs varied instead of collapsing onto a few tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from safetensors.torch import save_file

if TYPE_CHECKING:
    from tokenizers import Tokenizer

EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

CORPUS = """\
The quick brown fox jumps over the lazy dog. A small engine keeps its memory in blocks,
and every block holds the keys and values of a few tokens for every layer of the model.
When a request arrives, the scheduler looks for blocks that already hold the same prefix,
reuses them, and computes only what is new. When memory runs short, the newest request
steps back, frees its blocks, and starts again later; no request is lost.
Once upon a time there was a little cat who lived in a house by the river. Every morning
the cat walked to the water, looked at the fish, and went home again for breakfast.
One day the river was quiet and the sky was grey. The cat sat on a stone and waited.
A bird came and sang a song about the sea, the hills, the wind and the rain.
The weather today is sunny with a light breeze from the west. Tomorrow will bring clouds
in the morning and showers in the afternoon, with temperatures falling in the evening.
Please write a short story about a robot who learns to paint. The robot painted the sun,
the moon and the stars, and then it painted the people of the town, one by one.
Question: What is the capital of France? Answer: The capital of France is Paris.
Question: How many days are in a week? Answer: There are seven days in a week.
Question: What color is the sky on a clear day? Answer: The sky is blue.
Hello! How are you today? I am fine, thank you. What would you like to talk about?
Let me explain how memory sharing works. Several servers run on one machine, and each of
them reserves a large range of addresses but backs it with real pages only while it needs
them. A daemon owns the pages, hands them out on demand, and takes them back later.
Numbers: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve.
Colors: red, orange, yellow, green, blue, indigo, violet, black, white, brown, pink.
Animals: cat, dog, horse, cow, sheep, goat, bird, fish, mouse, rabbit, lion, tiger.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))
"""


def train_tokenizer(vocab_size: int, corpus: str = CORPUS) -> Tokenizer:
    """A ByteLevel BPE (GPT-2 style) over ``corpus`` with <|endoftext|> and ChatML tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS, IM_START, IM_END], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = corpus.splitlines()
    tok.train_from_iterator(lines * 4, trainer)
    return tok


Arch = Literal["llama", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe"]
ARCHS: tuple[str, ...] = get_args(Arch)
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")
_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
            "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def make_tiny_model(path: str | Path, *, layers: int = 2, hidden: int = 128,
                    heads: int = 4, kv_heads: int = 2, head_dim: int | None = None,
                    intermediate: int | None = None, vocab: int = 512,
                    arch: Arch = "llama", seed: int = 0,
                    max_position_embeddings: int = 2048, initializer_range: float = 0.2,
                    tie_word_embeddings: bool | None = None, num_experts: int = 8,
                    experts_per_token: int = 2, expert_intermediate: int | None = None
                    ) -> Path:
    """Write config.json, generation_config.json, model.safetensors, tokenizer.json and
    tokenizer_config.json into ``path`` (created); returns the path.

    ``arch`` qwen2 adds q/k/v biases; qwen3 adds q/k RMSNorm and ties the embeddings
    (``lm_head.weight`` is then absent from the file, as in real Qwen3 small models).
    The Mixture-of-Experts archs route each token to ``experts_per_token`` of
    ``num_experts`` experts on every layer: mixtral (experts of ``intermediate``, top-k
    renormalised), qwen2_moe (as qwen2, experts of ``expert_intermediate`` [hidden / 2]
    plus a shared expert of 4x that, top-k not renormalised), qwen3_moe (as qwen3 but
    untied, top-k renormalised). Expert tensors get the per-expert names transformers
    writes (Mixtral: ``block_sparse_moe.experts.{e}.w1/w2/w3``).
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, not {arch!r}")
    if arch in MOE_ARCHS and not 0 < experts_per_token <= num_experts:
        raise ValueError(f"experts_per_token must be in 1..num_experts ({num_experts})")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab)
    assert tok.get_vocab_size() <= vocab
    tok.save(str(path / "tokenizer.json"))
    eos_id = tok.token_to_id(EOS)
    head_dim = head_dim or hidden // heads
    intermediate = intermediate or 2 * hidden
    tie = (arch == "qwen3") if tie_word_embeddings is None else tie_word_embeddings
    config: dict[str, Any] = {
        "architectures": [_CLASSES[arch]],
        "model_type": arch, "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": 10000.0,  # transformers 4.x form; 5.x reads it too
        "attention_bias": False, "tie_word_embeddings": tie, "initializer_range":
        initializer_range, "bos_token_id": eos_id, "eos_token_id": eos_id, "dtype": "float32",
        "torch_dtype": "float32",
    }
    if arch in MOE_ARCHS:
        config |= _moe_config(arch, num_experts, experts_per_token,
                              expert_intermediate or max(8, hidden // 2))
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": eos_id, "eos_token_id": eos_id}, indent=2) + "\n")
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": EOS,
         "model_max_length": max_position_embeddings}, indent=2) + "\n")
    save_file(random_weights(config, seed, arch), str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path


def _moe_config(arch: str, experts: int, top_k: int, expert_intermediate: int
                ) -> dict[str, Any]:
    """The config.json keys of the MoE archs, as transformers' config classes name them."""
    if arch == "mixtral":
        return {"num_local_experts": experts, "num_experts_per_tok": top_k,
                "sliding_window": None, "router_jitter_noise": 0.0}
    c: dict[str, Any] = {
        "num_experts": experts, "num_experts_per_tok": top_k,
        "moe_intermediate_size": expert_intermediate, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "use_sliding_window": False,
        "norm_topk_prob": arch == "qwen3_moe"}
    if arch == "qwen2_moe":
        c |= {"shared_expert_intermediate_size": 4 * expert_intermediate, "qkv_bias": True}
    return c


def random_weights(c: Mapping[str, Any], seed: int, arch: str = "llama",
                   dtype: torch.dtype = torch.float32, device: str = "cpu"
                   ) -> dict[str, torch.Tensor]:
    """Random weights for config ``c`` (drawn on ``device``, returned on the CPU); the
    defaults give the tiny checkpoints' exact bytes."""
    g = torch.Generator(device=device).manual_seed(seed)
    std = c["initializer_range"]
    h, hd, inter = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=dtype).mul_(std).cpu()

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    w = {"model.embed_tokens.weight": normal(c["vocab_size"], h),
         "model.norm.weight": ones(h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": normal(q, h),
              p + "self_attn.k_proj.weight": normal(kv, h),
              p + "self_attn.v_proj.weight": normal(kv, h),
              p + "self_attn.o_proj.weight": normal(h, q),
              **(_moe_weights(c, arch, p, normal) if arch in MOE_ARCHS else {
                  p + "mlp.gate_proj.weight": normal(inter, h),
                  p + "mlp.up_proj.weight": normal(inter, h),
                  p + "mlp.down_proj.weight": normal(h, inter)}),
              p + "input_layernorm.weight": ones(h),
              p + "post_attention_layernorm.weight": ones(h)}
        if arch in ("qwen2", "qwen2_moe"):
            w |= {p + "self_attn.q_proj.bias": normal(q), p + "self_attn.k_proj.bias": normal(kv),
                  p + "self_attn.v_proj.bias": normal(kv)}
        if arch in ("qwen3", "qwen3_moe"):
            w |= {p + "self_attn.q_norm.weight": ones(hd),
                  p + "self_attn.k_norm.weight": ones(hd)}
    if not c["tie_word_embeddings"]:
        w["lm_head.weight"] = normal(c["vocab_size"], h)
    return {k: v.contiguous() for k, v in w.items()}


def _moe_weights(c: Mapping[str, Any], arch: str, p: str,
                 normal: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
    """One sparse layer's router, experts (per-expert names) and shared expert."""
    h = c["hidden_size"]
    if arch == "mixtral":
        e, i, m = c["num_local_experts"], c["intermediate_size"], p + "block_sparse_moe."
        w = {m + "gate.weight": normal(e, h)}
        for j in range(e):
            w |= {f"{m}experts.{j}.w1.weight": normal(i, h),
                  f"{m}experts.{j}.w2.weight": normal(h, i),
                  f"{m}experts.{j}.w3.weight": normal(i, h)}
        return w
    e, i, m = c["num_experts"], c["moe_intermediate_size"], p + "mlp."
    w = {m + "gate.weight": normal(e, h)}
    for j in range(e):
        w |= {f"{m}experts.{j}.gate_proj.weight": normal(i, h),
              f"{m}experts.{j}.up_proj.weight": normal(i, h),
              f"{m}experts.{j}.down_proj.weight": normal(h, i)}
    shared = c.get("shared_expert_intermediate_size", 0)
    if shared:
        w |= {m + "shared_expert.gate_proj.weight": normal(shared, h),
              m + "shared_expert.up_proj.weight": normal(shared, h),
              m + "shared_expert.down_proj.weight": normal(h, shared),
              m + "shared_expert_gate.weight": normal(1, h)}
    return w
