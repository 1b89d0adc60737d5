"""Row reuse: an offloaded layer keeps its fetched rows on the GPU from one decode step to the next,
and a step moves only the rows its selection adds (consecutive steps select mostly the same rows:
BENCHMARKS.md, session 11). ``place`` keeps every row selected again where it is and puts the new
rows in the positions the dropped ones free, so nothing but the new rows moves. Device work only,
fixed shapes: it runs inside captured selections."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Placement:
    slots: torch.Tensor  # (B, H, P) int64: the slot each position holds after the step's fetch, -1 none
    missing: torch.Tensor  # (B, H, K) int64: the slots to move, the first ``count`` of each head
    count: torch.Tensor  # (B, H) int32
    destination: torch.Tensor  # (B, H, K) int64: where each moved row goes; P (a spare) past the count


def place(resident: torch.Tensor, indices: torch.Tensor, selected: torch.Tensor, n_slots: int) -> Placement:
    """resident (B, H, P): the slot each resident position holds (-1: none); the new selection:
    slots ``indices`` (B, H, K), K <= P, of which ``selected`` (B, H, K) are attended; every slot
    < n_slots. After the move, the valid positions hold exactly the selected slots."""
    batch, heads, positions = resident.shape
    k = indices.shape[-1]
    spare = n_slots  # an entry of the per-slot tables that nothing reads
    wanted = torch.zeros(batch, heads, n_slots + 1, dtype=torch.bool, device=indices.device)
    wanted.scatter_(-1, torch.where(selected, indices, spare), True)
    keep = (resident >= 0) & wanted.gather(-1, resident.clamp(min=0))  # (B, H, P): rows that stay
    held = torch.zeros_like(wanted)
    held.scatter_(-1, torch.where(keep, resident, spare), True)
    moving = selected & ~held.gather(-1, indices)  # (B, H, K): selected, not resident
    count = moving.sum(dim=-1, dtype=torch.int32)
    missing = _compacted(indices, moving)  # the moving slots first, in order
    order = torch.arange(positions, device=indices.device).expand(batch, heads, positions)
    free = _compacted(order, ~keep)[..., :k]  # the free positions first: as many as the moving rows, at least
    in_count = torch.arange(k, device=indices.device) < count[..., None]
    destination = torch.where(in_count, free, positions)
    slots = torch.cat([torch.where(keep, resident, -1), resident.new_full((batch, heads, 1), -1)], dim=-1)
    slots.scatter_(-1, destination, torch.where(in_count, missing, -1))
    return Placement(slots[..., :positions], missing, count, destination)


def _compacted(values: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """(B, H, N) values where ``chosen``, moved to the front in order; the rest unspecified."""
    n = values.shape[-1]
    rank = torch.where(chosen, chosen.cumsum(dim=-1) - 1, n)
    out = values.new_zeros(*values.shape[:-1], n + 1)
    return out.scatter_(-1, rank, values)[..., :n]
