"""Load a Hugging Face checkpoint folder: config.json + *.safetensors (sharded or not).

Mixture-of-Experts checkpoints come in two namings, both accepted (per layer): the
per-expert one transformers writes by default (``mlp.experts.{e}.gate_proj/up_proj/
down_proj.weight``, which is also our module layout; Mixtral's
``block_sparse_moe.experts.{e}.w1/w3/w2.weight``) and the fused one of transformers 5's
``save_original_format=False`` (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I]), whose per-expert slices are read straight from the
file.

Tensor parallelism: a model built for one rank of several
(:mod:`kvpool.engine.tp.layers`) says which part of each checkpoint tensor it holds
(:func:`~kvpool.engine.tp.layers.cut_of`); the loader reads that part only
(``safe_open(...).get_slice``: rows or columns, never the whole tensor), after checking
the whole tensor's shape from the file's header.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping, NamedTuple, cast

import torch
from safetensors import safe_open
from torch import nn

from kvpool.engine.tp.collective import SINGLE, Collective
from kvpool.engine.errors import CheckpointError
from kvpool.engine.model.layers import PackedLinear
from kvpool.engine.model.llama import LlamaForCausalLM
from kvpool.engine.model.config import ModelConfig
from kvpool.engine.tp.layers import Cut, cut_of

# Tensors some exporters write that carry no weights we need.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def find_shards(path: Path) -> list[Path]:
    """The safetensors files of a folder: those named by model.safetensors.index.json when
    present (every named shard must exist), else every ``*.safetensors``."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is malformed: {e!r}") from None
        shards = [path / f for f in sorted(set(weight_map.values()))]
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise CheckpointError(f"{path}: shard(s) named in {index.name} are missing: "
                                  f"{', '.join(missing)}")
        return shards
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        other = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = f" (found {', '.join(other)}; only safetensors are supported)" if other else ""
        raise CheckpointError(f"model folder {path} has no *.safetensors files{hint}")
    return shards


_MIXTRAL_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.weight$")
_MIXTRAL_PROJ = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def canonical_name(key: str) -> str:
    """A checkpoint tensor name as :func:`expected_tensors` spells it: Mixtral's original
    ``block_sparse_moe`` / ``w1 w2 w3`` become ``mlp`` / ``gate_proj down_proj up_proj``;
    every other name is unchanged."""
    if ".block_sparse_moe." not in key:
        return key
    key = key.replace(".block_sparse_moe.", ".mlp.")
    return _MIXTRAL_EXPERT.sub(
        lambda m: f".experts.{m.group(1)}.{_MIXTRAL_PROJ[m.group(2)]}.weight", key)


class Source(NamedTuple):
    """Where a canonical tensor lies: ``key`` in ``shard``; for a fused expert tensor,
    expert ``expert``'s rows ``rows`` of it (None: the whole tensor)."""

    shard: Path
    key: str
    expert: int | None = None
    rows: slice | None = None

    def read(self, f: Any, cut: Cut | None = None) -> torch.Tensor:
        """The tensor, or (``cut``) this rank's part of it (never an expert's)."""
        if cut is not None:
            assert self.expert is None, "Mixture-of-Experts models are not split"
            part = slice(cut.start, cut.start + cut.length)
            sl = f.get_slice(self.key)
            return cast(torch.Tensor, sl[part] if cut.dim == 0 else sl[:, part])
        if self.expert is None:
            return cast(torch.Tensor, f.get_tensor(self.key))
        return cast(torch.Tensor, f.get_slice(self.key)[self.expert, self.rows or slice(None)])

    def shape(self, f: Any) -> tuple[int, ...]:
        """The whole tensor's shape (an expert's rows for a fused expert tensor)."""
        shape = tuple(f.get_slice(self.key).get_shape())
        if self.expert is None:
            return shape
        rows = self.rows or slice(None)
        return (len(range(shape[1])[rows]), *shape[2:])


