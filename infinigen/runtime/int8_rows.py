"""8-bit pool rows (``RuntimeConfig.kv_bits`` 8): each K and each V of one token and KV head is
stored as ``head_dim`` int8 codes followed by its float32 scale (absmax / 127), so a pool row stays
one contiguous run of bytes, ``2 * (head_dim + 4)``: 264 B at head_dim 128 against 512 B in float16,
and the gather still moves one row per (token, head). Chosen over FP8 e4m3 by measured perplexity
(ACCURACY.md, "8-bit rows").

Rows are quantised on the compute device before they are written (prefill and decode alike: plain
tensor work, so a captured decode step stays capturable) and dequantised by the gather itself, into
the step's float16 / bfloat16 / float32 buffer (``transfer``): the rest of the runtime, row reuse
included, only ever sees dequantised rows.

Round trip: a value x of a plane with absmax m comes back within ``scale / 2`` of x, scale = m / 127
in float32 (so within m / 254 up to float32 rounding); an all-zero plane comes back exactly.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one float32 after the codes of each K or V plane
LEVELS = 127  # symmetric codes -127 .. 127


def stored_bytes(head_dim: int) -> int:
    """Bytes of one stored K or V plane (a pool row holds two). head_dim a multiple of 4 keeps every
    row's scales 4-byte aligned for the gather kernel's float32 loads."""
    return head_dim + SCALE_BYTES


def bits_per_value(head_dim: int) -> float:
    return 8 * stored_bytes(head_dim) / head_dim


def encode(rows: torch.Tensor) -> torch.Tensor:
    """rows (..., head_dim) float -> (..., head_dim + 4) uint8: int8 codes, then the float32 scale."""
    values = rows.float()
    scale = values.abs().amax(dim=-1, keepdim=True) / LEVELS
    # an all-zero plane keeps scale 0 (its codes are 0 whatever the divisor): decoded exactly
    codes = (values / torch.where(scale > 0, scale, 1)).round().clamp(-LEVELS, LEVELS).to(torch.int8)
    return torch.cat([codes.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def decode(stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """stored (..., head_dim + 4) uint8 -> (..., head_dim) of ``dtype`` (the CPU gather's path)."""
    head_dim = stored.shape[-1] - SCALE_BYTES
    codes = stored[..., :head_dim].view(torch.int8).float()
    scale = stored[..., head_dim:].contiguous().view(torch.float32)
    return (codes * scale).to(dtype)
