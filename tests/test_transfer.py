"""The zero-copy Triton gather/scatter kernels, run by Triton's CPU interpreter (so CI checks the
very kernels the GPU runs) against the plain PyTorch path. On CUDA the runtime tests cover them."""

from __future__ import annotations

import pytest
import torch
from conftest import run_in_interpreter

from infinigen.runtime.kernels import transfer
from infinigen.runtime.memory import host_memory
from infinigen.runtime.memory.pool import KVPool

CHECK = r"""
import torch
from infinigen.runtime.kernels import transfer
from infinigen.runtime.memory.pool import KVPool
torch.manual_seed(0)
B, H, D, bt = 2, 3, 16, 8
pool = KVPool(B, H, D, torch.float32, torch.device("cpu"), block_tokens=bt, gather_programs=4)
rows = torch.randn(B, H, 30, 2, D)
pool.write_range(0, rows)
pool.block_table = torch.tensor([b.data_ptr() for b in pool.blocks], dtype=torch.int64)
idx = torch.stack([torch.randperm(30)[:12].sort().values for _ in range(B * H)]).view(B, H, 12)
count = torch.tensor([12, 7], dtype=torch.int32)
out = torch.full((B, H, 2, 13, D), float("nan"))
transfer._launch_gather(pool, idx, count, out[:, :, :, :12])
expected = torch.zeros(B, H, 2, 12, D)
for b in range(B):
    for h in range(H):
        for j in range(int(count[b])):
            expected[b, h, :, j] = rows[b, h, idx[b, h, j]]
assert torch.equal(out[:, :, :, :12], expected), "gather: rows, planes, zeros past the count"
assert bool(out[:, :, :, 12].isnan().all()), "gather wrote past its slice"
bulk = torch.tensor([9], dtype=torch.int32).expand(B)  # one count for every row (stride 0), as a bulk fetch's
transfer._launch_gather(pool, idx, bulk, out[:, :, :, :12])
first = torch.stack([rows[b, h, idx[b, h, :9]] for b in range(B) for h in range(H)]).view(B, H, 9, 2, D)
assert torch.equal(out[:, :, :, :9], first.transpose(2, 3)) and not out[:, :, :, 9:12].any(), "expanded count"
per_head = torch.tensor([[12, 0, 5], [3, 7, 1]], dtype=torch.int32)  # a count per (batch row, head)
transfer._launch_gather(pool, idx, per_head, out[:, :, :, :12])
for b in range(B):
    for h in range(H):
        n = int(per_head[b, h])
        assert torch.equal(out[b, h, :, :n], rows[b, h, idx[b, h, :n]].transpose(0, 1)), "count per head"
        assert not out[b, h, :, n:12].any(), "zeros past a head's count"
slots = torch.tensor([[3, 9, 17], [0, 25, 29]])
new = torch.randn(B, H, 1, 2, D)
transfer._launch_scatter(pool, slots, new)
for b in range(B):
    for h in range(H):
        s = int(slots[b, h])
        assert torch.equal(pool.blocks[s // bt][b, h, s % bt], new[b, h, 0]), "scatter"
print("ok")
"""


