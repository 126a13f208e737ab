"""The policy a training loop updates (``kvpool demo --scenario train``): a dense
Llama-family checkpoint (kvpool's tiny models, SmolLM2) as a plain torch module whose
parameters are named as the checkpoint's tensors, for full-sequence log-probabilities and
their gradients (the bundled engine's model computes over a paged KV cache; it does not
train). Written with torch and safetensors only.

:meth:`Policy.load` reads a checkpoint folder; :meth:`Policy.save` writes one the engine
loads (the same tensor names, the other files copied), so the engine's weights after a
publish are exactly the trainer's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

WEIGHTS = "model.safetensors"


class Policy(torch.nn.Module):
    """A dense Llama (RMSNorm, rotary positions, grouped-query attention, SwiGLU), float32,
    over the tensors of ``config`` (a checkpoint's config.json)."""

    def __init__(self, config: dict[str, object], tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.config = config
        self.names = sorted(tensors)
        self.params = torch.nn.ParameterList(
            torch.nn.Parameter(tensors[n].float().clone()) for n in self.names)
        self._index = {n: i for i, n in enumerate(self.names)}
        self.layers = int(str(config["num_hidden_layers"]))
        self.heads = int(str(config["num_attention_heads"]))
        self.kv_heads = int(str(config.get("num_key_value_heads", self.heads)))
        hidden = int(str(config["hidden_size"]))
        self.head_dim = int(str(config.get("head_dim") or hidden // self.heads))
        self.eps = float(str(config.get("rms_norm_eps", 1e-6)))
        self.theta = float(str(config.get("rope_theta", 10000.0)))
        self.tied = "lm_head.weight" not in self._index

    @classmethod
    def load(cls, path: Path) -> Policy:
        config = json.loads((path / "config.json").read_text())
        with safe_open(str(path / WEIGHTS), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        return cls(config, tensors)

    def save(self, path: Path, source: Path) -> int:
        """Write the checkpoint folder ``path`` (``source``'s other files, these weights);
        returns the weights' bytes written."""
        path.mkdir(parents=True, exist_ok=True)
        for f in source.iterdir():
            if f.is_file() and f.name != WEIGHTS and not f.name.endswith(".kvpool-key.json"):
                shutil.copy2(f, path / f.name)
        tensors = {n: self.w(n).detach().clone().contiguous() for n in self.names}
        save_file(tensors, str(path / WEIGHTS))
        return sum(t.numel() * t.element_size() for t in tensors.values())

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)

    def w(self, name: str) -> torch.Tensor:
        t: torch.Tensor = self.params[self._index[name]]
        return t

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * self.w(name)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [batch, seq, vocab] of token ids [batch, seq] (causal)."""
        b, s = ids.shape
        x = self.w("model.embed_tokens.weight")[ids]
        inv = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        freqs = torch.outer(torch.arange(s).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        mask = torch.full((s, s), float("-inf")).triu(1)
        rep = self.heads // self.kv_heads
        for i in range(self.layers):
            pre = f"model.layers.{i}."
            h = self._norm(x, pre + "input_layernorm.weight")
            q = (h @ self.w(pre + "self_attn.q_proj.weight").T).view(b, s, self.heads, -1)
            k = (h @ self.w(pre + "self_attn.k_proj.weight").T).view(b, s, self.kv_heads, -1)
            v = (h @ self.w(pre + "self_attn.v_proj.weight").T).view(b, s, self.kv_heads, -1)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            att = (q @ k.transpose(-1, -2)) / self.head_dim ** 0.5 + mask
            o = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1)
            x = x + o @ self.w(pre + "self_attn.o_proj.weight").T
            h = self._norm(x, pre + "post_attention_layernorm.weight")
            gate = torch.nn.functional.silu(h @ self.w(pre + "mlp.gate_proj.weight").T)
            x = x + (gate * (h @ self.w(pre + "mlp.up_proj.weight").T)) \
                @ self.w(pre + "mlp.down_proj.weight").T
        x = self._norm(x, "model.norm.weight")
        head = self.w("model.embed_tokens.weight" if self.tied else "lm_head.weight")
        return x @ head.T

    def token_logprobs(self, prompt: list[int], outputs: list[list[int]]) -> torch.Tensor:
        """Log-probabilities [n, len] of each output's tokens after ``prompt`` (outputs
        of one length)."""
        ids = torch.tensor([prompt + o for o in outputs])
        logits = self(ids)[:, len(prompt) - 1:-1]
        lp = logits.log_softmax(-1)
        out: torch.Tensor = lp.gather(-1, ids[:, len(prompt):, None])[..., 0]
        return out
