"""Row reuse's placement: kept rows stay in place, only new rows move, and the resident positions
then hold exactly the selection. The Triton kernel (run by Triton's CPU interpreter here) must give
the PyTorch path's placement exactly. And auto's decision: on where the resident rows fit the room
(what the memory plan leaves them, under a cap), without the rows of earlier steps where only the selection's
fit, on the CPU only for those rows, off with a limited pool, dropped cleanly when the pools outgrow
the room."""

from __future__ import annotations

import pytest
import torch
from conftest import run_in_interpreter
from helpers import EXACT, greedy, padded_batch, tiny_setup
from transformers import DynamicCache

from infinigen.errors import InfinigenError
from infinigen.runtime import cache_for
from infinigen.runtime.config import DEFAULT_RESIDENT_EXTRA, RuntimeConfig, config_from, parse_value
from infinigen.runtime.kernels import placement
from infinigen.runtime.memory import reuse
from infinigen.runtime.memory.reuse import Placement, ResidentRows


def resident_rows(batch=3, heads=4, positions=12, n_slots=40, device="cpu") -> ResidentRows:
    resident = ResidentRows(batch, heads, 2, torch.float32, torch.device(device))
    resident.grow(positions, n_slots)
    return resident


def random_selection(generator, resident: ResidentRows, k=10):
    batch, heads, n_slots = resident.position_of.shape
    n_slots -= 1  # the last column is no slot's
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


def test_recent_rows_stay_attended_until_new_ones_need_their_places():
    """``keep_recent``: the selection is always held; rows of earlier steps stay, attended, and give
    their places up least recently selected first, after the free ones."""
    generator = torch.Generator().manual_seed(4)
    resident = resident_rows(batch=2, heads=3, positions=15, n_slots=40)  # room for 10 and half again
    last_selected: dict[tuple[int, int, int], int] = {}
    for step in range(8):
        indices, selected = random_selection(generator, resident, k=10)
        before = resident.slots.clone()
        placement = resident.place(indices, selected, keep_recent=True)
        for b in range(2):
            for h in range(3):
                wanted = set(indices[b, h][selected[b, h]].tolist())
                for slot in wanted:
                    last_selected[b, h, slot] = step
                after = resident.slots[b, h].tolist()
                held = {s for s in after if s >= 0}
                assert wanted <= held, "the selection is held"
                assert placement.attend[b, h].tolist() == [s >= 0 for s in after] + [False]
                for position, slot in enumerate(before[b, h].tolist()):  # a held row moves nowhere
                    assert after[position] in (slot, *wanted)
                gone = {int(s) for s in before[b, h] if s >= 0} - held
                kept_old = held - wanted
                if gone and kept_old:  # what left was selected no later than what stayed
                    assert max(last_selected[b, h, s] for s in gone) <= min(last_selected[b, h, s] for s in kept_old)
                if -1 in before[b, h].tolist() and gone:
                    assert -1 not in after, "free places are taken before held rows give theirs up"
                n = int(placement.count[b, h])
                moved = placement.missing[b, h, :n].tolist()
                assert sorted(moved) == sorted(wanted - {int(s) for s in before[b, h] if s >= 0})
                for slot, position in zip(moved, placement.destination[b, h, :n].tolist(), strict=True):
                    assert after[position] == slot
                lookup = {s: p for s, p in enumerate(resident.position_of[b, h, :-1].tolist()) if p >= 0}
                assert lookup == {s: p for p, s in enumerate(after) if s >= 0}, "position_of mirrors slots"


