"""8-bit pool rows (``RuntimeConfig.kv_bits`` 8): each K and each V of one token and KV head is
stored in pinned host memory as ``head_dim`` int8 codes; its float32 scale (absmax / 127) stays on
the compute device, in the pool's per-slot ``scales``. Chosen over FP8 e4m3 by measured perplexity
(ACCURACY.md, "8-bit rows").

Why the scales are not in the row: the GPU reads host memory in 128-byte lines, and a row's cost is
the lines it touches. Codes alone make a row 256 B at head_dim 128 (two whole lines); with its
scales beside them (264 B) it spanned three, and the gather moved 165 M rows/s against 199 M (H200:
BENCHMARKS.md, "8-bit rows"). The scales cost 8 B of device memory per row, under 2% of the dense
KV cache's bytes.

Rows are quantised on the compute device before they are written (prefill and decode alike: plain
tensor work, so a captured decode step stays capturable) and dequantised by the gather itself, into
the step's float16 / bfloat16 / float32 buffer (``transfer``). Rows kept on the GPU between steps (row
reuse) stay in 8 bits there, codes and scales as moved, and are dequantised for each step's attention
(``dequantise``): half the GPU memory of 16-bit rows.

Keys are smoothed per channel before they are rounded: a few fixed channels of a head's keys hold
outliers (Qwen2.5's reach tens of times the rest), and one scale per row spent on them rounds every
other channel to a few levels. Each key channel c of a KV head is divided by a factor f_c = sqrt(absmax_c)
(its largest magnitude over the batch row's first prompt tokens, padding left out: ``channel_factors``; per
row, so that a row's codes do not depend on the rows batched with it) before the row's scale is taken,
and multiplied back when the row is read, by the gather along with the scale: no extra pass, no extra
bytes over the bus. Values, whose outliers are per token, are not smoothed (factor 1). On
Qwen2.5-Coder-0.5B's keys this cuts the attention error 13x (results/2026-11-29-cpu-key-formats-*).

Round trip: a value x of a plane whose smoothed absmax is m comes back within ``scale * f / 2`` of x,
scale = m / 127 in float32, f its channel's factor; an all-zero plane comes back exactly.
"""

from __future__ import annotations

import torch

from infinigen.runtime.kernels.triton_support import on_triton, tl, triton

LEVELS = 127  # symmetric codes -127 .. 127
BITS_MOVED = 8  # per value over the bus: the codes (the scales stay on the device)


