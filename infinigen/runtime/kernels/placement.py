"""The placement of ``reuse.ResidentRows`` as Triton kernels, for CUDA (``reuse`` holds the same
placement in PyTorch, the CPU path and the reference of the tests): one kernel per layer, a program per
(batch row, head), or at small batches three kernels with several programs per (batch row, head)
(``placement_splits``). Device work only, fixed shapes: it runs inside captured
selections; the outputs are ``reuse.Placement``'s fields."""

from __future__ import annotations

import torch

from infinigen.runtime.kernels.triton_support import tl, triton

BLOCK: int | None = None  # positions or selected slots per loop step (None: placement_tuning)
SPLITS: int | None = None  # programs per (batch row, head) (None: placement_splits)
MAX_SPLITS = 16  # each program of the cut reads every share's histogram: splits x key bins values
SPLIT_POSITIONS = 2048  # positions per program worth a share of their own
BUSY_PROGRAMS = 128  # (batch row, head) pairs from which one program each already fills the GPU

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
    def _fill_free(
        slots, position_of, missing, destination, attend, kept, start, end, n_moving, n_free, block: tl.constexpr
    ):
        """Positions [start, end): the rows not kept leave, and the moving rows take the free positions in
        order (``n_free`` free positions before ``start``). Returns how many of them hold a row."""
        n_free += tl.zeros([], dtype=tl.int32)  # a tensor before the loop, where 0 may be passed as a constant
        n_held = tl.zeros([], dtype=tl.int32)
        for first in range(start, end, block):
            p = first + tl.arange(0, block)
            live = p < end
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
            n_held += tl.sum((live & (now >= 0)).to(tl.int32), axis=0)
        return n_held

    @triton.jit
    def _place_kernel(
        slots, position_of, indices, selected, missing, count, destination, attend, held, kept,
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
        n_held = _fill_free(slots, position_of, missing, destination, attend, kept, 0, positions, n_moving, 0, block)
        tl.store(attend + positions, 0)
        tl.store(held + bh, n_held)

    @triton.jit
    def _eviction_key(slots, kept, age, p, live, age_cap: tl.constexpr):
        """Which places new rows take first: free ones (``age_cap`` + 1), then by age; kept rows and
        lanes past the end -1 (never taken)."""
        held = tl.load(slots + p, mask=live, other=0) >= 0
        keep = tl.load(kept + p, mask=live, other=1) != 0
        return tl.where(keep, -1, tl.where(held, tl.load(age + p, mask=live, other=0), age_cap + 1))

    @triton.jit
    def _age_and_count(
        slots, kept, age, start, end, block: tl.constexpr, age_cap: tl.constexpr, key_bins: tl.constexpr
    ):
        """Positions [start, end) a step older (the rows selected again: age 0), and how many of them
        hold each eviction key (bin key + 1; bin 0: the kept rows' -1 and the lanes past the end)."""
        counts = tl.zeros([key_bins], dtype=tl.int32)
        for first in range(start, end, block):
            p = first + tl.arange(0, block)
            live = p < end
            keep = tl.load(kept + p, mask=live, other=1) != 0
            now_age = tl.where(keep, 0, tl.minimum(tl.load(age + p, mask=live, other=0) + 1, age_cap))
            tl.store(age + p, now_age, mask=live)
            held = tl.load(slots + p, mask=live, other=0) >= 0
            counts += tl.histogram(tl.where(keep, -1, tl.where(held, now_age, age_cap + 1)) + 1, key_bins)
        return counts

    @triton.jit
    def _cut(counts, n_moving, age_cap: tl.constexpr, key_bins: tl.constexpr):
        """The key at the cut, the largest with at least ``n_moving`` places at or above it (the kept
        rows' -1 never), and how many places of that key the new rows take (the first, by position)."""
        key_of = tl.arange(0, key_bins) - 1
        at_least = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0) + counts  # places with key >= key_of
        low = tl.max(tl.where((key_of >= 0) & (key_of <= age_cap + 1) & (at_least >= n_moving), key_of, 0), axis=0)
        return low, n_moving - tl.sum(tl.where(key_of > low, counts, 0), axis=0)

    @triton.jit
    def _take_places(
        slots, position_of, age, missing, destination, attend, kept, start, end, low, ties_taken, n_taken, n_ties,
        block: tl.constexpr, age_cap: tl.constexpr,
    ):  # fmt: skip
        """Positions [start, end): the places of key above the cut, and of the cut's key the first
        ``ties_taken`` overall, take the next moving rows (``n_taken`` and ``n_ties`` taken / seen before).
        Returns how many of the positions hold a row."""
        n_taken += tl.zeros([], dtype=tl.int32)  # a tensor before the loop, where 0 may be passed as a constant
        n_ties += tl.zeros([], dtype=tl.int32)
        n_held = tl.zeros([], dtype=tl.int32)
        for first in range(start, end, block):
            p = first + tl.arange(0, block)
            live = p < end
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
            n_held += tl.sum((live & (now >= 0)).to(tl.int32), axis=0)
        return n_held

    @triton.jit
    def _place_recent_kernel(
        slots, position_of, age, indices, selected, missing, count, destination, attend, held, kept,
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
        counts = _age_and_count(slots, kept, age, 0, positions, block, age_cap, key_bins)
        tl.debug_barrier()
        low, ties_taken = _cut(counts, n_moving, age_cap, key_bins)
        n_held = _take_places(
            slots, position_of, age, missing, destination, attend, kept, 0, positions, low, ties_taken, 0, 0,
            block, age_cap,
        )  # fmt: skip
        tl.store(attend + positions, 0)
        tl.store(held + bh, n_held)

    # --- either placement over several programs per (batch row, head) ---------------------------------
    # At batch 1 a program per head leaves most of the GPU idle while each walks tens of thousands of
    # positions. Split, the same placement takes three launches, each over a program's share of the
    # selected slots and of the positions: marks and counts; ``missing`` (after the earlier shares'
    # counts), and per share the free positions or (``recent``) ages and a key histogram; the places
    # taken, each share's first rank from the earlier shares' counts (above and at the cut).

    @triton.jit
    def _share(s, n, share):
        """The [start, end) of share ``s`` of ``n`` items in shares of ``share``."""
        return s * share, tl.minimum((s + 1) * share, n)

    @triton.jit
    def _split_mark_kernel(
        position_of, indices, selected, kept, moving, held, k, positions, capacity, share_k, splits,
        block: tl.constexpr,
    ):  # fmt: skip
        """Marks ``kept`` (zeroed before) for a share of the selected slots; their count not resident.
        Zeroes ``held``, which the place kernel's shares add to."""
        bh, s = tl.program_id(0), tl.program_id(1)
        tl.store(held + bh, 0, mask=s == 0)
        position_of += bh * capacity
        kept += bh * positions
        start, end = _share(s, k, share_k)
        n_moving = 0
        for first in range(start, end, block):
            j = first + tl.arange(0, block)
            chosen = tl.load(selected + bh * k + j, mask=j < end, other=0) != 0
            at = tl.load(position_of + tl.load(indices + bh * k + j, mask=chosen, other=0), mask=chosen, other=-1)
            tl.store(kept + at, tl.full([block], 1, dtype=tl.int8), mask=chosen & (at >= 0))
            n_moving += tl.sum((chosen & (at < 0)).to(tl.int32), axis=0)
        tl.store(moving + bh * splits + s, n_moving)

    @triton.jit
    def _split_count_kernel(
        slots, position_of, age, indices, selected, missing, count, kept, moving, counts,
        k, positions, capacity, share_k, share_p, splits,
        block: tl.constexpr, splits_pow2: tl.constexpr, age_cap: tl.constexpr, key_bins: tl.constexpr,
        recent: tl.constexpr,
    ):  # fmt: skip
        """A share's slots not resident to ``missing``, in order; then how many of its positions are free
        (not kept), or with ``recent`` the positions a step older and the histogram of their eviction
        keys (as ``_place_recent_kernel``'s), to ``counts`` (``key_bins`` values per share)."""
        bh, s = tl.program_id(0), tl.program_id(1)
        position_of += bh * capacity
        slots, kept, age = slots + bh * positions, kept + bh * positions, age + bh * positions
        share = tl.arange(0, splits_pow2)
        per_share = tl.load(moving + bh * splits + share, mask=share < splits, other=0)
        tl.store(count + bh, tl.sum(per_share, axis=0), mask=s == 0)
        n_moving = tl.sum(tl.where(share < s, per_share, 0), axis=0)
        start, end = _share(s, k, share_k)
        for first in range(start, end, block):
            j = first + tl.arange(0, block)
            chosen = tl.load(selected + bh * k + j, mask=j < end, other=0) != 0
            slot = tl.load(indices + bh * k + j, mask=chosen, other=0)
            moves = chosen & (tl.load(position_of + slot, mask=chosen, other=0) < 0)
            rank = n_moving + tl.cumsum(moves.to(tl.int32), axis=0) - 1
            tl.store(missing + bh * k + rank, slot, mask=moves)
            n_moving += tl.sum(moves.to(tl.int32), axis=0)
        start, end = _share(s, positions, share_p)
        counts += (bh * splits + s) * key_bins
        if recent:
            tl.store(
                counts + tl.arange(0, key_bins), _age_and_count(slots, kept, age, start, end, block, age_cap, key_bins)
            )
        else:
            n_free = 0
            for first in range(start, end, block):
                p = first + tl.arange(0, block)
                live = p < end
                n_free += tl.sum((live & (tl.load(kept + p, mask=live, other=1) == 0)).to(tl.int32), axis=0)
            tl.store(counts, n_free)

    @triton.jit
    def _split_place_kernel(
        slots, position_of, age, missing, count, destination, attend, held, kept, counts,
        k, positions, capacity, share_p, splits,
        block: tl.constexpr, splits_pow2: tl.constexpr, age_cap: tl.constexpr, key_bins: tl.constexpr,
        recent: tl.constexpr,
    ):  # fmt: skip
        """A share's places taken by the moving rows, from every share's ``counts``."""
        bh, s = tl.program_id(0), tl.program_id(1)
        slots, position_of, destination, attend, missing = (
            slots + bh * positions, position_of + bh * capacity, destination + bh * k,
            attend + bh * (positions + 1), missing + bh * k,
        )  # fmt: skip
        kept = kept + bh * positions
        share = tl.arange(0, splits_pow2)
        start, end = _share(s, positions, share_p)
        if recent:
            age += bh * positions
            key_of = tl.arange(0, key_bins) - 1
            at = (bh * splits + share[:, None]) * key_bins + tl.arange(0, key_bins)[None, :]
            per_share = tl.load(counts + at, mask=(share < splits)[:, None], other=0)  # (splits_pow2, key_bins)
            low, ties_taken = _cut(tl.sum(per_share, axis=0), tl.load(count + bh), age_cap, key_bins)
            above = tl.sum(tl.where(key_of[None, :] > low, per_share, 0), axis=1)  # (splits_pow2,) per share
            ties = tl.sum(tl.where(key_of[None, :] == low, per_share, 0), axis=1)
            n_ties = tl.sum(tl.where(share < s, ties, 0), axis=0)
            n_taken = tl.sum(tl.where(share < s, above, 0), axis=0) + tl.minimum(n_ties, ties_taken)
            n_held = _take_places(
                slots, position_of, age, missing, destination, attend, kept, start, end, low, ties_taken,
                n_taken, n_ties, block, age_cap,
            )  # fmt: skip
        else:
            free = tl.load(counts + bh * splits + share, mask=share < s, other=0)
            n_held = _fill_free(
                slots, position_of, missing, destination, attend, kept, start, end, tl.load(count + bh),
                tl.sum(free, axis=0), block,
            )  # fmt: skip
        tl.store(attend + positions, 0, mask=s == 0)
        tl.atomic_add(held + bh, n_held)


def placement_tuning(positions: int) -> tuple[int, int]:
    """(positions per loop step, warps) of the placement kernels for buffers of ``positions``: a program
    walks its positions several times, so wider steps with more warps keep more loads in flight
    (H200, one layer at 1 x 128K with resident_extra 1: 300 -> 166 us; BENCHMARKS.md, "Row reuse")."""
    if BLOCK is not None:
        return BLOCK, 4
    return (4096, 16) if positions >= 16384 else (2048, 8)


def placement_splits(rows: int, positions: int) -> int:
    """Programs per (batch row, head) for the placement of ``rows`` (batch row, head) pairs over
    ``positions``: several where few pairs would leave the GPU idle, each share at least
    ``SPLIT_POSITIONS`` long."""
    if SPLITS is not None:
        return SPLITS
    return max(1, min(positions // SPLIT_POSITIONS, BUSY_PROGRAMS // rows, MAX_SPLITS))


def launch(
    slots: torch.Tensor,
    position_of: torch.Tensor,
    indices: torch.Tensor,
    selected: torch.Tensor,
    age: torch.Tensor | None,
    age_cap: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``reuse._place`` on CUDA, or with ``age`` given ``reuse._place_recent``: (missing, count,
    destination, attend, held) as ``reuse.Placement`` holds them; ``slots``, ``position_of`` and
    ``age`` updated in place."""
    batch, heads, positions = slots.shape
    k = indices.shape[-1]
    device = slots.device
    missing = torch.empty(batch, heads, k, dtype=torch.int64, device=device)
    count = torch.empty(batch, heads, dtype=torch.int32, device=device)
    destination = torch.empty(batch, heads, k, dtype=torch.int32, device=device)
    attend = torch.empty(batch, heads, positions + 1, dtype=torch.bool, device=device)
    held = torch.empty(batch, heads, dtype=torch.int32, device=device)
    indices, selected = indices.contiguous(), selected.contiguous().view(torch.int8)
    capacity = position_of.shape[-1]
    splits = placement_splits(batch * heads, positions)
    if splits > 1:
        outputs = (missing, count, destination, attend, held)
        _launch_split(slots, position_of, age, indices, selected, *outputs, age_cap, splits)
        return outputs
    kept = torch.empty(batch, heads, positions, dtype=torch.int8, device=device)  # scratch
    outputs = (missing, count, destination, attend.view(torch.int8), held)
    common = (indices, selected, *outputs, kept, k, positions, capacity)
    block, warps = placement_tuning(positions)
    if age is None:
        _place_kernel[(batch * heads,)](slots, position_of, *common, block=block, num_warps=warps)
    else:
        _place_recent_kernel[(batch * heads,)](
            slots, position_of, age, *common, block=block, age_cap=age_cap, key_bins=_key_bins(age_cap), num_warps=warps
        )
    return missing, count, destination, attend, held


def _key_bins(age_cap: int) -> int:
    return triton.next_power_of_2(age_cap + 3)  # the keys -1 .. age_cap + 1, shifted by one


def _launch_split(
    slots: torch.Tensor,
    position_of: torch.Tensor,
    age: torch.Tensor | None,
    indices: torch.Tensor,
    selected: torch.Tensor,
    missing: torch.Tensor,
    count: torch.Tensor,
    destination: torch.Tensor,
    attend: torch.Tensor,
    held: torch.Tensor,
    age_cap: int,
    splits: int,
) -> None:
    """Either placement (``age`` given: keep_recent) in three launches of ``splits`` programs per
    (batch row, head), into ``missing``, ``count``, ``destination``, ``attend`` and ``held``."""
    batch, heads, positions = slots.shape
    k = indices.shape[-1]
    recent = age is not None
    rows, key_bins = batch * heads, _key_bins(age_cap) if recent else 1
    kept = torch.zeros(batch, heads, positions, dtype=torch.int8, device=slots.device)  # scratch
    moving = torch.empty(rows, splits, dtype=torch.int32, device=slots.device)  # scratch: per share
    counts = torch.empty(rows, splits, key_bins, dtype=torch.int32, device=slots.device)  # scratch: per share
    share_k, share_p = -(-k // splits), -(-positions // splits)
    block, warps = placement_tuning(share_p)
    shape = dict(block=block, num_warps=warps)
    sizes = dict(splits_pow2=triton.next_power_of_2(splits), age_cap=age_cap, key_bins=key_bins, recent=recent)
    grid = (rows, splits)
    capacity = position_of.shape[-1]
    age = age if recent else slots  # not read without keep_recent
    _split_mark_kernel[grid](
        position_of, indices, selected, kept, moving, held, k, positions, capacity, share_k, splits, **shape
    )
    _split_count_kernel[grid](
        slots, position_of, age, indices, selected, missing, count, kept, moving, counts,
        k, positions, capacity, share_k, share_p, splits, **shape, **sizes,
    )  # fmt: skip
    _split_place_kernel[grid](
        slots, position_of, age, missing, count, destination, attend.view(torch.int8), held, kept, counts,
        k, positions, capacity, share_p, splits, **shape, **sizes,
    )  # fmt: skip
