"""rlbus's backend of vLLM's native weight-transfer API, inside vLLM's processes.

vLLM drives a weight update through its own routes, ``/start_weight_update`` → ``/update_weights`` →
``/finish_weight_update``, each run by every worker on the engine that ``--weight-transfer-config`` names. vLLM's
own engines move tensors between GPUs (NCCL, CUDA IPC); this one, ``{"backend": "rlbus"}``, takes what rlbus's
``weights`` events point at, on any device:

- ``update_info = {"path": DIR}``: a safetensors folder, read shard by shard;
- ``update_info = {"event": {...}}``: a ``WeightUpdate(format="nccl")``, joined as one receiver of the trainer's
  broadcast (gloo on CPU, NCCL on CUDA; :func:`trainer.broadcast.receive_weights`).

Both load in checkpoint format through vLLM's layerwise reload (started in ``start_weight_update``, finalised in
``finish_weight_update``), then rebuild a tied head's packed CPU copy
(:func:`~workers.inference.vllm_weights.refresh_tied_head`). Registered by
:func:`workers.inference.vllm_launcher.register_transfer_engine` (vLLM's ``vllm.general_plugins`` entry point
``rlbus``), by module path: vLLM imports this module only in a worker whose engine is ``rlbus``.
"""

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from workers.inference.vllm_weights import refresh_tied_head


@dataclass
class RlbusInitInfo(WeightTransferInitInfo):
    """Nothing to set up: each update names its own source."""


@dataclass
class RlbusUpdateInfo(WeightTransferUpdateInfo):
    """One update's source: a safetensors folder, or a broadcast event."""

    path: str = ""
    """A safetensors folder every worker can read."""
    event: dict[str, Any] = field(default_factory=dict)
    """A ``WeightUpdate(format="nccl")`` as plain data."""
    timeout_s: float = 300.0
    """How long a broadcast receiver waits for the trainer."""

    def __post_init__(self) -> None:
        if bool(self.path) == bool(self.event):
            raise ValueError("rlbus weight update: give exactly one of path (a safetensors folder) or event")
        if self.path and not Path(self.path).is_dir():
            raise ValueError(f"rlbus weight update: {self.path} is not a folder (pruned before vLLM read it?)")


class RlbusWeightTransferEngine(WeightTransferEngine[RlbusInitInfo, RlbusUpdateInfo]):
    """Loads rlbus's weights (a safetensors folder or the trainer's broadcast) in place."""

    init_info_cls = RlbusInitInfo
    update_info_cls = RlbusUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: RlbusInitInfo) -> None:
        """Nothing to join: a broadcast's rendezvous travels in each update's event."""

    def start_weight_update(self) -> None:
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: RlbusUpdateInfo) -> None:
        self.model.load_weights(self._tensors(update_info))

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Load one update; a failed one undoes the reload's set-up (vLLM then ends the session)."""
        try:
            super().update_weights(update_info)
        except BaseException:
            finalize_layerwise_reload(self.model, self.model_config)
            raise

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)
        refresh_tied_head(self.model)

    def shutdown(self) -> None:
        """Nothing held between updates."""

    def _tensors(self, update_info: RlbusUpdateInfo) -> Iterator[tuple[str, torch.Tensor]]:
        if update_info.path:
            for shard in sorted(Path(update_info.path).glob("*.safetensors")):
                with safe_open(str(shard), framework="pt", device="cpu") as f:
                    for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                        yield name, f.get_tensor(name)
            return
        import msgspec

        from bus.messages import WeightUpdate
        from trainer.broadcast import receive_weights

        update = msgspec.convert(update_info.event, WeightUpdate)
        yield from receive_weights(update, self.device, timeout_s=update_info.timeout_s).items()