def channel_factors(rows: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """rows (B, H, T, 2, d), ``valid`` (B, T) bool (None: every token) -> (B, H, 2, d) float32: each key
    channel's factor sqrt(absmax over the row's valid tokens) (1 for a channel that is all zero there), and 1
    for every value channel."""
    keys = rows[..., 0, :].float().abs()  # (B, H, T, d)
    if valid is not None:
        keys = keys * valid[:, None, :, None].to(keys.device)
    largest = keys.amax(dim=2)  # (B, H, d)
    keys = torch.where(largest > 0, largest.sqrt(), 1.0)
    return torch.stack([keys, torch.ones_like(keys)], dim=2)


def encode(rows: torch.Tensor, factors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rows (..., head_dim) float -> int8 codes (..., head_dim) and float32 scales (...); with ``factors``
    (broadcast to ``rows``), rows divided by them first."""
    values = rows.float() if factors is None else rows.float() / factors
    scale = values.abs().amax(dim=-1, keepdim=True) / LEVELS
    # an all-zero plane keeps scale 0 (its codes are 0 whatever the divisor): decoded exactly
    codes = (values / torch.where(scale > 0, scale, 1)).round().clamp(-LEVELS, LEVELS).to(torch.int8)
    return codes, scale[..., 0]


def decode(
    codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, factors: torch.Tensor | None = None
) -> torch.Tensor:
    """codes (..., head_dim) int8 and scales (...) -> (..., head_dim) of ``dtype``, multiplied by ``factors``
    (broadcast to ``codes``) where given (the CPU paths of the gather and of a prefill's read of earlier chunks:
    its float32 copies would take five times the rows' 16-bit size on a GPU)."""
    values = codes.float() * scales.to(codes.device, torch.float32)[..., None]
    return (values if factors is None else values * factors.to(codes.device)).to(dtype)


def dequantise(codes: torch.Tensor, scales: torch.Tensor, factors: torch.Tensor, out: torch.Tensor) -> None:
    """out (B, H, 2, P, d) <- codes (B, H, 2, P, d) int8 times their scales (B, H, 2, P) and their channels'
    factors (B, H, 2, d), as ``decode`` gives them: rows kept on the GPU in 8 bits (``reuse.ResidentRows``), for a
    step's attention, and a prefill's blocks of earlier rows (``KVPool.read_rows``: (B, H, P, 2, d) seen as
    (B, H, 2, P, d)). On CUDA one kernel, in float32 registers; elsewhere a batch row at a time (a
    float32 copy of them all would take twice their 16-bit size)."""
    if on_triton(out.device):
        _launch_dequantise(codes, scales, factors, out)
        return
    for b in range(codes.shape[0]):
        out[b] = decode(codes[b], scales[b], out.dtype, factors[b, :, :, None])


if triton is not None:

    @triton.jit
    def _dequantise_kernel(
        codes,
        scales,
        factors,
        out,
        positions,
        code_head,
        code_plane,
        code_position,
        scale_head,
        scale_plane,
        scale_position,
        out_head,
        out_plane,
        out_position,
        head_dim: tl.constexpr,
        dim_pow2: tl.constexpr,
        block: tl.constexpr,
    ):
        """One (batch row, head, plane)'s ``block`` positions: code * scale * factor in float32."""
        bh, plane = tl.program_id(0) // 2, tl.program_id(0) % 2
        bh = bh.to(tl.int64)  # a buffer past 2^31 elements
        p = tl.program_id(1) * block + tl.arange(0, block)
        col = tl.arange(0, dim_pow2)
        live = p < positions
        mask = live[:, None] & (col < head_dim)[None, :]
        at = p[:, None] * code_position + col[None, :]
        code = tl.load(codes + bh * code_head + plane * code_plane + at, mask=mask, other=0)
        scale = tl.load(scales + bh * scale_head + plane * scale_plane + p * scale_position, mask=live, other=0)
        factor = tl.load(factors + (bh * 2 + plane) * head_dim + col, mask=col < head_dim, other=1.0)
        values = code.to(tl.float32) * scale[:, None] * factor[None, :]
        at = p[:, None] * out_position + col[None, :]
        tl.store(out + bh * out_head + plane * out_plane + at, values, mask=mask)


def _launch_dequantise(codes: torch.Tensor, scales: torch.Tensor, factors: torch.Tensor, out: torch.Tensor) -> None:
    """``dequantise`` on CUDA: any strides of positions and planes (the pool's (B, H, n, 2, d) blocks seen as
    (B, H, 2, n, d), or the resident rows' own layout); a row's values contiguous, heads strided alike."""
    batch, heads, _, positions, head_dim = codes.shape
    for t in (codes, out, scales):
        assert t.stride(-1) == 1 or t is scales, t.stride()
        assert t.stride(0) == heads * t.stride(1), t.stride()
    block = 64
    _dequantise_kernel[(batch * heads * 2, triton.cdiv(positions, block))](
        codes,
        scales,
        factors.contiguous(),
        out,
        positions,
        codes.stride(1),
        codes.stride(2),
        codes.stride(3),
        scales.stride(1),
        scales.stride(2),
        scales.stride(3),
        out.stride(1),
        out.stride(2),
        out.stride(3),
        head_dim=head_dim,
        dim_pow2=triton.next_power_of_2(head_dim),
        block=block,
    )
