"""Tensor parallelism: which attention heads this process computes, read from the sharded weights.

Under transformers' tensor parallelism (``from_pretrained(..., distributed_config=
DistributedConfig(tp_size=N))``, or the older ``tp_plan="auto"``; 5.17 and 5.24 alike) each q/k/v
projection's weight is a ``DTensor`` split by output features over the TP mesh (its "colwise" plan,
``Shard(0)``), and its forward returns this rank's features only. A rank's attention thus computes a
contiguous block of query heads and the KV heads they read, and the cache receives those KV heads
alone: the cache sizes everything from the tensors it is given, and the artifact, made on one device
for every head, is sliced here to the rank's heads. One process (plain weights) holds every head.

transformers loads a model whose KV heads do not divide by the TP size (it splits a head between
ranks) and fails in its first forward with a reshape error; ``head_shard`` refuses it first.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from infinigen.errors import InfinigenError

if TYPE_CHECKING:  # torch loads with the first function that needs it: the command line starts without it
    import torch
    from torch import nn


@dataclass(frozen=True)
class HeadShard:
    """One rank's attention heads, in the order of the projections' shards."""

    kv_heads: slice  # this rank's KV heads among the model's
    query_heads: slice  # its query heads among the model's
    ranks: int  # the tensor-parallel size (1: one process holds every head)
    group: object | None  # the TP process group; None in one process

    @property
    def kv_count(self) -> int:
        """This rank's KV heads."""
        return self.kv_heads.stop - self.kv_heads.start

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return (self.query_heads.stop - self.query_heads.start) // self.kv_count


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (a PyTorch without distributed support has none)."""
    import torch.distributed as dist

    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor as plain values (a collective for a ``DTensor``: every rank must call it; a quantised
    weight dequantised)."""
    if is_sharded(tensor):
        return tensor.full_tensor()
    return tensor.dequantize() if quantised(tensor) else tensor


def weight_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters in this process: a rank's shards under tensor parallelism."""
    return sum(stored_bytes(p.to_local() if is_sharded(p) else p) for p in model.parameters())


def stored_bytes(tensor: torch.Tensor) -> int:
    """The bytes a tensor holds: a quantised weight's (a tensor subclass such as torchao's ``Int8Tensor``,
    whose ``nbytes`` is its logical dtype's) the sum of its inner tensors'."""
    if not quantised(tensor):
        return tensor.nbytes
    names, _ = tensor.__tensor_flatten__()
    return sum(stored_bytes(getattr(tensor, name)) for name in names)


def quantised(tensor: torch.Tensor) -> bool:
    """Whether a parameter is a tensor subclass holding its values in other tensors (quantised weights)."""
    import torch

    return type(tensor.data) is not torch.Tensor and hasattr(tensor, "__tensor_flatten__") and not is_sharded(tensor)