@pytest.mark.skipif(transfer.triton is None, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the runtime tests run the compiled kernels")
def test_triton_kernels_in_interpreter():
    run_in_interpreter(CHECK)


OFFSETS = r"""
import torch
import triton
import triton.language as tl
from infinigen.runtime.kernels import transfer

@triton.jit
def offsets(out, first_row, row_stride, position_stride):
    row = first_row + tl.program_id(0)  # 32-bit, as the gather's (batch * head) index
    position = tl.arange(0, 4)
    tl.store(out + tl.program_id(0) * 4 + position, transfer._offset(row, row_stride, position, position_stride))

out = torch.zeros(2, 4, dtype=torch.int64)
offsets[(2,)](out, 3, 2**30, 2**20)  # every product fits in 32 bits, their sums past 2^31 do not
rows = torch.tensor([3, 4])[:, None]
assert torch.equal(out, rows * 2**30 + torch.arange(4) * 2**20), out
print("ok")
"""


@pytest.mark.skipif(transfer.triton is None, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the runtime tests run the compiled kernels")
def test_gather_offsets_past_two_to_the_31_do_not_wrap():
    """A staging buffer of more than 2^31 elements (a large batch at a long context) is addressed
    with 64-bit offsets (the kernel's arithmetic is checked here, without such a buffer)."""
    run_in_interpreter(OFFSETS)


def test_torch_gather_and_scatter_across_blocks():
    torch.manual_seed(0)
    pool = KVPool(2, 2, 4, torch.float32, torch.device("cpu"), block_tokens=5)
    rows = torch.randn(2, 2, 12, 2, 4)
    pool.write_range(0, rows)
    assert pool.capacity == 15 and len(pool.blocks) == 3
    indices = torch.tensor([[[0, 6, 11], [4, 5, 10]], [[1, 2, 3], [7, 8, 9]]])
    out = torch.empty(2, 2, 2, 3, 4)
    transfer.gather_rows(pool, indices, None, out)
    for b in range(2):
        for h in range(2):
            torch.testing.assert_close(out[b, h].transpose(0, 1), rows[b, h, indices[b, h]])
    per_head = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)  # a count per (batch row, head)
    transfer.gather_rows(pool, indices, per_head, out)
    for b in range(2):
        for h in range(2):
            n = int(per_head[b, h])
            torch.testing.assert_close(out[b, h, :, :n].transpose(0, 1), rows[b, h, indices[b, h, :n]])
            assert not out[b, h, :, n:].any()
    new = torch.randn(2, 2, 1, 2, 4)
    transfer.scatter_rows(pool, torch.tensor([[14, 0], [7, 13]]), new)
    assert torch.equal(pool.blocks[2][0, 0, 4], new[0, 0, 0]) and torch.equal(pool.blocks[2][1, 1, 3], new[1, 1, 0])


def test_write_range_fills_whole_and_partial_blocks(device):
    """A prompt's rows land at their slots whether a write covers whole blocks (one copy) or part of
    one (a copy per (batch row, head) run on CUDA), and a later write goes on from a block's middle."""
    torch.manual_seed(0)
    pool = KVPool(2, 3, 4, torch.float32, torch.device(device), block_tokens=5)
    rows = torch.randn(2, 3, 13, 2, 4, device=device)
    pool.write_range(0, rows[:, :, :7])  # block 0 whole, block 1's first two slots
    pool.write_range(7, rows[:, :, 7:])  # from block 1's middle to block 2's end
    if device == "cuda":
        torch.cuda.synchronize()
    stored = torch.cat([block.to(device) for block in pool.blocks], dim=2)
    assert torch.equal(stored[:, :, :13], rows) and not stored[:, :, 13:].any()


@pytest.mark.parametrize("kv_bits", [16, 8])
@pytest.mark.parametrize("end", [10, 13])  # whole blocks; and part of the last one
def test_read_range_equals_the_gather_of_every_slot(device, kv_bits, end):
    """A multi-token step's read of everything cached (block copies) leaves what the row gather of
    every slot does: K and V planes, 8-bit rows dequantised with their scales, nothing past ``end``."""
    torch.manual_seed(0)
    pool = KVPool(2, 3, 4, torch.float32, torch.device(device), block_tokens=5, kv_bits=kv_bits)
    rows = torch.randn(2, 3, 14, 2, 4, device=device)
    pool.write_range(0, pool.encode_range(0, rows))
    expected = torch.full((2, 3, 2, end + 1, 4), float("nan"), device=device)
    read = expected.clone()
    pool.gather(torch.arange(end, device=device).expand(2, 3, end), None, expected[:, :, :, :end])
    pool.read_range(end, read[:, :, :, :end])
    assert torch.equal(read[:, :, :, :end], expected[:, :, :, :end]), "as the row gather leaves them"
    assert bool(read[:, :, :, end].isnan().all()), "nothing written past end"
    if kv_bits == 16:
        assert torch.equal(read[:, :, :, :end], rows[:, :, :end].transpose(2, 3))


def test_new_pool_slots_above_the_reserved_ones_are_zero(monkeypatch):
    """A fetch may read slots nobody wrote (the rest of a Quest page): they must be zeros, never
    the NaN an uninitialised block can hold (a masked NaN row still poisons attention)."""
    real_block = host_memory._new_block
    monkeypatch.setattr(host_memory, "_new_block", lambda *args: real_block(*args).fill_(255))  # all NaN
    pool = KVPool(1, 2, 4, torch.float32, torch.device("cpu"), block_tokens=8)
    pool.reserve(11)  # the caller writes slots 0 .. 10
    assert len(pool.blocks) == 2 and bool(pool.blocks[1][:, :, 3:].eq(0).all())
    pool.reserve(16)  # no new block: nothing to zero
    pool.reserve(17)
    assert bool(pool.blocks[2][:, :, 1:].eq(0).all())
