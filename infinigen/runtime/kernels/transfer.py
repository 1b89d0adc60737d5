"""Row moves between the CPU KV pool and the compute device.

On CUDA with Triton, the GPU itself reads (gather) and writes (scatter) the selected rows of the
pinned pool through unified addressing: no CPU-side index_select, no staging copy, no host sync;
the number of rows to move can live on the GPU (``count``), so a data-dependent selection
never round-trips to the host. 8-bit rows (``int8_rows``) move as stored and are dequantised by the
gather itself, in registers, with their scales read from device memory, into the output's dtype:
the bytes over PCIe halve and no second pass over the rows is needed. Elsewhere the same operations
run as PyTorch indexing.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch

from infinigen.runtime.kernels import int8_rows
from infinigen.runtime.kernels.triton_support import on_triton, tl, triton


class BlockedRows(Protocol):
    """What the row moves read of a pool (``memory.pool.KVPool`` is one): rows of a (batch row, KV
    head) live in blocks of ``block_tokens`` slots; ``block_table`` holds the blocks' device-visible
    addresses for the kernels, ``blocks`` the tensors themselves for the PyTorch path."""

    blocks: list[torch.Tensor]  # each (B, H, block_tokens, 2, stored_dim)
    block_table: torch.Tensor  # (blocks,) int64 addresses
    block_tokens: int
    kv_bits: int
    scales: torch.Tensor | None  # (B, H, capacity, 2) float32 on the compute device (8-bit rows)
    factors: torch.Tensor | None  # (B, H, 2, d) float32 on the compute device: channels' factors (8-bit rows)
    gather_rows: int
    gather_programs: int | None
    shape: tuple[int, ...]  # a block's
    dtype: torch.dtype

    @property
    def capacity(self) -> int: ...


def gather_rows(
    pool: BlockedRows,
    indices: torch.Tensor,
    count: torch.Tensor | None,
    out: torch.Tensor,
    destination: torch.Tensor | None = None,
    out_scales: torch.Tensor | None = None,
) -> None:
    """out (B, H, 2, K, d) on the compute device <- pool rows indices (B, H, K): each pool row
    (K and V of one token) is split into the K plane and the V plane of its head. ``count``: rows
    per batch row (B,) or per head (B, H); the rest are zeros. ``destination`` (B, H, K): row j goes
    to position destination[j] of out (B, H, 2, P, d) instead, and nothing past the count is written.
    ``out_scales`` (B, H, 2, K or P) float32, with 8-bit rows: the codes land in ``out`` (int8) as stored
    and their scales there, for rows kept on the GPU in 8 bits (``reuse.ResidentRows``)."""
    if on_triton(out.device):
        _launch_gather(pool, indices, count, out, destination, out_scales)
        return
    batch, heads, k = indices.shape
    cpu_indices = indices.cpu()
    b = torch.arange(batch)[:, None, None].expand(batch, heads, k)
    h = torch.arange(heads)[None, :, None].expand(batch, heads, k)
    blocks, slots = cpu_indices // pool.block_tokens, cpu_indices % pool.block_tokens
    rows = torch.empty(batch, heads, k, *pool.shape[-2:], dtype=pool.dtype)
    for index, block in enumerate(pool.blocks):
        chosen = blocks == index
        rows[chosen] = block[b[chosen], h[chosen], slots[chosen]]
    scales = None
    if pool.kv_bits == 8:
        scales = pool.scales.cpu()[b, h, cpu_indices.clamp(0, pool.capacity - 1)]  # (B, H, K, 2)
        if out_scales is None:
            rows = int8_rows.decode(rows, scales, out.dtype, pool.factors.cpu()[:, :, None])
    past_count = torch.zeros(batch, heads, k, dtype=torch.bool)
    if count is not None:  # rows past the count are zeros, as on CUDA (their slots may be unwritten)
        past_count = torch.arange(k) >= count.cpu().view(batch, -1, 1).expand(batch, heads, 1)
        rows[past_count] = 0
        if scales is not None:
            scales[past_count] = 0
    if destination is None:
        out.copy_(rows.transpose(2, 3))
        if out_scales is not None:
            out_scales.copy_(scales.transpose(2, 3))
        return
    b, h, j = (~past_count).nonzero(as_tuple=True)
    at = destination.cpu()[b, h, j].long()
    out[b, h, :, at] = rows[b, h, j].to(out.device)
    if out_scales is not None:
        out_scales[b, h, :, at] = scales[b, h, j].to(out_scales.device)


def scatter_rows(pool: BlockedRows, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """pool[b, h, slots[b, h]] <- rows[b, h, 0] for rows (B, H, 1, 2, d): a decode step's row at each
    head's slot. (A prompt's runs of rows go as DMA copies: ``KVPool.write_range``.)"""
    if on_triton(rows.device):
        _launch_scatter(pool, slots, rows)
        return
    batch, heads = rows.shape[:2]
    cpu_slots, cpu_rows = slots.cpu(), rows[:, :, 0].cpu()
    b = torch.arange(batch)[:, None].expand(batch, heads)
    h = torch.arange(heads)[None, :].expand(batch, heads)
    blocks, offsets = cpu_slots // pool.block_tokens, cpu_slots % pool.block_tokens
    for index, block in enumerate(pool.blocks):
        chosen = blocks == index
        block[b[chosen], h[chosen], offsets[chosen]] = cpu_rows[chosen]


if triton is not None:

    @triton.jit
    def _offset(row, row_stride, position, position_stride):
        """row * row_stride + position * position_stride in 64 bits: program ids and integer arguments
        are 32-bit, and a buffer past 2^31 elements would otherwise be addressed out of bounds."""
        return row.to(tl.int64) * row_stride + position.to(tl.int64) * position_stride

    @triton.jit
    def _gather_kernel(
        table,
        scales,
        factors,
        indices,
        count,
        out,
        destination,
        out_scales,
        k,
        kv_heads,
        count_batch_stride,
        count_head_stride,
        head_stride,
        plane_stride,
        scale_head_stride,
        out_scale_head_stride,
        out_scale_plane_stride,
        chunks_per_head,
        n_chunks,
        has_count: tl.constexpr,
        has_destination: tl.constexpr,
        block_tokens: tl.constexpr,
        head_dim: tl.constexpr,
        int8: tl.constexpr,
        raw: tl.constexpr,
        row_pow2: tl.constexpr,
        rows_per_chunk: tl.constexpr,
    ):
        """Persistent: a bounded number of programs loop over all (batch*head, chunk of rows) pairs, so
        the gather keeps enough PCIe reads in flight while leaving SMs to the compute stream.
        With ``int8``, a pool row is 2 * head_dim int8 codes; what lands in ``out`` is each code times
        its plane's float32 scale, read from ``scales`` (B * H, capacity, 2) in device memory, and its
        column's factor, from ``factors`` (B * H, 2 * head_dim); with ``raw`` the codes as stored instead, and
        their scales into ``out_scales`` (B * H, 2, positions)."""
        row = 2 * head_dim
        col = tl.arange(0, row_pow2)
        in_row = (col < row)[None, :]
        dst_col = (col // head_dim) * plane_stride + col % head_dim  # column c: plane c // d (K or V), at c % d
        for chunk in range(tl.program_id(0), n_chunks, tl.num_programs(0)):
            bh = chunk // chunks_per_head
            j = (chunk % chunks_per_head) * rows_per_chunk + tl.arange(0, rows_per_chunk)
            at = (bh // kv_heads) * count_batch_stride + (bh % kv_heads) * count_head_stride
            limit = tl.minimum(tl.load(count + at), k) if has_count else k
            live = j < limit
            token = tl.load(indices + _offset(bh, k, j, 1), mask=live, other=0)
            base = tl.load(table + token // block_tokens, mask=live, other=0)
            pool_row = _offset(bh, block_tokens, token % block_tokens, 1)  # in the token's block
            element = tl.int8 if int8 else out.dtype.element_ty
            src = base.to(tl.pointer_type(element)) + pool_row * row
            values = tl.load(src[:, None] + col[None, :], mask=live[:, None] & in_row, other=0)
            if int8:
                at = scales + _offset(bh, scale_head_stride, token, 2)  # this slot's K scale; V's next
                k_scale = tl.load(at, mask=live, other=0)
                v_scale = tl.load(at + 1, mask=live, other=0)
                if not raw:
                    scale = tl.where((col < head_dim)[None, :], k_scale[:, None], v_scale[:, None])
                    factor = tl.load(factors + bh * row + col, mask=col < row, other=1.0)
                    values = values.to(tl.float32) * scale * factor[None, :]
            if has_destination:  # rows kept between steps (row reuse) stay: only moved rows are written
                position = tl.load(destination + _offset(bh, k, j, 1), mask=live, other=0)
                written = live
            else:  # rows past the count are zeros: never-initialised memory must not reach attention
                position = j
                written = j < k
            if raw:
                at = out_scales + _offset(bh, out_scale_head_stride, position, 1)
                tl.store(at, k_scale, mask=written)
                tl.store(at + out_scale_plane_stride, v_scale, mask=written)
            dst = out + _offset(bh, head_stride, position[:, None], head_dim) + dst_col[None, :]
            tl.store(dst, values, mask=written[:, None] & in_row)

    @triton.jit
    def _scatter_kernel(table, slots, rows, block_tokens: tl.constexpr, row: tl.constexpr, row_pow2: tl.constexpr):
        bh = tl.program_id(0)
        slot = tl.load(slots + bh)
        base = tl.load(table + slot // block_tokens)
        dst = base.to(tl.pointer_type(rows.dtype.element_ty)) + _offset(bh, block_tokens, slot % block_tokens, 1) * row
        col = tl.arange(0, row_pow2)
        src = rows + bh.to(tl.int64) * row
        tl.store(dst + col, tl.load(src + col, mask=col < row), mask=col < row)


@functools.cache
def default_gather_programs(device: torch.device) -> int:
    """Programs of the persistent gather unless the pool says: half the SMs (best of 1/8 .. all on an
    H200, 8 x 16K Llama-3-8B shape)."""
    return max(8, torch.cuda.get_device_properties(device).multi_processor_count // 2)


def _launch_gather(
    pool: BlockedRows,
    indices: torch.Tensor,
    count: torch.Tensor | None,
    out: torch.Tensor,
    destination=None,
    out_scales: torch.Tensor | None = None,
) -> None:
    batch, heads, k = indices.shape
    head_dim = out.shape[-1]
    row = 2 * head_dim
    chunks_per_head = triton.cdiv(k, pool.gather_rows)
    n_chunks = batch * heads * chunks_per_head
    count = count.contiguous() if count is not None else None  # an expanded count has stride 0
    programs = pool.gather_programs or default_gather_programs(out.device)
    int8 = pool.kv_bits == 8
    scales, factors = (pool.scales, pool.factors) if int8 else (pool.block_table, pool.block_table)
    _gather_kernel[(min(n_chunks, programs),)](
        pool.block_table,
        scales,
        factors,
        indices.contiguous(),
        count if count is not None else indices,
        out,
        destination.contiguous() if destination is not None else indices,
        out_scales if out_scales is not None else out,
        k,
        heads,
        count.stride(0) if count is not None else 0,
        count.stride(1) if count is not None and count.dim() == 2 else 0,  # (B,): one count for every head
        out.stride(1),
        out.stride(2),
        scales.stride(1) if pool.kv_bits == 8 else 0,
        out_scales.stride(1) if out_scales is not None else 0,
        out_scales.stride(2) if out_scales is not None else 0,
        chunks_per_head,
        n_chunks,
        has_count=count is not None,
        has_destination=destination is not None,
        block_tokens=pool.block_tokens,
        head_dim=head_dim,
        int8=pool.kv_bits == 8,
        raw=out_scales is not None,
        row_pow2=triton.next_power_of_2(row),
        rows_per_chunk=pool.gather_rows,
    )


def _launch_scatter(pool: BlockedRows, slots: torch.Tensor, rows: torch.Tensor) -> None:
    batch, heads = rows.shape[:2]
    _scatter_kernel[(batch * heads,)](
        pool.block_table,
        slots.contiguous(),
        rows.contiguous(),
        block_tokens=pool.block_tokens,
        row=rows.shape[-1] * 2,
        row_pow2=triton.next_power_of_2(rows.shape[-1] * 2),
    )
