"""Data parallelism: FSDP2 (``fully_shard``) over ranks started by torchrun or ``rlbus trainer --nproc N``.

NCCL on GPU, gloo on CPU. Rank ``r`` of ``W`` trains micro-batches ``i % W == r``; loss-token
counts and metric sums are all-reduced so every rank normalises by the whole step's counts.
FSDP averages gradients over ranks, so each rank scales its loss by ``W`` (see trainer.step).
"""

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from bus.local_redis import free_port


@dataclass
class DistContext:
    """Where this process sits in the data-parallel group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device_type: str) -> DistContext:
    """Join the group torchrun (or :func:`spawn`) described in RANK/WORLD_SIZE; a lone process gets rank 0 of 1."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    ctx = DistContext(int(os.environ.get("RANK", "0")), world_size, int(os.environ.get("LOCAL_RANK", "0")))
    if ctx.distributed and not dist.is_initialized():
        if device_type == "cuda":
            torch.cuda.set_device(ctx.local_rank)
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return ctx


def close_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def prepare_model(policy: nn.Module, ctx: DistContext, device_type: str, compile_layers: bool) -> nn.Module:
    """torch.compile each decoder layer (optional), then ``fully_shard`` each layer and the root when W > 1."""
    layers = getattr(policy.lm.base_model, "layers", None)
    if compile_layers and layers is not None:
        for layer in layers:
            layer.compile()
    if not ctx.distributed:
        return policy
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (ctx.world_size,))
    for layer in layers if layers is not None else []:
        fully_shard(layer, mesh=mesh)
    fully_shard(policy, mesh=mesh)
    return policy


def set_grad_sync(policy: nn.Module, enabled: bool) -> None:
    """Skip FSDP's gradient reduce-scatter on all but the last micro-batch of a step."""
    setter = getattr(policy, "set_requires_gradient_sync", None)
    if setter is not None:
        setter(enabled)


def all_reduce_sum(tensor: Tensor, ctx: DistContext) -> Tensor:
    """In-place sum over ranks (no-op for one rank)."""
    if ctx.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(tensor: Tensor, ctx: DistContext) -> Tensor:
    if ctx.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def full_state_dict(policy: nn.Module, ctx: DistContext) -> dict[str, Tensor]:
    """The Hugging Face state dict of ``policy.lm``: live tensors for one rank; gathered on CPU (rank 0) when
    sharded."""
    if not ctx.distributed:
        return policy.lm.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {name.removeprefix("lm."): t for name, t in full.items()}


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


def broadcast_object(value: Any, ctx: DistContext) -> Any:
    """Rank 0's ``value`` on every rank."""
    if not ctx.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def spawn(nproc: int, fn: Callable[..., Any], args: tuple) -> None:
    """Run ``fn(*args)`` in ``nproc`` fresh processes with RANK/WORLD_SIZE/MASTER_* set (like torchrun)."""
    import torch.multiprocessing as mp

    port = free_port()
    mp.start_processes(_spawned, args=(nproc, port, fn, args), nprocs=nproc, start_method="spawn", join=True)


def _spawned(rank: int, nproc: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    fn(*args)