def test_resident_extra_attends_more_rows_for_no_more_bytes(tokenizer, device):
    """With row reuse, rows of earlier steps kept on the GPU (by default, room for the selection
    again) are attended beside the selection: the same rows are selected and move, more are attended;
    at budget 1.0 the tokens stay dense's. (On CUDA the placement runs inside the captured selections.)"""
    model, artifact = tiny_setup(tokenizer, "llama", device)
    generator = torch.Generator().manual_seed(0)
    inputs = padded_batch([torch.randint(3, 512, (n,), generator=generator).tolist() for n in (40, 57)], 1, device)
    settings = dict(budget=0.2, reuse_rows="on", min_tokens=2)
    plain, wider = cache_for(model, artifact, resident_extra=0.0, **settings), cache_for(model, artifact, **settings)
    greedy(model, inputs, plain, new_tokens=16), greedy(model, inputs, wider, new_tokens=16)
    plain_summary, wider_summary = plain.summary(), wider.summary()
    assert (plain_summary["resident_extra"], wider_summary["resident_extra"]) == (0.0, DEFAULT_RESIDENT_EXTRA)
    assert plain_summary["fraction_attended"] == plain_summary["fraction_fetched"]
    assert wider_summary["fraction_attended"] > 1.3 * wider_summary["fraction_fetched"]
    assert wider_summary["fraction_fetched"] == pytest.approx(plain_summary["fraction_fetched"], rel=0.05)
    for summary in (plain_summary, wider_summary):  # rows already on the GPU are attended, not moved
        assert summary["fraction_moved"] < summary["fraction_fetched"]
    assert wider_summary["bytes_host_to_device"] <= plain_summary["bytes_host_to_device"] * 1.05
    expected = greedy(model, inputs, DynamicCache())
    exact = cache_for(model, artifact, resident_extra=1.0, reuse_rows="on", **EXACT)
    assert torch.equal(greedy(model, inputs, exact), expected)
    with pytest.raises(InfinigenError, match="needs row reuse"):
        RuntimeConfig(resident_extra=0.5, reuse_rows="off")
    with pytest.raises(InfinigenError, match="resident_extra must be in"):
        RuntimeConfig(resident_extra=-1)


def kernel_matches_pytorch(device: str) -> Placement:
    """The placement kernel on ``device`` (the interpreter's on the CPU) gives the PyTorch path's
    placement exactly, over consecutive steps with growth between them, with and without keep_recent.
    Returns the last placement."""
    saved = placement.BLOCK, placement.SPLITS, reuse.AGE_CAP
    placement.BLOCK = 8  # several loop steps per pass
    generator = torch.Generator().manual_seed(0)

    def compare(kernel, reference, indices, selected, age=None):
        on_device = indices.to(device), selected.to(device)
        if age is None:
            got = reuse._launch_place(kernel.slots, kernel.position_of, *on_device)
            want = reuse._place(reference.slots, reference.position_of, indices, selected)
        else:
            got = reuse._launch_place(kernel.slots, kernel.position_of, *on_device, kernel.age)
            want = reuse._place_recent(reference.slots, reference.position_of, reference.age, indices, selected)
        got = Placement(*(t.cpu() for t in (got.missing, got.count, got.destination, got.attend, got.held)))
        assert torch.equal(got.count, want.count) and torch.equal(got.attend, want.attend)
        assert torch.equal(got.held, want.held) and torch.equal(want.held, want.attend.sum(-1, dtype=torch.int32))
        assert torch.equal(kernel.slots.cpu(), reference.slots) and torch.equal(kernel.age.cpu(), reference.age)
        assert torch.equal(kernel.position_of.cpu(), reference.position_of)
        for b in range(3):
            for h in range(4):
                n = int(want.count[b, h])
                assert torch.equal(got.missing[b, h, :n], want.missing[b, h, :n]), (b, h)
                assert torch.equal(got.destination[b, h, :n], want.destination[b, h, :n]), (b, h)
        return want

    try:
        # one program per (batch row, head), then three per pair (shares of 7 of the 20 positions)
        for placement.SPLITS in (1, 3):
            kernel, reference = (
                resident_rows(positions=20, n_slots=40, device=device),
                resident_rows(positions=20, n_slots=40),
            )
            for step in range(5):
                if step == 3:  # growth between steps, as decoding does
                    for resident in (kernel, reference):
                        resident.grow(28, 60)
                k = kernel.slots.shape[-1] - step % 3
                compare(kernel, reference, *random_selection(generator, reference, k=k))
        # keep_recent, ages included; ages saturate at AGE_CAP; again with one and three programs per pair
        # (30 positions: shares of 10, two loop steps each, the last one partial)
        reuse.AGE_CAP = 3  # ties among the oldest rows within a few steps
        for placement.SPLITS in (1, 3):
            kernel, reference = (
                resident_rows(positions=30, n_slots=40, device=device),
                resident_rows(positions=30, n_slots=40),
            )
            for step in range(7):
                if step == 4:
                    for resident in (kernel, reference):
                        resident.grow(36, 60)
                indices, selected = random_selection(generator, reference, k=12 - step % 4)
                last = compare(kernel, reference, indices, selected, age=True)
            assert int(reference.age.max()) == 3, "ages saturate"
            assert bool((reference.slots >= 0).sum(-1).gt(12).any()), "rows of earlier steps held"
        return last
    finally:
        placement.BLOCK, placement.SPLITS, reuse.AGE_CAP = saved


