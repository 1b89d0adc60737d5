"""One decode attention (Llama-3-8B heads: 8 KV heads, groups of 4, head_dim 128, bfloat16) over S
keys with a validity mask, replayed from a CUDA graph as a captured step runs it: PyTorch's masked
SDPA (what ``grouped_decode_attention`` ran before) against the split-KV kernel, in one process,
with the HBM bandwidth each reaches (keys and values read once). Needs CUDA.

    python benchmarks/decode_attention_profile.py
"""

from __future__ import annotations

import functools

import torch
from torch.nn import functional as F
from torch.nn.attention import sdpa_kernel

from infinigen.bench.micro import device_ms
from infinigen.runtime.attention import DENSE_BACKENDS
from infinigen.runtime.decode_attention import split_decode_attention


def masked_sdpa(query, keys, values, valid, scale):
    with sdpa_kernel(DENSE_BACKENDS):
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=valid[:, :, None, :], scale=scale)


KERNELS = (masked_sdpa, split_decode_attention)


def main() -> None:
    print(f"{'batch':>5} {'keys':>7} {'sdpa ms':>8} {'split ms':>9} {'sdpa GB/s':>9} {'split GB/s':>10}")
    for batch, length in [(1, 4096), (1, 32768), (1, 131072), (8, 1640), (8, 3280), (8, 16384)]:
        query = torch.randn(batch, 8, 4, 128, device="cuda", dtype=torch.bfloat16)
        keys, values = (torch.randn(batch, 8, length, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        valid = torch.rand(batch, 8, length, device="cuda") > 0.01
        args = (query, keys, values, valid, 0.088)
        times = [device_ms(functools.partial(fn, *args), keys.device) for fn in KERNELS]
        gb = 2 * keys.numel() * keys.element_size() / 1e9
        rates = [f"{gb / ms * 1e3:>9.0f}" for ms in times]
        print(f"{batch:>5} {length:>7} {times[0]:>8.3f} {times[1]:>9.3f} {rates[0]} {rates[1]:>10}")


if __name__ == "__main__":
    main()
