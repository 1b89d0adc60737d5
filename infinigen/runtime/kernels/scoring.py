"""Scores of cached keys against a query group (``group_scores``: each KV head's token by its query
group's best logit), for the speculated and the exact selections; the quantized partial key cache:
its format, and its scores as one fused kernel.

Format (``quantize_rows``): symmetric per row (one token of one KV head), a scale in the model's
dtype and integer codes: int8 codes at 8 bits; at 4 bits codes in -7 .. 7, two a byte (channel 2j
in the low nibble of byte j, 2j+1 in the high one), stored as uint8. The dtype tells them apart.

A decode step's token: ``store_token_codes`` projects, quantizes and writes it in one kernel (PyTorch:
a matmul, a dozen element-wise kernels and two scatters per layer and step).

Scores: PyTorch needs five kernels (codes -> float copy of the whole cache, batched GEMM, max over
the query group, scale, mask), and the copy alone costs more than the rest: 110 us per layer at
8 x 16K tokens on an H200. The Triton kernel reads each token's codes once and writes its score.
"""

from __future__ import annotations

import math

import torch

from infinigen.runtime.kernels.triton_support import on_triton, tl, triton

TOKENS_PER_PROGRAM = 128
LEVELS = {8: 127, 4: 7}  # largest code magnitude per bit width


def quantize_rows(rows: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., c) -> codes (..., c) int8 (8 bits) or (..., c / 2) uint8 (4 bits), and scale (...) in
    ``rows``' dtype: rows ~= code_values(codes) * scale[..., None], off by at most half a step."""
    levels = LEVELS[bits]
    if bits == 4 and rows.shape[-1] % 2:
        raise ValueError(f"4-bit codes pack channels in pairs, got {rows.shape[-1]} channels")
    wide = rows.float()
    scale = (wide.abs().amax(dim=-1) / levels).clamp(min=torch.finfo(rows.dtype).tiny).to(rows.dtype)
    codes = (wide / scale.float()[..., None]).round().clamp(-levels, levels).to(torch.int8)
    if bits == 8:
        return codes, scale
    nibbles = codes & 0xF  # two's complement in 4 bits
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).view(torch.uint8), scale


def code_values(codes: torch.Tensor) -> torch.Tensor:
    """The integer value of every code, (..., c) int8."""
    if codes.dtype == torch.int8:
        return codes
    nibbles = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2).view(torch.int8)
    return (nibbles ^ 8) - 8  # sign-extend 4 bits