KERNEL = r"""
import torch
from infinigen.runtime.memory.pool import KVPool
from infinigen.runtime.kernels.transfer import _launch_gather
from test_reuse import kernel_matches_pytorch
want = kernel_matches_pytorch("cpu")
# the gather with a destination writes the moved rows there and nothing else
pool = KVPool(3, 4, 2, torch.float32, torch.device("cpu"), block_tokens=16, gather_programs=4)
rows = torch.randn(3, 4, 60, 2, 2)
pool.write_range(0, rows)
pool.block_table = torch.tensor([b.data_ptr() for b in pool.blocks], dtype=torch.int64)
out = torch.full((3, 4, 2, 36, 2), float("nan"))  # the resident rows' 36 positions
_launch_gather(pool, want.missing, want.count, out, want.destination)
expected = torch.full_like(out, float("nan"))
pool.gather(want.missing, want.count, expected, want.destination)  # the PyTorch path
assert torch.equal(out.nan_to_num(7.0), expected.nan_to_num(7.0)), "gather into destinations"
for b in range(3):
    for h in range(4):
        n = int(want.count[b, h])
        for slot, position in zip(want.missing[b, h, :n].tolist(), want.destination[b, h, :n].tolist()):
            assert torch.equal(out[b, h, :, position], rows[b, h, slot]), "the row lands at its destination"
        assert int(out[b, h, 0].isnan().any(dim=-1).sum()) == 36 - n, "nothing else is written"
print("ok")
"""


@pytest.mark.skipif(placement.triton is None, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the runtime tests run the compiled kernels")
def test_placement_kernel_in_interpreter():
    run_in_interpreter(KERNEL)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_placement_kernel_on_cuda():
    kernel_matches_pytorch("cuda")


# --- auto's decision ------------------------------------------------------------------------------


def test_the_decision_given_a_memory_cap():
    room = reuse.room_from(planned=10 * 10**9, cap_gb=1.0)  # the cap is below what the plan leaves
    assert room == (10**9, "the cap of 1 GB")
    fits, too_big = reuse.decide(400 * 10**6, room), reuse.decide(1_200 * 10**6, room)
    assert fits.on and str(fits) == "on (auto: 0.40 GB fits in the cap of 1 GB)"
    assert not too_big.on and str(too_big) == "off (auto: 1.20 GB exceeds the cap of 1 GB)"
    assert not reuse.decide(1, reuse.room_from(planned=10 * 10**9, cap_gb=0.0)).on  # a cap of 0: never
    # a cap above what the plan leaves: the plan decides
    room = reuse.room_from(planned=2 * 10**9, cap_gb=10.0)
    assert room == (2 * 10**9, "the 2.00 GB the memory plan leaves, under the cap of 10 GB")
    assert reuse.room_from(planned=2 * 10**9, cap_gb=None) == (2 * 10**9, "the 2.00 GB the memory plan leaves")
    assert str(reuse.decide(0, None)) == "off (auto: CPU, no transfers to save)"


def test_auto_reuse_takes_what_the_plan_leaves(tokenizer, monkeypatch):
    """Auto reuse's room is the GPU budget less everything else the memory plan holds while decoding: the
    same budget gives the same decision on any machine, and a budget that leaves no room turns it off."""
    from infinigen.runtime.memory import plan

    model, _ = tiny_setup(tokenizer, "llama", "cpu")
    subject = plan.model_of(model.config, torch.float32)
    config = RuntimeConfig()
    others = plan.resident_room(subject, torch.float32, 2, 64, config, 10**9)
    assert plan.resident_room(subject, torch.float32, 2, 64, config, 2 * 10**9) - others == int(10**9 / 1.05)
    roomy, cramped = (plan.resident_room(subject, torch.float32, 2, 64, config, b) for b in (10**9, 10**5))
    assert roomy > 0 and cramped == 0
    pretend_a_gpu(monkeypatch, free=subject.weight_bytes + 10**5)  # the weights and 0.1 MB
    _, cache = decode(tokenizer, budget=0.3)
    assert (
        cache.summary()["reuse_rows"].startswith("off (auto: ")
        and "the 0.00 GB the memory plan leaves" in (cache.summary()["reuse_rows"])
    )


def test_reuse_rows_takes_auto_on_off_and_the_old_switches():
    assert RuntimeConfig().reuse_rows == "auto" and RuntimeConfig().reuse_gpu_gb is None
    assert RuntimeConfig(reuse_rows=True).reuse_rows == "on" and RuntimeConfig(reuse_rows=False).reuse_rows == "off"
    assert [parse_value("reuse_rows", t) for t in ("auto", "on", "true", "0")] == ["auto", "on", "on", "off"]
    assert parse_value("reuse_gpu_gb", "none") is None and parse_value("reuse_gpu_gb", "2.5") == 2.5
    with pytest.raises(InfinigenError, match="--reuse-rows takes auto, on, off, got 'maybe'"):
        parse_value("reuse_rows", "maybe")
    with pytest.raises(InfinigenError, match="reuse_gpu_gb must be >= 0"):
        RuntimeConfig(reuse_gpu_gb=-1.0)


def pretend_a_gpu(monkeypatch, free: int = 10**12) -> None:
    """Auto decides as on a GPU with a budget of ``free`` bytes (the CPU path moves the same rows)."""
    from infinigen.runtime.memory import plan

    monkeypatch.setattr(plan, "budget_bytes", lambda gpu_memory_gb, device: free)


def decode(tokenizer, **settings):
    """Greedy tokens and the summary of a tiny Llama decoding 16 tokens after padded prompts of 40 and
    57 tokens (pool blocks of 8 tokens: the pools grow during decoding). The cache runs under its run's plan
    made without a budget, as a client's: auto reuse then decides within the budget as the pools grow."""
    from infinigen.runtime.memory import plan

    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (40, 57)]
    inputs = padded_batch(prompts, pad=1, device="cpu")
    config = config_from(dict(policy="infinigen", block_tokens=8, **settings))
    found = plan.plan_for(model, config, plan.Workload(2, 57, 16, None, padded=True), None)
    cache = cache_for(model, artifact, plan=found)
    return greedy(model, inputs, cache, new_tokens=16), cache


