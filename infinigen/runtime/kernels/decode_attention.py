"""One query token per KV head group over many keys, with a validity mask: split-KV attention.

A decode step's attention reads every key once and does little arithmetic: it is bound by memory
bandwidth only if enough thread blocks read at once. PyTorch's masked SDPA (the memory-efficient
kernel) gives each (batch row, head) one block that walks all keys, so at batch 1 a Llama-3-8B
layer keeps 8 blocks busy over 32K keys (BENCHMARKS.md, "Micro-benchmarks"). Here each (batch row, KV head)
splits its keys into chunks, one program each, which keep a running softmax over their chunk
(flash-decoding); a few PyTorch ops merge the chunks. The query group of a KV head (its G query
heads) is one small matrix, so grouped-query heads read their shared keys once.
"""

from __future__ import annotations

import functools

import torch

from infinigen.runtime.kernels.triton_support import tl, triton

BLOCK_N = 64  # keys per loop step
# Bytes of one key row per loop step at most: a step's key and value tiles sit in shared memory once
# per pipeline stage, and float32 rows of head_dim 256 (Gemma 3) at 64 keys need 276 KiB, more than
# an H100 has (227 KiB).
ROW_BYTES_PER_STEP = 64 * 512


def keys_per_step(head_dim: int, dtype: torch.dtype) -> int:
    """BLOCK_N, or fewer keys per loop step for wide rows (a power of two, at least 16)."""
    row_bytes = triton.next_power_of_2(head_dim) * dtype.itemsize
    return max(16, min(BLOCK_N, ROW_BYTES_PER_STEP // row_bytes))


@functools.cache
def _target_programs(device: torch.device) -> int:
    """Programs that keep the device's memory system busy: two per SM (8 in Triton's interpreter)."""
    if device.type != "cuda":
        return 8
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def split_decode_attention(
    query: torch.Tensor,  # (B, kv_heads, G, d)
    keys: torch.Tensor,  # (B, kv_heads, S, d), any strides but a unit stride over d
    values: torch.Tensor,  # (B, kv_heads, S, d), likewise
    valid: torch.Tensor,  # (B, kv_heads or 1, S) bool
    scale: float,
) -> torch.Tensor:
    """softmax(scale * q k^T over the valid keys) v: (B, kv_heads, G, d) in the query's dtype."""
    batch, kv_heads, group, head_dim = query.shape
    length = keys.shape[2]
    rows = batch * kv_heads
    block_n = keys_per_step(head_dim, keys.dtype)
    splits = max(1, min(triton.cdiv(_target_programs(query.device), rows), triton.cdiv(length, block_n)))
    chunk = triton.cdiv(triton.cdiv(length, splits), block_n) * block_n
    splits = triton.cdiv(length, chunk)
    block_g, block_d = max(16, triton.next_power_of_2(group)), max(16, triton.next_power_of_2(head_dim))
    acc = torch.empty(rows, splits, group, head_dim, dtype=torch.float32, device=query.device)
    maxima = torch.empty(rows, splits, group, dtype=torch.float32, device=query.device)
    sums = torch.empty_like(maxima)
    query = query.contiguous()
    mask = valid.view(torch.uint8)
    _split_kernel[(rows, splits)](
        query, keys, values, mask, acc, maxima, sums,
        length, chunk, group, kv_heads, scale,
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        mask.stride(0), mask.stride(1) if mask.shape[1] > 1 else 0, mask.stride(2),
        HEAD_DIM=head_dim, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",  # float32 models: no TF32 rounding
    )  # fmt: skip
    weights = torch.exp(maxima - maxima.amax(dim=1, keepdim=True))  # (rows, splits, G)
    merged = (acc * weights[..., None]).sum(dim=1) / (sums * weights).sum(dim=1)[..., None]
    return merged.view(batch, kv_heads, group, head_dim).to(query.dtype)


if triton is not None:

    @triton.jit
    def _split_kernel(
        query,
        keys,
        values,
        valid,
        acc_out,
        max_out,
        sum_out,
        length,
        chunk,
        group,
        kv_heads,
        scale,
        k_sb,
        k_sh,
        k_ss,
        v_sb,
        v_sh,
        v_ss,
        m_sb,
        m_sh,
        m_ss,
        HEAD_DIM: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """Program (row = batch * kv_heads + head, split): keys split * chunk .. + chunk of that row."""
        row, split = tl.program_id(0), tl.program_id(1)
        b, h = row // kv_heads, row % kv_heads
        g, d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
        in_d = d < HEAD_DIM
        q_at = query + (row * group + g[:, None]) * HEAD_DIM + d[None, :]
        q = tl.load(q_at, mask=(g[:, None] < group) & in_d[None, :], other=0.0)  # (BLOCK_G, BLOCK_D)
        running_max = tl.full((BLOCK_G,), -1.0e30, tl.float32)  # finite: an all-masked chunk stays NaN-free
        running_sum = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
        start = split * chunk
        end = tl.minimum(start + chunk, length)
        for first in range(start, end, BLOCK_N):
            n = first + tl.arange(0, BLOCK_N)
            live = n < end
            k_at = keys + b * k_sb + h * k_sh + n[None, :] * k_ss + d[:, None]
            k = tl.load(k_at, mask=live[None, :] & in_d[:, None], other=0.0)  # (BLOCK_D, BLOCK_N)
            scores = tl.dot(q, k, input_precision=PRECISION) * scale  # (BLOCK_G, BLOCK_N)
            ok = tl.load(valid + b * m_sb + h * m_sh + n * m_ss, mask=live, other=0) != 0
            scores = tl.where(ok[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, 1))
            p = tl.exp(scores - new_max[:, None])
            rescale = tl.exp(running_max - new_max)
            running_sum = running_sum * rescale + tl.sum(p, 1)
            v_at = values + b * v_sb + h * v_sh + n[:, None] * v_ss + d[None, :]
            v = tl.load(v_at, mask=live[:, None] & in_d[None, :], other=0.0)  # (BLOCK_N, BLOCK_D)
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            running_max = new_max
        out = (row * tl.num_programs(1) + split) * group + g
        tl.store(acc_out + out[:, None] * HEAD_DIM + d[None, :], acc, mask=(g[:, None] < group) & in_d[None, :])
        tl.store(max_out + out, running_max, mask=g < group)
        tl.store(sum_out + out, running_sum, mask=g < group)
