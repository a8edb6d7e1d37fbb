"""Inside a vLLM worker process: load new weights in place (from disk or from the trainer's broadcast).

Called by :class:`workers.inference.vllm_launcher.VllmWorkerExtension` (``worker`` is the vLLM worker the extension
is mixed into). This module is imported in vLLM's worker processes, so it imports nothing of vLLM at module level.

A broadcast (``WeightUpdate(format="nccl")``) is joined with :func:`trainer.broadcast.receive_weights` on the
worker's device: gloo on CPU, NCCL on CUDA. Every vLLM worker process is one receiver (tensor parallel size ×
servers must equal ``trainer.inference_world_size``); each receives the whole, unsharded tensors with their
Hugging Face names and vLLM's ``load_weights`` takes its shard. The tensors go through vLLM's layerwise in-place
reload (``reload_weights(weights_iterator=...)``), not a bare ``model.load_weights``: on CPU every linear layer
runs on a copy packed at load time, which only the reload's ``process_weights_after_loading`` rebuilds.
"""

import time
from typing import Any

import msgspec
import torch


def refresh_tied_head(model: torch.nn.Module) -> None:
    """Rebuild a tied ``lm_head``'s packed CPU copy from the reloaded embedding.

    A tied ``lm_head`` shares ``embed_tokens.weight`` and receives no tensor of its own, so the layerwise reload
    skips it; on CPU its GEMM runs on a copy packed at load time (``cpu_linear``), which would keep serving the
    old embedding.
    """
    head = getattr(model, "lm_head", None)
    if head is not None and hasattr(head, "cpu_linear"):
        head.quant_method.process_weights_after_loading(head)


def reload_from_disk(worker, weights_path: str) -> None:
    """vLLM's in-place reload from a safetensors folder, then the tied-head refresh."""
    worker.reload_weights(weights_path=weights_path)
    refresh_tied_head(worker.model_runner.get_model())


def worker_device(worker) -> torch.device:
    """The device this worker's model lives on (``cuda:N`` on GPU, ``cpu`` on vLLM's CPU backend)."""
    device = getattr(worker, "device", None)
    if device is None:
        device = getattr(worker.model_runner, "device", "cpu")
    return torch.device(device)


def receive_broadcast(worker, event: dict | str, timeout_s: float = 300.0) -> dict[str, Any]:
    """Join the broadcast ``event`` (a ``WeightUpdate`` as JSON or its dict) as one receiver and load its tensors.

    Returns timings for the launcher's log: ``receive_ms`` (joining the group and receiving every tensor: this
    includes waiting for the other receivers), ``load_ms`` (vLLM's reload and the tied-head refresh), ``tensors``
    and ``bytes`` received.
    """
    from bus.messages import WeightUpdate
    from trainer.broadcast import receive_weights

    if isinstance(event, str):
        update = msgspec.json.decode(event, type=WeightUpdate)
    else:
        update = msgspec.convert(event, WeightUpdate)
    start = time.perf_counter()
    tensors = receive_weights(update, worker_device(worker), timeout_s=timeout_s)
    received = time.perf_counter()
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    worker.reload_weights(weights_iterator=iter(list(tensors.items())))
    refresh_tied_head(worker.model_runner.get_model())
    del tensors
    loaded = time.perf_counter()
    return {"step": update.step, "tensors": len(update.tensors), "bytes": nbytes,
            "receive_ms": round((received - start) * 1000, 1), "load_ms": round((loaded - received) * 1000, 1)}