def test_auto_on_the_cpu_reuses_rows_only_to_attend_earlier_ones(tokenizer):
    """On the CPU, auto keeps rows only for resident_extra (as a GPU would attend them), never with a
    limited pool."""
    _, cache = decode(tokenizer, budget=0.3)
    assert cache.summary()["reuse_rows"] == "on (auto: CPU, to attend rows of earlier steps as on a GPU)"
    assert cache.summary()["resident_extra"] == DEFAULT_RESIDENT_EXTRA
    _, plain = decode(tokenizer, budget=0.3, resident_extra=0.0)
    assert plain.summary()["reuse_rows"] == "off (auto: CPU, no transfers to save)"
    _, limited = decode(tokenizer, budget=0.3, cpu_pool_gb=1.0)
    assert limited.summary()["reuse_rows"] == "off (auto: limited CPU pool)"
    assert limited.summary()["resident_extra"] == 0.0
    with pytest.raises(InfinigenError, match="reuse_rows needs an unlimited CPU pool"):
        decode(tokenizer, budget=0.3, cpu_pool_gb=1.0, reuse_rows="on")
    model, _ = tiny_setup(tokenizer, "llama", "cpu")
    assert cache_for(model, policy="full").summary()["reuse_rows"] is None  # not a budgeted policy


def test_auto_follows_the_cap(tokenizer, monkeypatch):
    """Without rows of earlier steps, the same tokens whatever auto decides; fewer bytes where the
    resident rows fit the cap."""
    pretend_a_gpu(monkeypatch)
    plain_tokens, plain = decode(tokenizer, budget=0.3, reuse_rows="off")
    assert plain.summary()["reuse_rows"] == "off (asked)"
    tokens, fits = decode(tokenizer, budget=0.3, reuse_gpu_gb=1.0, resident_extra=0.0)
    summary = fits.summary()
    assert torch.equal(tokens, plain_tokens)
    assert summary["reuse_rows"].startswith("on (auto: 0.00 GB fits in the cap of 1 GB")
    assert 0 < summary["bytes_host_to_device"] < plain.summary()["bytes_host_to_device"]
    tokens, small = decode(tokenizer, budget=0.3, reuse_gpu_gb=1e-9)  # nor without them
    assert torch.equal(tokens, plain_tokens)
    assert small.summary()["reuse_rows"].startswith("off (auto: 0.00 GB exceeds the cap of 1e-09 GB")
    assert small.summary()["bytes_host_to_device"] == plain.summary()["bytes_host_to_device"]
    assert all(layer.resident is None for layer in small.offloaded)