def sources(shard: Path, key: str, shape: list[int]) -> dict[str, Source]:
    """The canonical tensors ``key`` (of ``shape``) holds: itself, or for transformers 5's
    fused ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj`` [E, H, I], every
    expert's ``gate_proj``/``up_proj``/``down_proj`` weight."""
    prefix, _, leaf = key.rpartition(".")
    if not prefix.endswith(".experts") or leaf not in ("gate_up_proj", "down_proj") \
            or len(shape) != 3:
        return {canonical_name(key): Source(shard, key)}
    out = {}
    for e in range(shape[0]):
        if leaf == "down_proj":
            out[f"{prefix}.{e}.down_proj.weight"] = Source(shard, key, e)
        else:
            i = shape[1] // 2
            out[f"{prefix}.{e}.gate_proj.weight"] = Source(shard, key, e, slice(0, i))
            out[f"{prefix}.{e}.up_proj.weight"] = Source(shard, key, e, slice(i, 2 * i))
    return out


class Target(NamedTuple):
    """Where a checkpoint tensor goes: rows ``[offset, offset + rows)`` of our parameter
    ``param``; ``cut``: the part of the tensor this rank holds (None: all of it)."""

    param: str
    offset: int
    rows: int
    cut: Cut | None = None


def expected_tensors(model: LlamaForCausalLM) -> dict[str, Target]:
    """Checkpoint tensor name (canonical, see :func:`canonical_name`) -> its
    :class:`Target` for every tensor the model needs. A tied lm_head is absent: it shares
    the embedding's parameter. Experts are named per expert."""
    modules = dict(model.named_modules())
    out: dict[str, Target] = {}
    for name, param in model.named_parameters():  # shared (tied) parameters listed once
        mod_name, _, leaf = name.rpartition(".")
        mod = modules[mod_name]
        if isinstance(mod, PackedLinear):
            parent = mod_name.rpartition(".")[0]
            offset = 0
            for part, rows in mod.parts:
                out[f"{parent}.{part}.{leaf}"] = Target(name, offset, rows,
                                                        cut_of(mod, leaf, rows))
                offset += rows
        else:
            out[name] = Target(name, 0, param.shape[0], cut_of(mod, leaf, param.shape[0]))
    return out


class Plan(NamedTuple):
    """What :func:`fill` reads: the checkpoint folder, canonical tensor name -> its
    :class:`Target`, and where each tensor lies."""

    path: Path
    expected: dict[str, Target]
    where: dict[str, Source]


def meta_model(config: ModelConfig, tp: Collective = SINGLE) -> LlamaForCausalLM:
    """The model's modules with storage-less (meta) parameters: their names and shapes,
    for :func:`check_checkpoint` and for placing the parameters somewhere. ``tp``: the
    rank's collective, for one rank's share of a tensor-parallel model."""
    with torch.device("meta"):
        return LlamaForCausalLM(config, tp)


