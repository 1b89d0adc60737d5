"""The split-KV decode attention kernel (Triton's CPU interpreter here, compiled on CUDA) against
plain softmax attention: grouped heads, strided keys, a broadcast mask, chunks with no valid key."""

from __future__ import annotations

import pytest
import torch
from conftest import run_in_interpreter

from infinigen.runtime.kernels import decode_attention

CHECK = r"""
import math, torch
from infinigen.runtime.kernels.decode_attention import split_decode_attention

def reference(q, k, v, valid, scale):
    scores = torch.einsum("bkgd,bksd->bkgs", q.double(), k.double()) * scale
    scores = scores.masked_fill(~valid[:, :, None, :], -math.inf)
    return torch.einsum("bkgs,bksd->bkgd", scores.softmax(-1), v.double())

def check(device, dtype, tolerance):
    generator = torch.Generator().manual_seed(0)
    shapes = [(2, 3, 4, 16, 300, False), (1, 2, 1, 64, 1000, True), (1, 1, 4, 256, 520, True)]  # last: Gemma-3-270m's
    for batch, kv_heads, group, head_dim, length, shared in shapes:
        rows = torch.randn(batch, kv_heads, 2, length, head_dim, generator=generator)  # K and V planes, as fetched
        q = torch.randn(batch, kv_heads, group, head_dim, generator=generator)
        valid = torch.rand(batch, 1 if shared else kv_heads, length, generator=generator) > 0.5
        valid[..., :256] = False  # a whole chunk without a valid key (chunks: 192 and 256 keys here)
        valid[..., -1] = True
        rows, q, valid = rows.to(device, dtype), q.to(device, dtype), valid.to(device)
        out = split_decode_attention(q, rows[:, :, 0], rows[:, :, 1], valid, 0.125)
        expected = reference(q, rows[:, :, 0], rows[:, :, 1], valid.expand(batch, kv_heads, length), 0.125)
        assert out.dtype == dtype and out.shape == q.shape
        torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)
"""


@pytest.mark.skipif(decode_attention.triton is None, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the compiled kernel is tested")
def test_split_decode_attention_in_interpreter():
    run_in_interpreter(CHECK + '\ncheck("cpu", torch.float32, 1e-5)\nprint("ok")\n')


@pytest.mark.skipif(decode_attention.triton is None, reason="triton is not installed")
def test_wide_rows_take_fewer_keys_per_loop_step():
    """A loop step's key and value tiles fit an H100's shared memory at every pipeline stage: float32
    rows of head_dim 256 (Gemma 3) take 32 keys a step, 16-bit ones and narrower rows 64."""
    assert decode_attention.keys_per_step(256, torch.float32) == 32
    assert decode_attention.keys_per_step(256, torch.bfloat16) == decode_attention.BLOCK_N == 64
    assert decode_attention.keys_per_step(128, torch.float32) == 64
    assert decode_attention.keys_per_step(512, torch.float32) == 16


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_split_decode_attention_on_cuda(dtype, tolerance):
    namespace: dict = {}
    exec(CHECK, namespace)
    namespace["check"]("cuda", dtype, tolerance)