def test_auto_drops_the_rows_of_earlier_steps_before_reuse(tokenizer, monkeypatch):
    """Where the selection's rows fit the cap but not the rows of earlier steps with them, auto
    reuses rows without them: the tokens of resident_extra 0."""
    pretend_a_gpu(monkeypatch)
    lean_tokens, lean = decode(tokenizer, budget=0.3, reuse_rows="on", resident_extra=0.0)
    full_tokens, _ = decode(tokenizer, budget=0.3, reuse_rows="on")
    layer = lean.offloaded[0]
    sizes = (*layer.valid.shape[:2], layer.head_dim, 4, layer.capacity, lean.layer_budgets, 8)
    cap = reuse.resident_bytes(*sizes)  # the selection's rows at the last (largest) capacity
    first = layer.capacity - 16  # at most 16 tokens were decoded since the first decision
    assert reuse.resident_bytes(*sizes[:4], first, lean.layer_budgets, 8, 1.0) > cap  # with them: never fits
    tokens, capped = decode(tokenizer, budget=0.3, reuse_gpu_gb=cap / 1e9)
    summary = capped.summary()
    assert summary["reuse_rows"].endswith("without rows of earlier steps)") and summary["resident_extra"] == 0.0
    assert torch.equal(tokens, lean_tokens) and not torch.equal(tokens, full_tokens)
    assert summary["bytes_host_to_device"] == lean.summary()["bytes_host_to_device"]


def test_auto_keeps_fewer_rows_of_earlier_steps_before_none(tokenizer, monkeypatch):
    """Where room holds the rows of resident_extra 1 but not those of the default 2, auto keeps 1:
    the tokens of resident_extra 1 asked for."""
    pretend_a_gpu(monkeypatch)
    assert DEFAULT_RESIDENT_EXTRA == 2.0 and reuse.fallback_extras(2.0) == (2.0, 1.0, 0.0)
    one_tokens, one = decode(tokenizer, budget=0.3, reuse_rows="on", resident_extra=1.0)
    two_tokens, _ = decode(tokenizer, budget=0.3, reuse_rows="on")
    layer = one.offloaded[0]
    sizes = (*layer.valid.shape[:2], layer.head_dim, 4, layer.capacity, one.layer_budgets, 8)
    cap = reuse.resident_bytes(*sizes, 1.0)  # rows of resident_extra 1 at the last (largest) capacity
    first = layer.capacity - 16
    assert reuse.resident_bytes(*sizes[:4], first, one.layer_budgets, 8, 2.0) > cap  # 2: never fits
    tokens, capped = decode(tokenizer, budget=0.3, reuse_gpu_gb=cap / 1e9)
    summary = capped.summary()
    assert summary["reuse_rows"].endswith("with resident_extra 1)") and summary["resident_extra"] == 1.0
    assert torch.equal(tokens, one_tokens) and not torch.equal(tokens, two_tokens)


