"""Growable device buffers indexed by cache slot (the last-but-one or last dimension)."""

from __future__ import annotations

import torch


def grown(tensor: torch.Tensor, length: int, dim: int, fill=0) -> torch.Tensor:
    """``tensor`` with dimension ``dim`` at least ``length``, old contents kept.

    Grows by an eighth (at least 256): appends stay amortised O(1) without doubling a large cache.
    """
    if tensor.shape[dim] >= length:
        return tensor
    return grown_to(tensor, max(length, tensor.shape[dim] + max(256, tensor.shape[dim] // 8)), dim, fill)


def grown_to(tensor: torch.Tensor, length: int, dim: int, fill=0) -> torch.Tensor:
    """``tensor`` with dimension ``dim`` exactly ``length`` if it was shorter, old contents kept (for
    buffers sized by a capacity that itself grows in blocks: no headroom on top)."""
    if tensor.shape[dim] >= length:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = length
    bigger = torch.full(shape, fill, dtype=tensor.dtype, device=tensor.device)
    bigger.narrow(dim, 0, tensor.shape[dim]).copy_(tensor)
    return bigger


def store_slots(
    tensor: torch.Tensor | None, slots: slice | torch.Tensor, values: torch.Tensor, capacity: int
) -> torch.Tensor:
    """Per-slot metadata (B, kv_heads, n, *rest) <- values (B, kv_heads, T, *rest) at ``slots``: a slice of
    new slots, or (B, kv_heads) slots (T = 1) of a decode step's token. The buffer (None: not yet allocated) is
    sized by the layer's ``capacity`` and reallocated only when the capacity changes (what captured
    selections rely on). Returns the (possibly new) buffer."""
    if tensor is None:
        tensor = values.new_zeros(*values.shape[:2], 0, *values.shape[3:])
    tensor = grown_to(tensor, capacity, 2)
    if isinstance(slots, slice):
        tensor[:, :, slots] = values
        return tensor
    index = slots.view(*slots.shape, 1, *([1] * (values.dim() - 3))).expand_as(values)
    return tensor.scatter_(2, index, values)
