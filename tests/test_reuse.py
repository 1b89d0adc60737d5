"""Row reuse's placement: kept rows stay in place, only new rows move, and the resident positions
then hold exactly the selection. The Triton kernel (run by Triton's CPU interpreter here) must give
the PyTorch path's placement exactly."""

from __future__ import annotations

import pytest
import torch
from conftest import run_in_interpreter

from infinigen.runtime import reuse
from infinigen.runtime.reuse import ResidentRows


def resident_rows(batch=3, heads=4, positions=12, n_slots=40) -> ResidentRows:
    resident = ResidentRows(batch, heads, 2, torch.float32, torch.device("cpu"))
    resident.grow(positions, n_slots)
    return resident


def random_selection(generator, resident: ResidentRows, k=10):
    batch, heads, n_slots = resident.position_of.shape
    indices = torch.stack([torch.randperm(n_slots, generator=generator)[:k] for _ in range(batch * heads)])
    selected = torch.rand(batch, heads, k, generator=generator) < 0.8
    return indices.view(batch, heads, k), selected


def check(resident: ResidentRows, indices, selected):
    before = resident.slots.clone()
    placement = resident.place(indices, selected)
    positions = resident.slots.shape[-1]
    for b in range(before.shape[0]):
        for h in range(before.shape[1]):
            wanted = set(indices[b, h][selected[b, h]].tolist())
            held = {int(s): p for p, s in enumerate(before[b, h]) if s >= 0}
            after = resident.slots[b, h].tolist()
            assert sorted(s for s in after if s >= 0) == sorted(wanted), "the positions hold the selection"
            assert placement.attend[b, h].tolist() == [s >= 0 for s in after] + [False]
            for slot, position in held.items():  # a row selected again stays where it is
                assert (after[position] == slot) == (slot in wanted)
            n = int(placement.count[b, h])
            moved = placement.missing[b, h, :n].tolist()
            assert sorted(moved) == sorted(wanted - set(held)), "only the rows not resident move"
            for slot, position in zip(moved, placement.destination[b, h, :n].tolist(), strict=True):
                assert after[position] == slot, "a moved row lands where the placement says"
            lookup = {s: p for s, p in enumerate(resident.position_of[b, h].tolist()) if p >= 0}
            assert lookup == {s: p for p, s in enumerate(after) if s >= 0}, "position_of mirrors slots"
            assert positions >= len(wanted)
    return placement


def test_placement_over_consecutive_steps():
    generator = torch.Generator().manual_seed(0)
    resident = resident_rows()
    for _ in range(6):
        check(resident, *random_selection(generator, resident))


def test_the_same_selection_moves_nothing():
    generator = torch.Generator().manual_seed(1)
    resident = resident_rows()
    indices, selected = random_selection(generator, resident)
    check(resident, indices, selected)
    slots = resident.slots.clone()
    again = check(resident, indices, selected)
    assert not again.count.any() and torch.equal(resident.slots, slots)


def test_a_full_selection_of_a_full_buffer():
    """K == P: every position may have to change."""
    generator = torch.Generator().manual_seed(2)
    resident = resident_rows(positions=10)
    for _ in range(3):
        indices, selected = random_selection(generator, resident, k=10)
        check(resident, indices, selected.fill_(True))


def test_growth_keeps_what_is_held():
    """More positions (a larger budget) and more slots (a larger pool) keep every resident row."""
    generator = torch.Generator().manual_seed(3)
    resident = resident_rows(positions=8, n_slots=20)
    check(resident, *random_selection(generator, resident, k=8))
    resident.rows[:, :, :, :8] = torch.randn(3, 4, 2, 8, 2, generator=generator)
    rows, slots = resident.rows.clone(), resident.slots.clone()
    resident.grow(12, 36)
    assert torch.equal(resident.rows[:, :, :, :8], rows[:, :, :, :8]) and torch.equal(resident.slots[..., :8], slots)
    assert (resident.slots[..., 8:] == -1).all() and (resident.position_of[..., 20:] == -1).all()
    for _ in range(3):
        check(resident, *random_selection(generator, resident, k=12))


KERNEL = r"""
import torch
from infinigen.runtime import reuse
from infinigen.runtime.pool import KVPool
from infinigen.runtime.transfer import _launch_gather
from test_reuse import random_selection, resident_rows
reuse.BLOCK = 8  # several loop steps per pass
generator = torch.Generator().manual_seed(0)
kernel, reference = resident_rows(positions=20, n_slots=40), resident_rows(positions=20, n_slots=40)
for step in range(8):
    if step == 4:  # growth between steps, as decoding does
        for resident in (kernel, reference):
            resident.grow(28, 60)
    indices, selected = random_selection(generator, reference, k=kernel.slots.shape[-1] - step % 3)
    got = reuse._launch_place(kernel.slots, kernel.position_of, indices, selected)
    want = reuse._place(reference.slots, reference.position_of, indices, selected)
    assert torch.equal(got.count, want.count) and torch.equal(got.attend, want.attend), step
    assert torch.equal(kernel.slots, reference.slots) and torch.equal(kernel.position_of, reference.position_of)
    for b in range(3):
        for h in range(4):
            n = int(want.count[b, h])
            assert torch.equal(got.missing[b, h, :n], want.missing[b, h, :n]), (step, b, h)
            assert torch.equal(got.destination[b, h, :n], want.destination[b, h, :n]), (step, b, h)
# the gather with a destination writes the moved rows there and nothing else
pool = KVPool(3, 4, 2, torch.float32, torch.device("cpu"), block_tokens=16, gather_programs=4)
rows = torch.randn(3, 4, 60, 2, 2)
pool.write_range(0, rows)
pool.block_table = torch.tensor([b.data_ptr() for b in pool.blocks], dtype=torch.int64)
out = torch.full((3, 4, 2, 29, 2), float("nan"))
_launch_gather(pool, want.missing, want.count, out, want.destination)
expected = torch.full_like(out, float("nan"))
pool.gather(want.missing, want.count, expected, want.destination)  # the PyTorch path
assert torch.equal(out.nan_to_num(7.0), expected.nan_to_num(7.0)), "gather into destinations"
for b in range(3):
    for h in range(4):
        n = int(want.count[b, h])
        for slot, position in zip(want.missing[b, h, :n].tolist(), want.destination[b, h, :n].tolist()):
            assert torch.equal(out[b, h, :, position], rows[b, h, slot]), "the row lands at its destination"
        assert int(out[b, h, 0].isnan().any(dim=-1).sum()) == 29 - n, "nothing else is written"
print("ok")
"""


@pytest.mark.skipif(reuse.triton is None, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the runtime tests run the compiled kernels")
def test_placement_kernel_in_interpreter():
    run_in_interpreter(KERNEL)
