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
the step's float16 / bfloat16 / float32 buffer (``transfer``): the rest of the runtime, row reuse
included, only ever sees dequantised rows.

Round trip: a value x of a plane with absmax m comes back within ``scale / 2`` of x, scale = m / 127
in float32 (so within m / 254 up to float32 rounding); an all-zero plane comes back exactly.
"""

from __future__ import annotations

import torch

LEVELS = 127  # symmetric codes -127 .. 127
BITS_MOVED = 8  # per value over the bus: the codes (the scales stay on the device)


def encode(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows (..., head_dim) float -> int8 codes (..., head_dim) and float32 scales (...)."""
    values = rows.float()
    scale = values.abs().amax(dim=-1, keepdim=True) / LEVELS
    # an all-zero plane keeps scale 0 (its codes are 0 whatever the divisor): decoded exactly
    codes = (values / torch.where(scale > 0, scale, 1)).round().clamp(-LEVELS, LEVELS).to(torch.int8)
    return codes, scale[..., 0]


def decode(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes (..., head_dim) int8 and scales (...) -> (..., head_dim) of ``dtype`` (the CPU gather's path)."""
    return (codes.float() * scales.to(codes.device, torch.float32)[..., None]).to(dtype)
