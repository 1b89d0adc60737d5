"""The highest-scoring slots of each row, in slot order: what a speculating policy fetches.

``top_slots(scores, count, k_max)`` keeps, per row, the ``count`` best-scoring slots, ascending (the
order the gather reads the pool in). PyTorch needs a top-k over the whole row and a sort of the kept
slots; at 20% of 32K tokens both sort thousands of elements per row (~150 us of a layer's ~300 us
selection, in an H200 profile). On CUDA a radix select finds each row's threshold in four passes of 4-bit
digits over the top 16 bits of the scores' order-preserving bit pattern (the score truncated to
bfloat16: speculated scores carry no more precision than that), each pass a 16-bin histogram of the
row split over many programs; a prefix-sum compaction then writes the kept slots in order. Eight
small kernels (two of them fills), no sort.

Both paths rank the same way (scores equal to bfloat16 precision tie; ties keep the lowest slots):
the CPU path (a stable sort) gives the slots the CUDA kernels give.
"""

from __future__ import annotations

import math

import torch

from infinigen.runtime.transfer import triton

CHUNK = 4096  # slots per program
PASSES, DIGIT_BITS = 4, 4  # 16 key bits, 16 bins a pass


def first_ranks(ranked: torch.Tensor, count: torch.Tensor, n: int) -> torch.Tensor:
    """The first count[b] slots of each ranked row (B, kv_heads, K), ascending; the rest sort last
    (clamped to a real slot: never fetched, since the gather stops at the count)."""
    rank = torch.arange(ranked.shape[-1], device=ranked.device)
    kept = torch.where(rank < count[:, None, None], ranked, n)
    return kept.sort(dim=-1).values.clamp(max=n - 1)


def truncated(scores: torch.Tensor) -> torch.Tensor:
    """float32 scores cut to their top 16 bits (bfloat16, rounded toward zero): the ranking key."""
    return (scores.float().contiguous().view(torch.int32) & -65536).view(torch.float32)