def _rows(weight: torch.Tensor) -> tuple[int, int, object | None]:
    """(first output feature held here, how many, the TP group) of a projection's weight."""
    if not is_sharded(weight):
        return 0, weight.shape[0], None
    mesh, placements = weight.device_mesh, weight.placements
    if mesh.ndim != 1 or not (placements[0].is_shard() and placements[0].dim == 0):
        raise InfinigenError(
            f"attention projections sharded as {placements} over a {mesh.ndim}-D mesh: infinigen needs them "
            "split by output features over one mesh dimension (transformers' colwise plan)"
        )
    total, ranks = weight.shape[0], mesh.size()
    chunk = -(-total // ranks)  # Shard(0) cuts as torch.chunk does: ceil-sized pieces, in mesh order
    start = min(mesh.get_local_rank() * chunk, total)
    return start, weight.to_local().shape[0], mesh.get_group()


def head_shard(attention: nn.Module, head_dim: int) -> HeadShard:
    """The heads ``attention`` (a decoder block's) computes on this rank; an ``InfinigenError`` when
    its KV heads cannot be split evenly over the ranks."""
    k_start, k_rows, group = _rows(attention.k_proj.weight)
    q_start, q_rows, _ = _rows(attention.q_proj.weight)
    kv_heads = attention.k_proj.weight.shape[0] // head_dim  # a DTensor's shape is the whole weight's
    ranks = 1 if group is None else attention.k_proj.weight.device_mesh.size()
    check_divisible(kv_heads, ranks)
    return HeadShard(
        kv_heads=slice(k_start // head_dim, (k_start + k_rows) // head_dim),
        query_heads=slice(q_start // head_dim, (q_start + q_rows) // head_dim),
        ranks=ranks,
        group=group,
    )


def check_divisible(kv_heads: int, ranks: int) -> None:
    if kv_heads % ranks:
        raise InfinigenError(
            f"tensor parallel over {ranks} ranks needs the KV heads ({kv_heads}) to divide by {ranks}: "
            f"use a tensor-parallel size that divides {kv_heads}"
        )


def world_size() -> int:
    """The processes of this run: torchrun's ``WORLD_SIZE`` (1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's rank under torchrun (0 without a launcher)."""
    return int(os.environ.get("RANK", "0"))


def local_device(device: str) -> str:
    """The device this process computes on: under torchrun with CUDA, its own GPU, ``cuda:LOCAL_RANK``,
    whatever index ``device`` names (transformers shards the model onto that GPU regardless), and made
    the current device before anything touches CUDA: streams, pinned pools, Triton launches, CUDA graphs
    and NCCL all use the current device, and a rank left on GPU 0 would put its context, its copies and
    its bandwidth measurement there. ``device`` itself in one process or on the CPU."""
    if world_size() == 1 or not device.startswith("cuda"):
        return device
    import torch

    index = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def loading_arguments(config, ranks: int) -> dict:
    """``from_pretrained`` arguments that shard the model over ``ranks`` processes with transformers'
    tensor parallelism (``DistributedConfig(tp_size=N)``: 5.17 and 5.24 both take it; the older
    ``tp_plan="auto"`` is deprecated). Refused before any weight loads: a model without a
    tensor-parallel plan in transformers (OPT), and KV heads that do not divide by ``ranks``."""
    from transformers.distributed import DistributedConfig

    if not getattr(config, "base_model_tp_plan", None):
        raise InfinigenError(
            f"{config.model_type} has no tensor-parallel plan in transformers: run it in one process (no torchrun)"
        )
    check_divisible(getattr(config, "num_key_value_heads", None) or config.num_attention_heads, ranks)
    return {"distributed_config": DistributedConfig(tp_size=ranks)}


def all_heads(heads: torch.Tensor, attention: nn.Module) -> torch.Tensor:
    """(this rank's heads, ...) -> (every head of ``attention``, ...), in the projections' shard order:
    a collective of the TP group (every rank calls it); ``heads`` itself in one process."""
    weight = attention.k_proj.weight
    if not is_sharded(weight):
        return heads
    import torch
    import torch.distributed as dist

    heads = heads.contiguous()
    pieces = [torch.empty_like(heads) for _ in range(weight.device_mesh.size())]
    dist.all_gather(pieces, heads, group=weight.device_mesh.get_group())  # a 1-D mesh's group: its order
    return torch.cat(pieces)


def _group_running() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def together() -> None:
    """Wait for every rank of the run (nothing in one process): what follows starts on all at once."""
    if _group_running():
        import torch.distributed as dist

        dist.barrier()


def leave_group() -> None:
    """After a command's last collective, this process's exit from the run's process group (nothing in
    one process or without one). PyTorch asks for it before exit: a process that ends with its NCCL
    communicators alive may block the others' teardown; the CUDA graphs that hold collectives go first."""
    if _group_running():
        import gc

        import torch.distributed as dist

        gc.collect()  # the caches' captured steps, which hold the group's collectives
        dist.destroy_process_group()


def summed(value: float, device: str) -> float:
    """``value`` summed over the ranks of the run (itself in one process); ``device``: where the
    process group's backend reduces (NCCL: the rank's GPU)."""
    if not _group_running():
        return value
    import torch
    import torch.distributed as dist

    total = torch.tensor(value, dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return float(total)
