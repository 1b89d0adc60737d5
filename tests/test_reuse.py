"""Row reuse's placement: kept rows stay in place, only new rows move, and the resident positions
then hold exactly the selection."""

from __future__ import annotations

import torch

from infinigen.runtime.reuse import place


def random_step(generator, batch=3, heads=4, n_slots=40, positions=12, k=10, resident=None):
    if resident is None:  # an empty buffer
        resident = torch.full((batch, heads, positions), -1, dtype=torch.int64)
    indices = torch.stack(
        [torch.randperm(n_slots, generator=generator)[:k].sort().values for _ in range(batch * heads)]
    )
    indices = indices.view(batch, heads, k)
    selected = torch.rand(batch, heads, k, generator=generator) < 0.8
    return resident, indices, selected


def check(resident, indices, selected, n_slots):
    placement = place(resident, indices, selected, n_slots)
    positions = resident.shape[-1]
    for b in range(resident.shape[0]):
        for h in range(resident.shape[1]):
            wanted = set(indices[b, h][selected[b, h]].tolist())
            before = {int(s): p for p, s in enumerate(resident[b, h]) if s >= 0}
            after = [int(s) for s in placement.slots[b, h]]
            assert {s for s in after if s >= 0} == wanted and len([s for s in after if s >= 0]) == len(wanted)
            for slot, position in before.items():  # a row selected again stays where it is
                assert (after[position] == slot) == (slot in wanted)
            n = int(placement.count[b, h])
            moved = placement.missing[b, h, :n].tolist()
            assert sorted(moved) == sorted(wanted - set(before)), "only the rows not resident move"
            for slot, position in zip(moved, placement.destination[b, h, :n].tolist(), strict=True):
                assert after[position] == slot, "a moved row lands where the placement says"
            assert (placement.destination[b, h, n:] == positions).all(), "past the count: the spare"
    return placement


def test_placement_over_consecutive_steps():
    generator = torch.Generator().manual_seed(0)
    resident, indices, selected = random_step(generator)
    for _ in range(6):  # each step's result is the next step's resident buffer
        placement = check(resident, indices, selected, 40)
        resident = placement.slots
        _, indices, selected = random_step(generator, resident=resident)


def test_the_same_selection_moves_nothing():
    generator = torch.Generator().manual_seed(1)
    resident, indices, selected = random_step(generator)
    first = place(resident, indices, selected, 40)
    again = check(first.slots, indices, selected, 40)
    assert not again.count.any() and torch.equal(again.slots, first.slots)


def test_a_full_selection_of_a_full_buffer():
    """K == P: every position may have to change."""
    generator = torch.Generator().manual_seed(2)
    resident, indices, selected = random_step(generator, positions=10, k=10)
    selected[:] = True
    first = check(resident, indices, selected, 40)
    _, indices, selected = random_step(generator, positions=10, k=10, resident=first.slots)
    selected[:] = True
    check(first.slots, indices, selected, 40)