def top_slots(scores: torch.Tensor, count: torch.Tensor, k_max: int) -> torch.Tensor:
    """scores (B, heads, n) float32 (-inf for empty slots), count (B,) int with count <= k_max <= n
    -> (B, heads, k_max) int64: each row's count[b] best slots ascending, then n - 1 (never fetched:
    the gather stops at the count). Scores rank truncated to bfloat16; ties keep the lowest slots."""
    if triton is not None and scores.device.type == "cuda":
        return _radix_top_slots(scores, count, k_max)
    ranked = truncated(scores).sort(dim=-1, descending=True, stable=True).indices[..., :k_max]
    return first_ranks(ranked, count, scores.shape[-1])


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _keys(scores, row, n, chunk_start, chunk: tl.constexpr):
        """The slots of one chunk and the top 16 bits of their scores' order-preserving keys."""
        slot = chunk_start + tl.arange(0, chunk)
        live = slot < n
        bits = tl.load(scores + row * n + slot, mask=live, other=0.0).to(tl.uint32, bitcast=True)
        bits = tl.where(bits == 0x80000000, 0, bits)  # -0.0 ties with 0.0
        key = tl.where((bits >> 31) == 1, ~bits, bits | 0x80000000) >> 16
        return slot, live, key

    @triton.jit
    def _threshold(histograms, count, row, rows, heads, passes: tl.constexpr, bits: tl.constexpr):
        """After ``passes`` histogram passes: the key prefix that the row's count-th largest key starts
        with, and how many keys with that prefix are still to keep. Every program walks the earlier
        passes' histograms (16 counts each) itself: cheaper than a kernel per pass to store it."""
        bins: tl.constexpr = 1 << bits
        digit = tl.arange(0, bins)
        prefix = tl.full((), 0, tl.uint32)
        wanted = tl.load(count + row // heads).to(tl.int32)
        for p in tl.static_range(passes):
            counts = tl.load(histograms + (p * rows + row) * bins + digit)
            at_or_above = tl.sum(counts) - tl.cumsum(counts, 0) + counts  # keys with this digit or a higher one
            chosen = tl.max(tl.where(at_or_above >= wanted, digit, 0))
            wanted -= tl.sum(tl.where(digit > chosen, counts, 0))
            prefix = (prefix << bits) | chosen.to(tl.uint32)
        return prefix, wanted

    @triton.jit
    def _histogram_kernel(
        scores,  # (rows, n) float32
        count,  # (B,) int: keys kept in each row of batch row b
        histograms,  # (passes, rows, bins) int32, zeroed, filled pass by pass
        n,
        heads,
        done: tl.constexpr,  # passes before this one
        bits: tl.constexpr,
        chunk: tl.constexpr,
    ):
        row, rows = tl.program_id(0), tl.num_programs(0)
        _, live, key = _keys(scores, row, n, tl.program_id(1) * chunk, chunk)
        prefix, _ = _threshold(histograms, count, row, rows, heads, done, bits)
        shift: tl.constexpr = 16 - (done + 1) * bits
        match = live & ((key >> (shift + bits)) == prefix)
        digit = ((key >> shift) & ((1 << bits) - 1)).to(tl.int32)
        counts = tl.histogram(tl.where(match, digit, 0), 1 << bits)
        index = tl.arange(0, 1 << bits)
        counts -= tl.where(index == 0, chunk - tl.sum(match.to(tl.int32)), 0)  # keys not matching: not counted
        tl.atomic_add(histograms + (done * rows + row) * (1 << bits) + index, counts)

    @triton.jit
    def _tally_kernel(scores, count, histograms, tally, n, heads, chunks, bits: tl.constexpr, chunk: tl.constexpr):
        """tally[row, 0 or 1, c]: keys above / equal to the row's threshold in chunk c."""
        row, c, rows = tl.program_id(0), tl.program_id(1), tl.num_programs(0)
        _, live, key = _keys(scores, row, n, c * chunk, chunk)
        threshold, _ = _threshold(histograms, count, row, rows, heads, 16 // bits, bits)
        tl.store(tally + (row * 2) * chunks + c, tl.sum((live & (key > threshold)).to(tl.int32)))
        tl.store(tally + (row * 2 + 1) * chunks + c, tl.sum((live & (key == threshold)).to(tl.int32)))

    @triton.jit
    def _write_kernel(
        scores,
        count,
        histograms,
        tally,
        out,  # (rows, k_max) int64
        n,
        heads,
        chunks,
        k_max,
        bits: tl.constexpr,
        chunk: tl.constexpr,
        chunks_pow2: tl.constexpr,
    ):
        """Each kept slot at its rank among the row's kept slots: every key above the threshold, and
        the first keys equal to it."""
        row, c, rows = tl.program_id(0), tl.program_id(1), tl.num_programs(0)
        slot, live, key = _keys(scores, row, n, c * chunk, chunk)
        threshold, ties = _threshold(histograms, count, row, rows, heads, 16 // bits, bits)
        earlier = tl.arange(0, chunks_pow2)
        greater_before = tl.sum(tl.load(tally + (row * 2) * chunks + earlier, mask=earlier < c, other=0))
        equal_before = tl.sum(tl.load(tally + (row * 2 + 1) * chunks + earlier, mask=earlier < c, other=0))
        greater = (live & (key > threshold)).to(tl.int32)
        equal = (live & (key == threshold)).to(tl.int32)
        keep = (greater == 1) | ((equal == 1) & (equal_before + tl.cumsum(equal, 0) - equal < ties))
        kept = keep.to(tl.int32)
        position = greater_before + tl.minimum(equal_before, ties) + tl.cumsum(kept, 0) - kept
        tl.store(out + row * k_max + position, slot.to(tl.int64), mask=keep & (position < k_max))


def _radix_top_slots(scores: torch.Tensor, count: torch.Tensor, k_max: int) -> torch.Tensor:
    batch, heads, n = scores.shape
    rows, chunks = batch * heads, math.ceil(n / CHUNK)
    flat, device = scores.contiguous(), scores.device
    histograms = torch.zeros(PASSES, rows, 1 << DIGIT_BITS, dtype=torch.int32, device=device)
    grid = (rows, chunks)
    for done in range(PASSES):
        _histogram_kernel[grid](flat, count, histograms, n, heads, done=done, bits=DIGIT_BITS, chunk=CHUNK)
    tally = torch.empty(rows, 2, chunks, dtype=torch.int32, device=device)
    _tally_kernel[grid](flat, count, histograms, tally, n, heads, chunks, bits=DIGIT_BITS, chunk=CHUNK)
    out = torch.full((batch, heads, k_max), n - 1, dtype=torch.int64, device=device)
    _write_kernel[grid](
        flat,
        count,
        histograms,
        tally,
        out,
        n,
        heads,
        chunks,
        k_max,
        bits=DIGIT_BITS,
        chunk=CHUNK,
        chunks_pow2=triton.next_power_of_2(chunks),
    )
    return out
