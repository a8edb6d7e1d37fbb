"""Weight broadcast from trainer rank 0 to the inference servers (NCCL on GPU, gloo on CPU).

Trainer rank 0 hosts a ``TCPStore``. For update ``s`` it publishes a ``WeightUpdate(format="nccl",
host, port, world_size = 1 + servers, tensors=manifest)``, builds a process group directly on
``PrefixStore(f"update_{s}", store)`` as rank 0 — never the default group, so it does not clash
with FSDP's — and broadcasts the tensors in manifest order. Each receiver takes its rank with
``store.add("update_{s}/rank", 1)`` and receives into fresh tensors (:func:`receive_weights`).
"""

import socket
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from bus.messages import WeightTensor, WeightUpdate
from trainer.weights import unique_tensors


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in a weights manifest")
    return dtype


def local_address_towards(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (no packet is sent): the address peers can reach us at."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


def _process_group(store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float, address: str):
    """A broadcast group; gloo listens on ``address`` (by default it would take the hostname's address, often
    127.0.0.1, which a receiver on another host cannot reach)."""
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(store, rank, size, options)


def manifest(state: Mapping[str, Tensor]) -> list[WeightTensor]:
    """Name, dtype and shape of each tensor, in broadcast order."""
    return [WeightTensor(name=n, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape))
            for n, t in state.items()]


class WeightBroadcaster:
    """Trainer side: hosts the rendezvous store and broadcasts each update as rank 0."""

    def __init__(self, host: str, port: int, receivers: int, device: torch.device, timeout_s: float = 300.0):
        self.host, self.port, self.receivers = host, port, receivers
        self.device, self.timeout_s = device, timeout_s
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout_s))

    def event(self, step: int, state: Mapping[str, Tensor]) -> WeightUpdate:
        """The rendezvous event to publish before :meth:`broadcast`."""
        return WeightUpdate(step=step, format="nccl", host=self.host, port=self.port,
                            world_size=1 + self.receivers, tensors=manifest(unique_tensors(state)))

    def broadcast(self, event: WeightUpdate, state: Mapping[str, Tensor]) -> None:
        """Join update ``event.step`` as rank 0 (waits for every receiver) and send the tensors in order."""
        state = unique_tensors(state)
        group = _process_group(dist.PrefixStore(f"update_{event.step}", self.store), 0, event.world_size,
                               self.device, self.timeout_s, local_address_towards(self.host, self.port))
        try:
            for spec in event.tensors:
                tensor = state[spec.name].detach()
                if self.device.type == "cpu" and tensor.device.type != "cpu":
                    tensor = tensor.cpu()
                group.broadcast([tensor.contiguous()], dist.BroadcastOptions()).wait()
        finally:
            _shutdown(group)


def _shutdown(group) -> None:
    shutdown = getattr(group, "shutdown", None)
    if shutdown is not None:
        shutdown()


_stores: dict[tuple[str, int], dist.TCPStore] = {}


def receive_weights(event: WeightUpdate, device: torch.device | str, timeout_s: float = 300.0) -> dict[str, Tensor]:
    """Inference side: join the broadcast of ``event`` and return its tensors on ``device``."""
    device = torch.device(device)
    if event.format != "nccl" or event.host is None or event.port is None or event.world_size is None:
        raise ValueError(f"weights event of step {event.step} is not an nccl broadcast (format={event.format!r})")
    key = (event.host, event.port)
    if key not in _stores:
        _stores[key] = dist.TCPStore(event.host, event.port, is_master=False, timeout=timedelta(seconds=timeout_s))
    prefix = dist.PrefixStore(f"update_{event.step}", _stores[key])
    rank = prefix.add("rank", 1)
    if rank >= event.world_size:
        raise RuntimeError(f"update {event.step}: got rank {rank} of world size {event.world_size}; "
                           "more receivers joined than trainer.inference_world_size "
                           "(default: one per inference server URL)")
    comm_device = device if device.type == "cuda" else torch.device("cpu")
    group = _process_group(prefix, rank, event.world_size, comm_device, timeout_s,
                           local_address_towards(event.host, event.port))
    out: dict[str, Tensor] = {}
    try:
        for spec in event.tensors:
            tensor = torch.empty(spec.shape, dtype=_dtype(spec.dtype), device=comm_device)
            group.broadcast([tensor], dist.BroadcastOptions()).wait()
            out[spec.name] = tensor.to(device)
    finally:
        _shutdown(group)
    return out