@pytest.mark.parametrize("kv_bits, resident_bits", [(16, None), (8, None), (8, 8)])
def test_the_estimate_bounds_what_the_resident_rows_take(tokenizer, monkeypatch, kv_bits, resident_bits):
    """The resident rows' estimate bounds their buffers; 8-bit rows are kept dequantised unless asked (or
    chosen by auto reuse) to stay codes and scales on the GPU, with one buffer that takes a layer's rows
    dequantised for attention."""
    pretend_a_gpu(monkeypatch)
    _, cache = decode(tokenizer, budget=0.3, reuse_rows="on", kv_bits=kv_bits, resident_bits=resident_bits)
    layers, kept = cache.offloaded, resident_bits or 16
    held = sum(t.nbytes for layer in layers for t in vars(layer.resident).values() if t is not None)
    assert cache.summary()["resident_bits"] == kept
    if kept == 8:
        assert layers[0].resident.rows.dtype == torch.int8 and layers[0].resident.scales.dtype == torch.float32
        held += cache.buffers["dequantised", 0].nbytes
    else:
        assert layers[0].resident.rows.dtype == torch.float32 and layers[0].resident.scales is None
    batch, kv_heads = layers[0].valid.shape[:2]
    sizes = (batch, kv_heads, layers[0].head_dim, 4, layers[0].capacity, cache.layer_budgets, 8)
    need = reuse.resident_bytes(*sizes, cache.resident_extra, kept_bits=kept)
    assert held <= need < 4 * held  # at this tiny size quest's page slack and the growth copy weigh most
    # Llama-3-8B at 8 x 16K, 10% on each of 30 offloaded layers: that share of the KV, plus position lookups
    share = 0.1 * 30 * 8 * 8 * 16384 * 2 * 128 * 2
    wide = reuse.resident_bytes(8, 8, 128, 2, 16384, [0.1] * 30, 8)
    assert share < wide < 1.15 * share
    assert reuse.resident_bytes(8, 8, 128, 2, 16384, [0.1] * 30, 8, kept_bits=8) < 0.6 * wide


def test_auto_falls_back_when_the_pools_outgrow_the_cap(tokenizer, monkeypatch):
    """A cap that fits the prompt's pools but not the grown ones: reuse on at first, then every layer
    drops its resident rows and fetches as without reuse; the same tokens throughout."""
    pretend_a_gpu(monkeypatch)
    plain_tokens, plain = decode(tokenizer, budget=0.3, reuse_rows="off", kv_bits=16)
    layer = plain.offloaded[0]
    batch, kv_heads = layer.valid.shape[:2]

    def need(capacity, kept_bits=16, extra=0.0):
        return reuse.resident_bytes(
            batch, kv_heads, layer.head_dim, 4, capacity, plain.layer_budgets, 8, extra, kept_bits
        )

    prompt_capacity = 64  # 57 prompt tokens in blocks of 8
    assert layer.capacity > prompt_capacity
    cap_gb = (need(prompt_capacity) + need(prompt_capacity + 8)) / 2 / 1e9
    tokens, cache = decode(tokenizer, budget=0.3, reuse_gpu_gb=cap_gb, kv_bits=16)
    assert torch.equal(tokens, plain_tokens)
    assert "exceeds the cap" in cache.summary()["reuse_rows"]
    assert cache.summary()["reuse_rows"].endswith(", from 72 tokens on)")
    assert all(layer.resident is None for layer in cache.offloaded)
    # 8-bit rows: where the rows of earlier steps no longer fit dequantised, they stay 8-bit on the GPU
    kept_16, kept_8 = (need(layer.capacity, bits, extra=2.0) for bits in (16, 8))
    assert kept_8 < kept_16
    asked, _ = decode(tokenizer, budget=0.3, reuse_rows="on", kv_bits=8, resident_bits=8)
    tokens, kept = decode(tokenizer, budget=0.3, reuse_gpu_gb=(kept_8 + kept_16) / 2 / 1e9, kv_bits=8)
    assert torch.equal(tokens, asked) and kept.summary()["resident_bits"] == 8
    assert kept.summary()["reuse_rows"].endswith("kept 8-bit)") and kept.summary()["resident_extra"] == 2.0
    assert all(layer.resident.rows.dtype == torch.int8 for layer in kept.offloaded)
    _, reusing = decode(tokenizer, budget=0.3, reuse_rows="on", kv_bits=16)
    moved = cache.summary()["bytes_host_to_device"]
    assert reusing.summary()["bytes_host_to_device"] < moved < plain.summary()["bytes_host_to_device"]


@pytest.mark.parametrize("policy", ["infinigen", "quest", "oracle"])
def test_budget_one_stays_exact_with_auto_reuse_on(tokenizer, monkeypatch, policy):
    pretend_a_gpu(monkeypatch)
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (9, 23, 16)]
    inputs = padded_batch(prompts, pad=1, device="cpu")
    expected = greedy(model, inputs, DynamicCache())
    cache = cache_for(model, artifact, policy=policy, **EXACT)
    assert torch.equal(greedy(model, inputs, cache), expected)
    assert cache.summary()["reuse_rows"].startswith("on (auto:")