def check_checkpoint(path: str | Path, model: LlamaForCausalLM,
                     config: ModelConfig) -> Plan:
    """Match the folder's tensors (headers only, no tensor bytes read) to ``model``'s
    parameters.

    Raises:
        CheckpointError: missing shards, unreadable files, missing or unexpected tensors
            (the message lists them).
    """
    path = Path(path)
    shards = find_shards(path)
    expected = expected_tensors(model)
    where: dict[str, Source] = {}  # canonical name -> where it lies
    for shard in shards:
        try:
            with safe_open(shard, framework="pt") as f:
                for key in f.keys():
                    where |= sources(shard, key, f.get_slice(key).get_shape())
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"cannot read {shard}: {e}") from None
    present = {k for k in where if not k.endswith(_IGNORED_SUFFIXES)}
    if config.tie_word_embeddings:
        present.discard("lm_head.weight")  # some exporters keep the tied copy; it is redundant
    missing = sorted(set(expected) - present)
    unexpected = sorted(present - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensor(s): {_names(missing)}")
        if unexpected:
            parts.append(f"unexpected tensor(s): {_names(unexpected)}")
        raise CheckpointError(f"{path} does not match its config.json "
                              f"(model_type={config.model_type}): " + "; ".join(parts))
    return Plan(path, expected, where)


def fill(plan: Plan, params: Mapping[str, torch.Tensor]) -> None:
    """Copy every checkpoint tensor into its rows of ``params[name]`` (converted to that
    tensor's dtype): the model's own parameters, or tensors over other storage.

    Raises:
        CheckpointError: a tensor whose shape differs from what config.json implies.
    """
    by_shard: dict[Path, list[str]] = {}
    for name in plan.expected:
        by_shard.setdefault(plan.where[name].shard, []).append(name)
    with torch.no_grad():
        for shard, names in by_shard.items():
            with safe_open(shard, framework="pt") as f:
                for name in names:
                    pname, offset, rows, cut = plan.expected[name]
                    param = params[pname]
                    src = plan.where[name]
                    key = src.key if src.expert is None else f"{src.key}[{src.expert}]"
                    want = _whole_shape(rows, tuple(param.shape[1:]), cut)
                    have = src.shape(f)
                    if have != want:
                        raise CheckpointError(f"{shard.name}: tensor {key} has shape "
                                              f"{have}, config.json implies {want}")
                    dst = param[offset:offset + rows]
                    if cut is not None and cut.zeros:
                        dst.zero_()
                    else:
                        dst.copy_(src.read(f, cut).to(param.dtype))


def place(model: LlamaForCausalLM, tensors: Mapping[str, torch.Tensor]) -> LlamaForCausalLM:
    """Make ``tensors`` (one per name of ``model.named_parameters()``, same shape) the
    model's parameters, used in place (no copy, no grad); ties the embeddings again.
    Returns the model in eval mode."""
    modules = dict(model.named_modules())
    names = [n for n, _ in model.named_parameters()]
    if sorted(names) != sorted(tensors):
        raise ValueError("the tensors do not name the model's parameters")
    for name in names:
        mod_name, _, leaf = name.rpartition(".")
        t = tensors[name]
        if tuple(t.shape) != tuple(modules[mod_name].get_parameter(leaf).shape):
            raise ValueError(f"{name}: shape {tuple(t.shape)} is not the parameter's")
        modules[mod_name].register_parameter(leaf, nn.Parameter(t, requires_grad=False))
    model.tie_weights()
    return model.eval()


def load_model(path: str | Path, device: torch.device, dtype: torch.dtype,
               config: ModelConfig | None = None, tp: Collective = SINGLE
               ) -> LlamaForCausalLM:
    """Build the model on ``device`` in ``dtype`` and fill every parameter from the folder;
    with ``tp`` of several ranks, this rank's share only (see the module).

    Raises:
        CheckpointError: missing config/shards, missing or unexpected tensors (the message
            lists them), or a tensor whose shape differs from what config.json implies.
        ValueError: a model that does not split ``tp.size`` ways (one line).
    """
    path = Path(path)
    config = config or ModelConfig.from_dir(path)
    model = meta_model(config, tp)
    plan = check_checkpoint(path, model, config)
    model = model.to_empty(device=device).to(dtype)
    model.tie_weights()  # to_empty replaced the shared parameter by two copies
    fill(plan, dict(model.named_parameters()))
    return model.eval()


def _whole_shape(rows: int, rest: tuple[int, ...], cut: Cut | None) -> tuple[int, ...]:
    """The checkpoint tensor's shape a parameter part of ``rows`` x ``rest`` implies."""
    if cut is None or cut.zeros:
        return (rows, *rest)
    if cut.dim == 0:
        return (rows * cut.size, *rest)
    return (rows, rest[0] * cut.size, *rest[1:])


def _names(names: list[str], limit: int = 8) -> str:
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