if triton is not None:

    @triton.jit
    def _quantized_scores_kernel(
        query,  # (B * kv_heads, group, channels) contiguous
        codes,  # (B * kv_heads, n, channels or channels / 2) int8 or packed uint8, row stride codes_stride
        scale,  # (B * kv_heads, n), row stride slot_stride
        valid,  # (B * kv_heads, n) bool as uint8, row stride slot_stride
        out,  # (B * kv_heads, n) float32 contiguous
        tile_max,  # (B * kv_heads, tiles) float32: the best score of each program's tokens
        n,
        codes_stride,
        slot_stride,
        group: tl.constexpr,
        channels: tl.constexpr,
        width: tl.constexpr,  # bytes per token: channels, or channels / 2 when packed
        width_pow2: tl.constexpr,
        packed: tl.constexpr,  # two 4-bit codes a byte
        tokens: tl.constexpr,
    ):
        row = tl.program_id(0)
        t = tl.program_id(1) * tokens + tl.arange(0, tokens)
        j = tl.arange(0, width_pow2)
        live = t < n
        mask = live[:, None] & (j < width)[None, :]
        # each token's bytes once, coalesced; masked bytes read as 0, whose codes are 0
        raw = tl.load(codes + row * codes_stride + t[:, None] * width + j[None, :], mask=mask, other=0).to(tl.int32)
        best = tl.full((tokens,), -float("inf"), tl.float32)
        if packed:  # channel 2j in the low nibble of byte j, 2j + 1 in the high one
            low = (((raw & 0xF) ^ 8) - 8).to(tl.float32)
            high = ((((raw >> 4) & 0xF) ^ 8) - 8).to(tl.float32)
            for g in tl.static_range(group):
                query_row = query + (row * group + g) * channels
                even = tl.load(query_row + 2 * j, mask=j < width, other=0).to(tl.float32)
                odd = tl.load(query_row + 2 * j + 1, mask=j < width, other=0).to(tl.float32)
                best = tl.maximum(best, tl.sum(low * even[None, :] + high * odd[None, :], axis=1))
        else:
            keys = raw.to(tl.float32)
            for g in tl.static_range(group):
                q = tl.load(query + (row * group + g) * channels + j, mask=j < width, other=0).to(tl.float32)
                best = tl.maximum(best, tl.sum(keys * q[None, :], axis=1))
        factor = tl.load(scale + row * slot_stride + t, mask=live, other=0).to(tl.float32)
        keep = tl.load(valid + row * slot_stride + t, mask=live, other=0) != 0
        scores = tl.where(keep, best * factor, -float("inf"))
        tl.store(out + row * n + t, scores, mask=live)
        tl.store(tile_max + row * tl.num_programs(1) + tl.program_id(1), tl.max(scores))

    @triton.jit
    def _store_token_kernel(
        keys,  # (B * kv_heads, d) contiguous: the decode token's keys
        projection,  # (kv_heads, d, channels) contiguous: the layer's partial key projection
        slots,  # (B, kv_heads) int64, strides slot_stride_b, slot_stride_h (0 where expanded)
        codes,  # (B * kv_heads, capacity, width) int8 or packed uint8
        scale,  # (B * kv_heads, capacity), the keys' dtype
        capacity,
        kv_heads,
        slot_stride_b,
        slot_stride_h,
        tiny,  # the smallest normal number of the keys' dtype: the least scale
        head_dim: tl.constexpr,
        dim_pow2: tl.constexpr,
        channels: tl.constexpr,
        channels_pow2: tl.constexpr,
        levels: tl.constexpr,
        packed: tl.constexpr,
    ):
        row = tl.program_id(0)
        i = tl.arange(0, dim_pow2)
        c = tl.arange(0, channels_pow2)
        key = tl.load(keys + row * head_dim + i, mask=i < head_dim, other=0).to(tl.float32)
        weights = tl.load(
            projection + (row % kv_heads) * head_dim * channels + i[:, None] * channels + c[None, :],
            mask=(i < head_dim)[:, None] & (c < channels)[None, :],
            other=0,
        ).to(tl.float32)
        dtype = scale.dtype.element_ty
        partial = tl.sum(key[:, None] * weights, axis=0).to(dtype).to(tl.float32)  # the matmul's output dtype
        step = tl.maximum(tl.max(tl.abs(partial)) / levels, tiny).to(dtype)
        code = tl.floor(partial / step.to(tl.float32) + 0.5)
        code = tl.minimum(tl.maximum(code, -levels), levels).to(tl.int32)
        slot = tl.load(slots + (row // kv_heads) * slot_stride_b + (row % kv_heads) * slot_stride_h)
        at = row * capacity + slot
        tl.store(scale + at, step)
        if packed:  # channel 2j in the low nibble of byte j, 2j + 1 in the high one
            low, high = tl.split(tl.reshape(code & 0xF, (channels_pow2 // 2, 2)))
            j = tl.arange(0, channels_pow2 // 2)
            tl.store(codes + at * (channels // 2) + j, (low | (high << 4)).to(tl.uint8), mask=j < channels // 2)
        else:
            tl.store(codes + at * channels + c, code.to(tl.int8), mask=c < channels)


def store_token_codes(
    keys: torch.Tensor,  # (B, kv_heads, 1, d): a decode step's token
    projection: torch.Tensor,  # (kv_heads, d, r)
    slots: torch.Tensor,  # (B, kv_heads) int64
    codes: torch.Tensor,  # (B, kv_heads, capacity, r or r / 2) from quantize_rows
    scale: torch.Tensor,  # (B, kv_heads, capacity), the keys' dtype
) -> None:
    """codes, scale[b, h, slots[b, h]] <- quantize_rows(keys @ projection) in one kernel (the same
    codes up to the rounding of the projection's sum, and of exact halves)."""
    batch, kv_heads, _, head_dim = keys.shape
    channels = projection.shape[-1]
    if not (codes.is_contiguous() and scale.is_contiguous() and scale.dtype == keys.dtype):
        raise ValueError("codes and scale must be contiguous buffers, scale in the keys' dtype")
    _store_token_kernel[(batch * kv_heads,)](
        keys.contiguous(),
        projection.contiguous(),
        slots,
        codes,
        scale,
        codes.shape[2],
        kv_heads,
        slots.stride(0),
        slots.stride(1),
        torch.finfo(keys.dtype).tiny,
        head_dim=head_dim,
        dim_pow2=triton.next_power_of_2(head_dim),
        channels=channels,
        channels_pow2=triton.next_power_of_2(channels),
        levels=LEVELS[8 if codes.dtype == torch.int8 else 4],
        packed=codes.dtype == torch.uint8,
    )


def fused_group_scores(
    queries: torch.Tensor,  # (B, heads, c)
    codes: torch.Tensor,  # (B, kv_heads, n, c or c / 2) from quantize_rows, a slice of a capacity-sized buffer
    valid: torch.Tensor,  # (B, kv_heads, n) bool, likewise
    key_scale: torch.Tensor,  # (B, kv_heads, n), likewise
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, kv_heads, n) float32: each KV head's token scored by its query group's best logit
    (``group_scores`` over quantized keys), -inf where ``valid`` is False; and the best score of
    each tile of TOKENS_PER_PROGRAM tokens (B * kv_heads, tiles), for ``top_slots``."""
    batch, kv_heads, n, width = codes.shape
    channels = queries.shape[-1]
    if codes.stride(3) != 1 or codes.stride(2) != width or codes.stride(0) != kv_heads * codes.stride(1):
        raise ValueError("codes must be slices of a contiguous (B, kv_heads, capacity, c) buffer")
    if valid.stride() != key_scale.stride() or valid.stride(2) != 1 or valid.stride(0) != kv_heads * valid.stride(1):
        raise ValueError("valid and key_scale must be slices of contiguous (B, kv_heads, capacity) buffers")
    out = torch.empty(batch, kv_heads, n, dtype=torch.float32, device=codes.device)
    grid = (batch * kv_heads, math.ceil(n / TOKENS_PER_PROGRAM))
    tile_max = torch.empty(grid, dtype=torch.float32, device=codes.device)
    _quantized_scores_kernel[grid](
        queries.contiguous(),
        codes,
        key_scale,
        valid.view(torch.uint8),
        out,
        tile_max,
        n,
        codes.stride(1),
        valid.stride(1),
        group=queries.shape[1] // kv_heads,
        channels=channels,
        width=width,
        width_pow2=triton.next_power_of_2(width),
        packed=codes.dtype == torch.uint8,
        tokens=TOKENS_PER_PROGRAM,
    )
    return out, tile_max


def group_scores(
    queries: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, key_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """queries (B, heads, c) x keys (B, kv_heads, n, c) -> (B, kv_heads, n) float: each KV head scores a
    token by the best logit of its query group; -inf where ``valid`` is False. With ``key_scale``
    (B, kv_heads, n) the keys are the codes of ``quantize_rows`` (a positive scale per token commutes
    with the max over the group)."""
    if key_scale is not None and on_triton(keys.device):
        return fused_group_scores(queries, keys, valid, key_scale)[0]
    if key_scale is not None:
        keys = code_values(keys)
    batch, kv_heads = keys.shape[:2]
    grouped = queries.view(batch, kv_heads, -1, queries.shape[-1])
    scores = torch.einsum("bkgc,bktc->bkgt", grouped, keys.to(queries.dtype)).amax(dim=2).float()
    if key_scale is not None:
        scores = scores * key_scale
    return scores.masked_fill(~valid, -math.inf)
