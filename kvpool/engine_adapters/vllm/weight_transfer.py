"""kvpool's weight transfer engine for vLLM (engine core): an update loads a checkpoint
folder through the model's own ``load_weights``, vLLM's weight-update path.

vLLM's RL weight sync (``start_weight_update`` / ``update_weights`` /
``finish_weight_update``, run between engine steps by ``collective_rpc``) hands each
update to the engine named by ``--weight-transfer-config``'s ``backend``; kvpool registers
``kvpool`` (patches.py, on import of vLLM's factory) and makes it the default of a kvpool
tenant (``EngineArgs.create_engine_config``). Its update info is ``{"checkpoint": DIR}``:
the safetensors files of a folder the trainer wrote (:mod:`kvpool.demo.rl_loop` saves
one per step), read one tensor at a time and handed to ``model.load_weights`` inside
vLLM's layerwise reload (which checks names and shapes: a mismatch raises, and the route
answers it in one line).

The copy it makes: the checkpoint's tensors into vLLM's parameters (one host copy per
publish; the trainer wrote the file: two in all, as the bundled engine's
``POST /kvpool/weights``). vLLM's weights are not in the pool (docs/VLLM-ADAPTER.md), so
a publish in place is not possible here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
# (without vLLM's types these bases are Any: the ignores below say so for both settings,
# tests/test_types.py checks both)
from vllm.distributed.weight_transfer.base import (WeightTransferEngine as Engine,
                                                   WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

BACKEND = "kvpool"


@dataclass
class CheckpointInit(WeightTransferInitInfo):  # type: ignore[misc, unused-ignore]
    """Nothing to set up: the checkpoint is named by each update."""


@dataclass
class CheckpointUpdate(WeightTransferUpdateInfo):  # type: ignore[misc, unused-ignore]
    """One update: the folder whose ``*.safetensors`` the model loads."""

    checkpoint: str


def tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of ``folder``'s safetensors files, one at a time; ValueError when it
    has none."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no .safetensors files")
    for f in files:
        with safe_open(str(f), framework="pt") as r:
            for name in r.keys():
                yield name, r.get_tensor(name)


class CheckpointTransfer(
        Engine[CheckpointInit, CheckpointUpdate]):  # type: ignore[misc, unused-ignore]
    """The ``kvpool`` backend: :class:`CheckpointUpdate` loaded by ``model.load_weights``."""

    init_info_cls = CheckpointInit
    update_info_cls = CheckpointUpdate
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: CheckpointInit) -> None:
        """Nothing to connect."""

    def start_weight_update(self) -> None:
        """vLLM's layerwise reload, as its checkpoint-format engines (NCCL, IPC) do: the
        parameters vLLM repacked after loading (CPU linear layers, say) take checkpoint
        tensors again, and are processed again at :meth:`finish_weight_update`."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        """The layers processed as after a load."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finish: Any = finalize_layerwise_reload  # (untyped in vLLM)
        finish(self.model, self.model_config)

    def shutdown(self) -> None:
        """Nothing held."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """:meth:`receive_weights`, then a device sync only where there is a device (the
        base class's unconditional one raises on CPU)."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: CheckpointUpdate) -> None:
        """Load the checkpoint's tensors into the model; ValueError (one line) when the
        folder has none or the model took none of them."""
        load: Any = getattr(self.model, "load_weights")  # (vLLM's models all have one)
        loaded = load(tensors(Path(update_info.checkpoint)))
        if loaded is not None and not loaded:
            raise ValueError(f"{update_info.checkpoint}: no tensor of this model")
