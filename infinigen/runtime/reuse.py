"""Row reuse: an offloaded layer keeps its fetched rows on the GPU from one decode step to the next,
and a step moves only the rows its selection adds (consecutive steps select mostly the same rows:
BENCHMARKS.md, "Row reuse"). ``ResidentRows.place`` keeps every row selected again where it is and
gives the new rows the positions the dropped ones free, so nothing but the new rows moves.

On CUDA the placement is one Triton kernel per layer (a program per (batch row, head)); elsewhere
the same result comes from PyTorch indexing. Device work only, fixed shapes: it runs inside
captured selections. With ``keep_recent`` (``RuntimeConfig.resident_extra``) the positions hold more
than the selection: rows of earlier steps stay until new rows need their places, free places first,
then those of the rows selected least recently (ages saturate at ``AGE_CAP`` steps; ties go in
position order, so the kernel and PyTorch agree exactly).

Whether a cache reuses rows (``decide``, for ``reuse_rows="auto"``) is host arithmetic: what the
resident buffers need at a pool capacity (``resident_bytes``) against the room measured once, at the
first prefill (``reuse_room``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from infinigen.runtime.buffers import grown_to
from infinigen.runtime.policies.base import rows_bound

try:  # Triton ships with CUDA builds of PyTorch; CPU builds run the PyTorch path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

BLOCK: int | None = None  # positions or selected slots per loop step of the placement kernels (None: placement_tuning)
FREE_SHARE = 0.5  # of the GPU's free memory at prefill, what auto reuse may take without a cap
PAGE_SLACK = 16  # quest selects whole 16-token pages: up to 15 slots past the budget's share
AGE_CAP = 255  # steps since a row was last selected, saturating: the kernel counts keys in 512 bins


@dataclass(frozen=True)
class Decision:
    on: bool
    reason: str

    def __str__(self) -> str:
        return f"{'on' if self.on else 'off'} ({self.reason})"


def resident_positions(selection: int, extra: float) -> int:
    """Positions of a layer's resident rows for selections of up to ``selection`` slots: the selection,
    and ``extra`` of it again for rows of earlier steps (``RuntimeConfig.resident_extra``)."""
    return selection + math.ceil(extra * selection)


def resident_bytes(
    batch: int,
    kv_heads: int,
    head_dim: int,
    itemsize: int,
    capacity: int,
    budgets: Sequence[float],
    min_tokens: int,
    extra: float = 0.0,
) -> int:
    """GPU bytes of every offloaded layer's ``ResidentRows`` at a pool ``capacity`` (slots per
    (batch row, KV head)): each holds a layer's selection, at most its budget's share of the capacity
    (``budgets``: each layer's), and ``extra`` of it again, as K and V rows plus the token's own, with
    a slot and an age per position and a position per slot. One layer's buffers more for the copy
    while one grows."""
    per_layer = []
    for budget in budgets:
        positions = resident_positions(rows_bound(budget, capacity, min_tokens) + PAGE_SLACK, extra)
        row = 2 * (positions + 1) * head_dim * itemsize + 12 * positions + 4 * (capacity + 1)
        per_layer.append(batch * kv_heads * row)
    return sum(per_layer) + max(per_layer, default=0)


def reuse_room(device: torch.device, cap_gb: float | None) -> tuple[int, str] | None:
    """The bytes auto reuse may take on ``device`` and how they were chosen: ``cap_gb`` where given,
    at most ``FREE_SHARE`` of the free memory (the device's and the allocator's idle cache). None on
    the CPU: there the rows move within host memory, with no bus to spare, and keeping them costs a
    placement per step and layer, so auto reuses rows only for ``resident_extra`` (``decide``)."""
    if device.type != "cuda":
        return None
    free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return room_from(free, cap_gb)


def room_from(free: int, cap_gb: float | None) -> tuple[int, str]:
    share = int(free * FREE_SHARE)
    described = f"half of {free / 1e9:.2f} GB free"
    if cap_gb is None or cap_gb * 1e9 > share:
        return share, described + ("" if cap_gb is None else f", under the cap of {cap_gb:g} GB")
    return int(cap_gb * 1e9), f"the cap of {cap_gb:g} GB"


def decide(need: int, room: tuple[int, str] | None, extra: float = 0.0) -> Decision:
    """Auto reuse at one capacity: on where the resident rows (``need`` bytes) fit in ``room``. On
    the CPU (no room): on only to attend rows of earlier steps (``extra`` > 0)."""
    if room is None:
        if extra:
            return Decision(True, "auto: CPU, to attend rows of earlier steps as on a GPU")
        return Decision(False, "auto: CPU, no transfers to save")
    limit, described = room
    fits = need <= limit
    return Decision(fits, f"auto: {need / 1e9:.2f} GB {'fits in' if fits else 'exceeds'} {described}")


@dataclass(frozen=True)
class Placement:
    missing: torch.Tensor  # (B, H, K) int64: the slots to move, the first ``count`` of each head
    count: torch.Tensor  # (B, H) int32
    destination: torch.Tensor  # (B, H, K) int32: the position each moved row goes to (first ``count``)
    attend: torch.Tensor  # (B, H, P + 1) bool: positions holding a selected row; the last (the token's) False


class ResidentRows:
    """One offloaded layer's rows on the GPU: ``rows`` (B, H, 2, P + 1, d), the last position for
    the step's own token; ``slots`` (B, H, P) int64, the slot each position holds (-1: none);
    ``position_of`` (B, H, capacity + 1) int32, each slot's position (-1: not resident; the last
    column takes the writes of no slot), so a placement looks a slot up instead of searching;
    ``age`` (B, H, P) int32, steps since each position's row was last selected (``keep_recent``)."""

    def __init__(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.rows = torch.zeros(batch, heads, 2, 1, head_dim, dtype=dtype, device=device)
        self.slots = torch.full((batch, heads, 0), -1, dtype=torch.int64, device=device)
        self.position_of = torch.full((batch, heads, 1), -1, dtype=torch.int32, device=device)
        self.age = torch.zeros(batch, heads, 0, dtype=torch.int32, device=device)

    def grow(self, positions: int, capacity: int) -> None:
        """Room for at least ``positions`` rows and ``capacity`` slots (what is held stays)."""
        self.rows = grown_to(self.rows, positions + 1, 3)  # the old token position: a free one (slot -1)
        self.slots = grown_to(self.slots, positions, 2, fill=-1)
        self.age = grown_to(self.age, positions, 2)
        self.position_of = grown_to(self.position_of, capacity + 1, 2, fill=-1)

    def place(self, indices: torch.Tensor, selected: torch.Tensor, keep_recent: bool = False) -> Placement:
        """The new selection: slots ``indices`` (B, H, K), K <= P, of which ``selected`` (B, H, K)
        are attended (distinct slots). Updates ``slots`` and ``position_of`` so that the valid
        positions hold the selected slots once the missing rows have moved: exactly those, or with
        ``keep_recent`` also the rows of earlier steps that no new row needed the place of."""
        age = self.age if keep_recent else None
        if triton is not None and indices.device.type == "cuda":
            return _launch_place(self.slots, self.position_of, indices, selected, age)
        if keep_recent:
            return _place_recent(self.slots, self.position_of, self.age, indices, selected)
        return _place(self.slots, self.position_of, indices, selected)


def _place(slots: torch.Tensor, position_of: torch.Tensor, indices: torch.Tensor, selected: torch.Tensor) -> Placement:
    """The placement in PyTorch (the CPU path, and the reference of the kernel's tests)."""
    batch, heads, positions = slots.shape
    k = indices.shape[-1]
    kept, count, missing = _kept_and_missing(slots, position_of, indices, selected)
    order = torch.arange(positions, device=slots.device).expand(batch, heads, positions)
    destination = _compacted(order, ~kept)[..., :k].to(torch.int32)  # free positions, in order
    b, h, p = ((slots >= 0) & ~kept).nonzero(as_tuple=True)  # dropped rows
    position_of[b, h, slots[b, h, p]] = -1
    slots.masked_fill_(~kept, -1)
    b, h, j = (torch.arange(k, device=slots.device) < count[..., None]).nonzero(as_tuple=True)  # moved rows
    slots[b, h, destination[b, h, j].long()] = missing[b, h, j]
    position_of[b, h, missing[b, h, j]] = destination[b, h, j]
    attend = torch.cat([slots >= 0, selected.new_zeros(batch, heads, 1)], dim=-1)
    return Placement(missing, count, destination, attend)


def _place_recent(
    slots: torch.Tensor, position_of: torch.Tensor, age: torch.Tensor, indices: torch.Tensor, selected: torch.Tensor
) -> Placement:
    """The placement that keeps rows of earlier steps, in PyTorch (the CPU path, and the reference of
    the kernel's tests): the new rows take free positions first, then those of the least recently
    selected rows, in position order; every held row is attended."""
    batch, heads, positions = slots.shape
    k = indices.shape[-1]
    kept, count, missing = _kept_and_missing(slots, position_of, indices, selected)
    age.add_(1).clamp_(max=AGE_CAP).masked_fill_(kept, 0)
    order = torch.arange(positions, device=slots.device).expand(batch, heads, positions)
    # the places new rows take: the ``count`` largest keys (free, then oldest; ties by position)
    key = torch.where(slots < 0, AGE_CAP + 1, age).masked_fill(kept, -1)
    by_key = key.argsort(dim=-1, descending=True, stable=True)
    taken = torch.zeros_like(kept).scatter_(-1, by_key, order < count[..., None])
    destination = _compacted(order, taken)[..., :k]  # (B, H, K): taken positions, in order
    moved = torch.arange(k, device=slots.device) < count[..., None]
    target = torch.where(moved, destination, positions)  # position P: a column that is dropped
    held = torch.cat([slots, slots.new_full((batch, heads, 1), -1)], dim=-1)
    slots.copy_(held.scatter_(-1, target, torch.where(moved, missing, -1))[..., :positions])
    age.masked_fill_(taken, 0)
    capacity = position_of.shape[-1] - 1
    position_of.fill_(-1).scatter_(-1, torch.where(slots >= 0, slots, capacity), order.to(torch.int32))
    position_of[..., capacity] = -1
    attend = torch.cat([slots >= 0, selected.new_zeros(batch, heads, 1)], dim=-1)
    return Placement(missing, count, destination.to(torch.int32), attend)


def _kept_and_missing(
    slots: torch.Tensor, position_of: torch.Tensor, indices: torch.Tensor, selected: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What both placements start from: ``kept`` (B, H, P) bool, the positions holding a row selected
    again; ``count`` (B, H) int32, the selected rows not resident; ``missing`` (B, H, K), those slots first."""
    batch, heads, positions = slots.shape
    at = position_of.gather(-1, indices)  # (B, H, K): where each slot is now, -1: not resident
    moving = selected & (at < 0)
    kept = torch.zeros(batch, heads, positions + 1, dtype=torch.bool, device=slots.device)
    kept.scatter_(-1, torch.where(selected & (at >= 0), at, positions).long(), True)
    return kept[..., :positions], moving.sum(dim=-1, dtype=torch.int32), _compacted(indices, moving)


def _compacted(values: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """(B, H, N) values where ``chosen``, moved to the front in order; the rest unspecified."""
    n = values.shape[-1]
    rank = torch.where(chosen, chosen.cumsum(dim=-1) - 1, n)
    out = values.new_zeros(*values.shape[:-1], n + 1)
    return out.scatter_(-1, rank, values)[..., :n]


if triton is not None:

    @triton.jit
    def _own_rows(bh, slots, kept, position_of, destination, attend, missing, k, positions, capacity):
        """The buffers' rows of (batch row, head) ``bh``."""
        return (
            slots + bh * positions,
            kept + bh * positions,
            position_of + bh * capacity,
            destination + bh * k,
            attend + bh * (positions + 1),
            missing + bh * k,
        )

    @triton.jit
    def _mark_kept(slots, position_of, indices, selected, missing, count, kept, k, positions, block: tl.constexpr):
        """Both placements' first passes, one (batch row, head): ``kept`` marks the positions holding a
        slot selected again; the selected slots not resident go to ``missing`` in order; their number."""
        for start in range(0, positions, block):
            p = start + tl.arange(0, block)
            tl.store(kept + p, tl.zeros([block], dtype=tl.int8), mask=p < positions)
        tl.debug_barrier()
        n_moving = 0
        for start in range(0, k, block):
            j = start + tl.arange(0, block)
            chosen = tl.load(selected + j, mask=j < k, other=0) != 0
            slot = tl.load(indices + j, mask=chosen, other=0)
            at = tl.load(position_of + slot, mask=chosen, other=-1)
            tl.store(kept + at, tl.full([block], 1, dtype=tl.int8), mask=chosen & (at >= 0))
            moving = chosen & (at < 0)
            rank = n_moving + tl.cumsum(moving.to(tl.int32), axis=0) - 1
            tl.store(missing + rank, slot, mask=moving)
            n_moving += tl.sum(moving.to(tl.int32), axis=0)
        tl.store(count, n_moving)
        tl.debug_barrier()  # the stores above visible to the passes that follow
        return n_moving

    @triton.jit
    def _place_kernel(
        slots, position_of, indices, selected, missing, count, destination, attend, kept,
        k, positions, capacity, block: tl.constexpr,
    ):  # fmt: skip
        """``_place``: one (batch row, head) per program, over its own rows only."""
        bh = tl.program_id(0)
        slots, kept, position_of, destination, attend, missing = _own_rows(
            bh, slots, kept, position_of, destination, attend, missing, k, positions, capacity
        )
        n_moving = _mark_kept(
            slots, position_of, indices + bh * k, selected + bh * k, missing, count + bh, kept, k, positions, block
        )
        # the rows not kept leave; the moving ones take the free positions, in order
        n_free = 0
        for start in range(0, positions, block):
            p = start + tl.arange(0, block)
            live = p < positions
            old = tl.load(slots + p, mask=live, other=-1)
            keep = tl.load(kept + p, mask=live, other=0) != 0
            tl.store(position_of + old, tl.full([block], -1, dtype=tl.int32), mask=live & (old >= 0) & ~keep)
            free = live & ~keep
            rank = n_free + tl.cumsum(free.to(tl.int32), axis=0) - 1
            filled = free & (rank < n_moving)
            new = tl.load(missing + rank, mask=filled, other=-1)
            tl.store(destination + rank, p.to(tl.int32), mask=filled)
            tl.store(position_of + new, p.to(tl.int32), mask=filled)
            now = tl.where(keep, old, new)
            tl.store(slots + p, now, mask=live)
            tl.store(attend + p, (now >= 0).to(tl.int8), mask=live)
            n_free += tl.sum(free.to(tl.int32), axis=0)
        tl.store(attend + positions, 0)

    @triton.jit
    def _eviction_key(slots, kept, age, p, live, age_cap: tl.constexpr):
        """Which places new rows take first: free ones (``age_cap`` + 1), then by age; kept rows and
        lanes past the end -1 (never taken)."""
        held = tl.load(slots + p, mask=live, other=0) >= 0
        keep = tl.load(kept + p, mask=live, other=1) != 0
        return tl.where(keep, -1, tl.where(held, tl.load(age + p, mask=live, other=0), age_cap + 1))

    @triton.jit
    def _place_recent_kernel(
        slots, position_of, age, indices, selected, missing, count, destination, attend, kept,
        k, positions, capacity, block: tl.constexpr, age_cap: tl.constexpr, key_bins: tl.constexpr,
    ):  # fmt: skip
        """``_place_recent``: the new rows take the ``count`` places of largest key, found from a
        histogram of the keys (the key at the cut, then how many of its ties in position order), no sort."""
        bh = tl.program_id(0)
        slots, kept, position_of, destination, attend, missing = _own_rows(
            bh, slots, kept, position_of, destination, attend, missing, k, positions, capacity
        )
        age += bh * positions
        n_moving = _mark_kept(
            slots, position_of, indices + bh * k, selected + bh * k, missing, count + bh, kept, k, positions, block
        )
        # a step older (the rows selected again: age 0), and how many places hold each key (bin key + 1;
        # bin 0: the kept rows' -1 and the lanes past the end)
        counts = tl.zeros([key_bins], dtype=tl.int32)
        for start in range(0, positions, block):
            p = start + tl.arange(0, block)
            live = p < positions
            keep = tl.load(kept + p, mask=live, other=1) != 0
            now_age = tl.where(keep, 0, tl.minimum(tl.load(age + p, mask=live, other=0) + 1, age_cap))
            tl.store(age + p, now_age, mask=live)
            held = tl.load(slots + p, mask=live, other=0) >= 0
            counts += tl.histogram(tl.where(keep, -1, tl.where(held, now_age, age_cap + 1)) + 1, key_bins)
        tl.debug_barrier()
        # the cut: the largest key with at least n_moving places at or above it (the kept rows' -1 never)
        key_of = tl.arange(0, key_bins) - 1
        at_least = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts  # places with key >= key_of
        cut = (key_of >= 0) & (key_of <= age_cap + 1) & (at_least >= n_moving)
        low = tl.max(tl.where(cut, key_of, 0), axis=0)
        ties_taken = n_moving - tl.sum(tl.where(key_of > low, counts, 0), axis=0)
        n_taken = 0
        n_ties = 0
        for start in range(0, positions, block):
            p = start + tl.arange(0, block)
            live = p < positions
            key = _eviction_key(slots, kept, age, p, live, age_cap)
            tie = key == low
            tie_rank = n_ties + tl.cumsum(tie.to(tl.int32), axis=0) - 1
            take = live & ((key > low) | (tie & (tie_rank < ties_taken)))
            rank = n_taken + tl.cumsum(take.to(tl.int32), axis=0) - 1
            old = tl.load(slots + p, mask=live, other=-1)
            new = tl.load(missing + rank, mask=take, other=-1)
            tl.store(position_of + old, tl.full([block], -1, dtype=tl.int32), mask=take & (old >= 0))
            tl.store(position_of + new, p.to(tl.int32), mask=take)
            tl.store(destination + rank, p.to(tl.int32), mask=take)
            tl.store(age + p, tl.zeros([block], dtype=tl.int32), mask=take)
            now = tl.where(take, new, old)
            tl.store(slots + p, now, mask=live)
            tl.store(attend + p, (now >= 0).to(tl.int8), mask=live)
            n_taken += tl.sum(take.to(tl.int32), axis=0)
            n_ties += tl.sum(tie.to(tl.int32), axis=0)
        tl.store(attend + positions, 0)


def placement_tuning(positions: int) -> tuple[int, int]:
    """(positions per loop step, warps) of the placement kernels for buffers of ``positions``: a program
    per (batch row, head) walks its positions several times, so at batch 1 a few programs do all the
    work, and wider steps with more warps keep more loads in flight (H200, one layer at 1 x 128K with
    resident_extra 1: 300 -> 166 us; BENCHMARKS.md, "Row reuse")."""
    if BLOCK is not None:
        return BLOCK, 4
    return (4096, 16) if positions >= 16384 else (2048, 8)


def _launch_place(
    slots: torch.Tensor,
    position_of: torch.Tensor,
    indices: torch.Tensor,
    selected: torch.Tensor,
    age: torch.Tensor | None = None,
) -> Placement:
    """``_place`` on CUDA, or with ``age`` given ``_place_recent``."""
    batch, heads, positions = slots.shape
    k = indices.shape[-1]
    device = slots.device
    missing = torch.empty(batch, heads, k, dtype=torch.int64, device=device)
    count = torch.empty(batch, heads, dtype=torch.int32, device=device)
    destination = torch.empty(batch, heads, k, dtype=torch.int32, device=device)
    attend = torch.empty(batch, heads, positions + 1, dtype=torch.bool, device=device)
    kept = torch.empty(batch, heads, positions, dtype=torch.int8, device=device)  # scratch
    common = (indices.contiguous(), selected.contiguous().view(torch.int8), missing, count, destination)
    common += (attend.view(torch.int8), kept, k, positions, position_of.shape[-1])
    block, warps = placement_tuning(positions)
    if age is None:
        _place_kernel[(batch * heads,)](slots, position_of, *common, block=block, num_warps=warps)
    else:
        key_bins = triton.next_power_of_2(AGE_CAP + 3)  # the keys -1 .. AGE_CAP + 1, shifted by one
        _place_recent_kernel[(batch * heads,)](
            slots, position_of, age, *common, block=block, age_cap=AGE_CAP, key_bins=key_bins, num_warps=warps
        )
    return Placement(missing, count, destination, attend)
