"""The highest-scoring slots of each row, in slot order: what a speculating policy fetches.

``top_slots(scores, rule, k_max)`` keeps, per row, the best-scoring slots, as many as ``CountRule``
says for its batch row, ascending (the order the gather reads the pool in). PyTorch needs a
top-k over the whole row and a sort of the kept slots; at 20% of 32K tokens both sort thousands of
elements per row (~150 us of a layer's ~300 us selection, in an H200 profile), and the count
itself takes a dozen small reductions and element-wise kernels. On CUDA four kernels and a fill do
all of it:

- the first radix pass tallies, per chunk of a row, its finite scores and those within ``alpha`` of
  the row's best (from the scoring kernel's per-tile maxima), which give every later kernel the
  row's count, and histograms the top 8-bit digit of each score's order-preserving key;
- a second pass narrows the threshold over the next 8 of the top 16 key bits (the score truncated
  to bfloat16: speculated scores carry no more precision than that), a 256-bin histogram per chunk
  (no atomics, no zero-filled buffers);
- a tally and a prefix-sum compaction write the kept slots in order, and the counts.

Both paths rank the same way (scores equal to bfloat16 precision tie; ties keep the lowest slots)
and count the same way (in integers where rounding could differ): the CPU path (a stable sort)
gives the slots and counts the CUDA kernels give.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from infinigen.runtime.kernels.triton_support import on_triton, tl, triton

CHUNK = 4096  # slots per program
# The score of a slot a policy always fetches (sinks, a recent window): it ranks first, counts as
# within alpha of the best, and is left out of the best itself. Finite: the radix keys stay ordered.
FORCED = 1e30
PASSES, DIGIT_BITS = 2, 8  # 16 key bits, 256 bins a pass (4 x 4: two more kernels, 2% slower at 1 x 32K 10% on an H100)


@dataclass(frozen=True)
class CountRule:
    """How many slots each batch row keeps (InfiniGen's speculation): the tokens scoring within
    ``alpha`` of their head's best, averaged over the row's heads (rounded half to even), at least
    min(cached, min_tokens) and at most ceil(budget * cached), cached = the row's most finite
    scores in one head (empty slots score -inf). Rows never influence each other.

    Under tensor parallelism each rank scores its own KV heads. ``group``: the process group whose
    ranks hold the model's other heads; the two per-row tallies (tokens within alpha, summed over
    heads; cached, the most over heads) are then all-reduced once per layer and step, so every rank
    counts as one process would and the tokens equal one process's. Only a finite alpha needs it:
    every head caches the same slots of a row (padding is per row; a full pool overwrites one slot per
    head and step), so with alpha = inf (the default) every head's tally is the row's cached tokens
    and each rank alone already counts what one process counts: no communication (the policy passes
    no group)."""

    budget: float
    alpha: float
    min_tokens: int
    group: object | None = None

    def counts(self, scores: torch.Tensor) -> torch.Tensor:
        """scores (B, heads, n) float -> (B,) int32."""
        heads = scores.shape[1]
        cached = (scores > -math.inf).sum(dim=-1).amax(dim=1)  # (B,)
        best = scores.masked_fill(scores >= FORCED, -math.inf).amax(dim=-1, keepdim=True)
        above = (scores > best - self.alpha).sum(dim=(1, 2))  # (B,) summed over the heads
        if self.group is not None:
            dist.all_reduce(above, group=self.group)
            dist.all_reduce(cached, op=dist.ReduceOp.MAX, group=self.group)
            heads *= dist.get_world_size(self.group)
        whole, rest = above // heads, above % heads
        rounded = whole + ((2 * rest > heads) | ((2 * rest == heads) & (whole % 2 == 1))).long()
        cap = budget_count(cached, self.budget, self.min_tokens)
        return rounded.maximum(cached.clamp(max=self.min_tokens)).minimum(cap).to(torch.int32)


def budget_count(cached: torch.Tensor, budget: float, min_tokens: int) -> torch.Tensor:
    """The slots a budgeted selection keeps per batch row, on the device: the budget's share of the
    ``cached`` tokens (B,), at least ``min_tokens``, at most ``cached`` (``rows_bound`` bounds it)."""
    share = (cached.float() * budget).ceil().clamp(min=min_tokens)
    return share.minimum(cached.float()).to(torch.int32)


def first_ranks(ranked: torch.Tensor, count: torch.Tensor, n: int) -> torch.Tensor:
    """The first count[b] slots of each ranked row (B, kv_heads, K), ascending; the rest sort last
    (clamped to a real slot: never fetched, since the gather stops at the count)."""
    rank = torch.arange(ranked.shape[-1], device=ranked.device)
    kept = torch.where(rank < count[:, None, None], ranked, n)
    return kept.sort(dim=-1).values.clamp(max=n - 1)


def truncated(scores: torch.Tensor) -> torch.Tensor:
    """float32 scores cut to their top 16 bits (bfloat16, rounded toward zero): the ranking key."""
    return (scores.float().contiguous().view(torch.int32) & -65536).view(torch.float32)


def top_slots(
    scores: torch.Tensor, rule: CountRule, k_max: int, tile_max: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """scores (B, heads, n) float32 (-inf for empty slots), k_max >= every count the rule can give
    -> (slots (B, heads, k_max) int64: each row's count[b] best slots ascending, then n - 1, never
    fetched: the gather stops at the count; count (B,) int32). Scores rank truncated to bfloat16;
    ties keep the lowest slots. ``tile_max`` (B * heads, tiles): maxima of consecutive tiles of each
    row (``scoring.fused_group_scores`` gives them), which the CUDA path reads instead of a reduction."""
    if on_triton(scores.device) and rule.group is None:  # the kernels count per rank
        return _radix_top_slots(scores, rule, k_max, tile_max)
    count = rule.counts(scores)
    ranked = truncated(scores).sort(dim=-1, descending=True, stable=True).indices[..., :k_max]
    return first_ranks(ranked, count, scores.shape[-1]), count


if triton is not None:

    @triton.jit
    def _keys(scores, row, n, chunk_start, chunk: tl.constexpr):
        """The slots of one chunk, their scores (-inf past n), and the top 16 bits of the scores'
        order-preserving keys."""
        slot = chunk_start + tl.arange(0, chunk)
        live = slot < n
        values = tl.load(scores + row * n + slot, mask=live, other=-float("inf"))
        bits = values.to(tl.uint32, bitcast=True)
        bits = tl.where(bits == 0x80000000, 0, bits)  # -0.0 ties with 0.0
        key = tl.where((bits >> 31) == 1, ~bits, bits | 0x80000000) >> 16
        return slot, live, values, key

    @triton.jit
    def _count(
        tallies,
        row,
        heads,
        chunks,
        budget,
        min_tokens: tl.constexpr,
        heads_pow2: tl.constexpr,
        chunks_pow2: tl.constexpr,
    ):
        """``CountRule.counts`` for the batch row of ``row``, from the first pass's per-chunk tallies
        (B * heads, 2, chunks): finite scores, scores within alpha of the row's best."""
        h = tl.arange(0, heads_pow2)
        c = tl.arange(0, chunks_pow2)
        at = (((row // heads) * heads + h) * 2 * chunks)[:, None] + c[None, :]
        mask = (h < heads)[:, None] & (c < chunks)[None, :]
        cached = tl.max(tl.sum(tl.load(tallies + at, mask=mask, other=0), axis=1), axis=0)
        above = tl.sum(tl.sum(tl.load(tallies + at + chunks, mask=mask, other=0), axis=1), axis=0)
        whole, rest = above // heads, above % heads
        rounded = whole + ((2 * rest > heads) | ((2 * rest == heads) & (whole % 2 == 1))).to(tl.int32)
        cap = tl.minimum(tl.maximum(tl.ceil(cached.to(tl.float32) * budget), min_tokens), cached.to(tl.float32))
        return tl.minimum(tl.maximum(rounded, tl.minimum(cached, min_tokens)).to(tl.float32), cap).to(tl.int32)

    @triton.jit
    def _threshold(
        histograms, row, rows, chunks, wanted, passes: tl.constexpr, bits: tl.constexpr, chunks_pow2: tl.constexpr
    ):
        """After ``passes`` histogram passes: the key prefix that the row's wanted-th largest key
        starts with, and how many keys with that prefix are still to keep. Every program sums the
        earlier passes' per-chunk histograms itself: cheaper than a kernel per pass to do it once."""
        bins: tl.constexpr = 1 << bits
        digit = tl.arange(0, bins)
        c = tl.arange(0, chunks_pow2)
        prefix = tl.full((), 0, tl.uint32)
        for p in tl.static_range(passes):
            at = ((p * rows + row) * chunks + c[:, None]) * bins + digit[None, :]
            counts = tl.sum(tl.load(histograms + at, mask=(c < chunks)[:, None], other=0), axis=0)
            at_or_above = tl.sum(counts) - tl.cumsum(counts, 0) + counts  # keys with this digit or a higher one
            chosen = tl.max(tl.where(at_or_above >= wanted, digit, 0))
            wanted -= tl.sum(tl.where(digit > chosen, counts, 0))
            prefix = (prefix << bits) | chosen.to(tl.uint32)
        return prefix, wanted

    @triton.jit
    def _histogram_kernel(
        scores,  # (rows, n) float32
        tile_max,  # (rows, tiles) float32
        tallies,  # (rows, 2, chunks) int32, written by the first pass
        histograms,  # (passes, rows, chunks, bins) int32, filled pass by pass
        n,
        heads,
        tiles,
        alpha,
        budget,
        min_tokens: tl.constexpr,
        done: tl.constexpr,  # passes before this one
        bits: tl.constexpr,
        chunk: tl.constexpr,
        heads_pow2: tl.constexpr,
        chunks_pow2: tl.constexpr,
        tiles_pow2: tl.constexpr,
    ):
        row, c, rows, chunks = tl.program_id(0), tl.program_id(1), tl.num_programs(0), tl.num_programs(1)
        _, live, values, key = _keys(scores, row, n, c * chunk, chunk)
        shift: tl.constexpr = 16 - (done + 1) * bits
        if done == 0:  # the count's tallies; every key is a candidate
            t = tl.arange(0, tiles_pow2)
            best = tl.max(tl.load(tile_max + row * tiles + t, mask=t < tiles, other=-float("inf")))
            tl.store(tallies + (row * 2) * chunks + c, tl.sum((values > -float("inf")).to(tl.int32)))
            tl.store(tallies + (row * 2 + 1) * chunks + c, tl.sum((values > best - alpha).to(tl.int32)))
            match = live
        else:
            wanted = _count(tallies, row, heads, chunks, budget, min_tokens, heads_pow2, chunks_pow2)
            prefix, _ = _threshold(histograms, row, rows, chunks, wanted, done, bits, chunks_pow2)
            match = live & ((key >> (shift + bits)) == prefix)
        digit = ((key >> shift) & ((1 << bits) - 1)).to(tl.int32)
        counts = tl.histogram(tl.where(match, digit, 0), 1 << bits)
        index = tl.arange(0, 1 << bits)
        counts -= tl.where(index == 0, chunk - tl.sum(match.to(tl.int32)), 0)  # keys not matching: not counted
        tl.store(histograms + ((done * rows + row) * chunks + c) * (1 << bits) + index, counts)

    @triton.jit
    def _tally_kernel(
        scores,
        tallies,
        histograms,
        kept,  # (rows, 2, chunks) int32: keys above / equal to the row's threshold in each chunk
        n,
        heads,
        budget,
        min_tokens: tl.constexpr,
        bits: tl.constexpr,
        chunk: tl.constexpr,
        heads_pow2: tl.constexpr,
        chunks_pow2: tl.constexpr,
    ):
        row, c, rows, chunks = tl.program_id(0), tl.program_id(1), tl.num_programs(0), tl.num_programs(1)
        _, live, _, key = _keys(scores, row, n, c * chunk, chunk)
        wanted = _count(tallies, row, heads, chunks, budget, min_tokens, heads_pow2, chunks_pow2)
        threshold, _ = _threshold(histograms, row, rows, chunks, wanted, 16 // bits, bits, chunks_pow2)
        tl.store(kept + (row * 2) * chunks + c, tl.sum((live & (key > threshold)).to(tl.int32)))
        tl.store(kept + (row * 2 + 1) * chunks + c, tl.sum((live & (key == threshold)).to(tl.int32)))

    @triton.jit
    def _write_kernel(
        scores,
        tallies,
        histograms,
        kept,
        out,  # (rows, k_max) int64, filled with n - 1
        count,  # (B,) int32
        n,
        heads,
        k_max,
        budget,
        min_tokens: tl.constexpr,
        bits: tl.constexpr,
        chunk: tl.constexpr,
        heads_pow2: tl.constexpr,
        chunks_pow2: tl.constexpr,
    ):
        """Each kept slot at its rank among the row's kept slots: every key above the threshold, and
        the first keys equal to it; the first program of each batch row stores its count."""
        row, c, rows, chunks = tl.program_id(0), tl.program_id(1), tl.num_programs(0), tl.num_programs(1)
        slot, live, _, key = _keys(scores, row, n, c * chunk, chunk)
        wanted = _count(tallies, row, heads, chunks, budget, min_tokens, heads_pow2, chunks_pow2)
        tl.store(count + row // heads, wanted, mask=(row % heads == 0) & (c == 0))
        threshold, ties = _threshold(histograms, row, rows, chunks, wanted, 16 // bits, bits, chunks_pow2)
        earlier = tl.arange(0, chunks_pow2)
        greater_before = tl.sum(tl.load(kept + (row * 2) * chunks + earlier, mask=earlier < c, other=0))
        equal_before = tl.sum(tl.load(kept + (row * 2 + 1) * chunks + earlier, mask=earlier < c, other=0))
        greater = (live & (key > threshold)).to(tl.int32)
        equal = (live & (key == threshold)).to(tl.int32)
        keep = (greater == 1) | ((equal == 1) & (equal_before + tl.cumsum(equal, 0) - equal < ties))
        kept_here = keep.to(tl.int32)
        position = greater_before + tl.minimum(equal_before, ties) + tl.cumsum(kept_here, 0) - kept_here
        tl.store(out + row * k_max + position, slot.to(tl.int64), mask=keep & (position < k_max))


def _radix_top_slots(
    scores: torch.Tensor, rule: CountRule, k_max: int, tile_max: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, n = scores.shape
    rows, chunks = batch * heads, math.ceil(n / CHUNK)
    flat, device = scores.contiguous(), scores.device
    if tile_max is None:
        tile_max = flat.masked_fill(flat >= FORCED, -math.inf).amax(dim=-1).view(rows, 1)
    tile_max = tile_max.contiguous()
    tiles = tile_max.shape[-1]
    tallies = torch.empty(rows, 2, chunks, dtype=torch.int32, device=device)
    histograms = torch.empty(PASSES, rows, chunks, 1 << DIGIT_BITS, dtype=torch.int32, device=device)
    shared = dict(
        min_tokens=rule.min_tokens,
        bits=DIGIT_BITS,
        chunk=CHUNK,
        heads_pow2=triton.next_power_of_2(heads),
        chunks_pow2=triton.next_power_of_2(chunks),
    )
    grid = (rows, chunks)
    for done in range(PASSES):
        _histogram_kernel[grid](
            flat,
            tile_max,
            tallies,
            histograms,
            n,
            heads,
            tiles,
            rule.alpha,
            rule.budget,
            done=done,
            tiles_pow2=triton.next_power_of_2(tiles),
            **shared,
        )
    kept = torch.empty(rows, 2, chunks, dtype=torch.int32, device=device)
    _tally_kernel[grid](flat, tallies, histograms, kept, n, heads, rule.budget, **shared)
    out = torch.full((batch, heads, k_max), n - 1, dtype=torch.int64, device=device)
    count = torch.empty(batch, dtype=torch.int32, device=device)
    _write_kernel[grid](flat, tallies, histograms, kept, out, count, n, heads, k_max, rule.budget, **shared)
    return out, count
