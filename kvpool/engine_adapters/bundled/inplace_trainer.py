"""A trainer's parameters in place in the bundled engine's weights: a mutable weight set
laid out exactly as the engine's :class:`~kvpool.engine_adapters.bundled.weights.PoolWeights`
(its dtype, its packed parameters), the trainer's tensors views into it, each optimizer
step written into the back buffer and published (docs/ARCHITECTURE.md, "Mutable weight
sets"; the daemon's fence: :mod:`kvpool.daemon.weight_fence`).

    placed = placement(model_dir, torch.float32, dict(policy.named_tensors()))
    if isinstance(placed, str): ...                  # why not: publish checkpoints instead
    w = InPlaceWeights.create(trainer.tenant, placed, params)  # params: name -> Parameter
    version = w.step(adam)                           # the update, written to the back buffer
    # then tell the engine: POST /kvpool/weights {"mutable": w.nonce, "version": version}

The engine packs some checkpoint tensors into one parameter (q, k, v; gate, up): a
checkpoint tensor is a run of whole rows of it, so it is one contiguous slice of the set
(:func:`placement`). Version ``v``'s parameters are the buffer the trainer's tensors
point at; :meth:`InPlaceWeights.step` computes Adam's update from them (and the
gradients) *into* the back buffer (``torch.addcdiv(param, m, denom, out=back)``: the
update's own output, no copy of the weights), publishes, and points the parameters at
the new version (``param.data = view``: the same ``Parameter`` objects, so the optimizer
state stays keyed). Creating the set loads both buffers once (the only copy); a publish
copies nothing. Adam without ``amsgrad``/``maximize``/decoupled decay only (the loop's).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from kvpool.client_lib.mutable_weights import MutableWriter
from kvpool.client_lib.tensors import tensor_view
from kvpool.client_lib.weights import WeightSession
from kvpool.engine.model import loader
from kvpool.engine.model.config import ModelConfig
from kvpool.engine_adapters.bundled.weights import Layout, mutable_key


@dataclass(frozen=True)
class Placement:
    """Where each checkpoint tensor lies in one buffer of the engine's layout: name ->
    (byte offset, shape)."""

    layout: Layout
    where: dict[str, tuple[int, tuple[int, ...]]]


def placement(model_dir: Path, dtype: torch.dtype,
              tensors: Mapping[str, torch.Tensor]) -> Placement | str:
    """The engine's layout (the model of ``model_dir`` in ``dtype``) over the trainer's
    ``tensors`` (checkpoint name -> tensor), or why they cannot live in it (one line):
    another dtype, other names or shapes, a split model."""
    try:
        config = ModelConfig.from_dir(model_dir)
    except (OSError, ValueError) as e:
        return f"cannot read the engine's model config: {e}"
    meta = loader.meta_model(config)
    layout = Layout.of(meta, dtype)
    slots = {s.name: s for s in layout.slots}
    expected = loader.expected_tensors(meta)
    if set(expected) != set(tensors):
        diff = sorted(set(expected) ^ set(tensors))[:4]
        return f"the trainer's tensors are not the engine's (differ in {diff})"
    itemsize = torch.empty((), dtype=dtype).element_size()
    where: dict[str, tuple[int, tuple[int, ...]]] = {}
    for name, target in expected.items():
        t, slot = tensors[name], slots[target.param]
        if target.cut is not None:
            return "the engine's model is split (tensor parallel)"
        if t.dtype != dtype:
            return f"the trainer's {name} is {t.dtype}, the engine's weights {dtype}"
        shape = (target.rows, *slot.shape[1:])
        if tuple(t.shape) != shape:
            return f"the trainer's {name} has shape {tuple(t.shape)}, the engine's {shape}"
        row = math.prod(slot.shape[1:]) * itemsize
        where[name] = (slot.offset + target.offset * row, shape)
    return Placement(layout, where)


class InPlaceWeights:
    """The trainer's side of the mutable set (see the module): ``params`` (checkpoint
    name -> the trainer's parameter) live in its buffers from :meth:`create` on."""

    def __init__(self, writer: MutableWriter, placed: Placement, nonce: str,
                 params: Mapping[str, torch.nn.Parameter]) -> None:
        self.writer = writer
        self.placed = placed
        self.nonce = nonce
        self.params = dict(params)
        self._name = {id(prm): n for n, prm in self.params.items()}
        rng = writer.buffer_range()
        stride = writer.npages * writer.session.page_size
        dtype = placed.layout.dtype
        self.views = [{n: tensor_view(writer.backend, rng, dtype, shape, b * stride + off)
                       for n, (off, shape) in placed.where.items()} for b in (0, 1)]
        self.steps = 0

    @classmethod
    def create(cls, session: WeightSession, placed: Placement,
               params: Mapping[str, torch.nn.Parameter]) -> "InPlaceWeights":
        """Make the set (both buffers loaded from ``params``: the one copy), seal it
        (version 1) and point ``params`` at buffer 0."""
        nonce = secrets.token_hex(16)
        writer = MutableWriter.create(session, mutable_key(placed.layout, nonce),
                                      placed.layout.nbytes)
        try:
            w = cls(writer, placed, nonce, params)
            with torch.no_grad():
                for b in (0, 1):
                    for n, prm in w.params.items():
                        w.views[b][n].copy_(prm.data)
            writer.seal()
            w._point(0)
        except BaseException:
            writer.close()
            raise
        return w

    @property
    def key(self) -> str:
        return self.writer.key

    @property
    def version(self) -> int:
        return self.writer.version

    @property
    def nbytes(self) -> int:
        """Bytes of one version (the engine's weights)."""
        return self.placed.layout.nbytes

    def _point(self, b: int) -> None:
        for n, prm in self.params.items():
            prm.data = self.views[b][n]

    def step(self, opt: torch.optim.Optimizer) -> int:
        """One Adam step of ``opt`` (its state and hyperparameters) written into the back
        buffer, published; the parameters point at the new version (returned). The
        daemon refuses (``Busy``) while a reader still reads the back buffer."""
        if not isinstance(opt, torch.optim.Adam) or isinstance(opt, torch.optim.AdamW):
            raise ValueError("in-place weights support torch.optim.Adam only")
        b = self.writer.begin_write()
        back = self.views[b]
        with torch.no_grad():
            for group in opt.param_groups:
                if group["amsgrad"] or group["maximize"]:
                    raise ValueError("in-place Adam: no amsgrad, no maximize")
                lr, (b1, b2) = float(group["lr"]), group["betas"]
                eps, decay = float(group["eps"]), float(group["weight_decay"])
                for prm in group["params"]:
                    st = opt.state[prm]
                    g = prm.grad if prm.grad is not None else torch.zeros_like(prm)
                    if decay:
                        g = g.add(prm, alpha=decay)
                    st["step"] += 1
                    t = float(st["step"])
                    m, v = st["exp_avg"], st["exp_avg_sq"]
                    m.lerp_(g, 1 - b1)
                    v.mul_(b2).addcmul_(g, g, value=1 - b2)
                    denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(eps)
                    torch.addcdiv(prm, m, denom, value=-lr / (1 - b1 ** t),
                                  out=back[self._name[id(prm)]])
        version = self.writer.publish()
        self._point(b)
        self.steps += 1
        return version

    def close(self) -> None:
        """Copy the parameters to process memory (the model stays usable) and let go of
        the set (its readers keep the last version)."""
        for prm in self.params.values():
            prm.data = prm.data.clone()
        self.writer.close()
