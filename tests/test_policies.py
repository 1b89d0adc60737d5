"""Every KV policy's own selection logic, and the whole matrix through one runtime path."""

from __future__ import annotations

import gc
import math
from types import SimpleNamespace
from typing import get_args

import pytest
import torch
from conftest import DEVICES, run_in_interpreter
from helpers import greedy, padded_batch, teacher_forced_argmax, tiny_setup

from infinigen.runtime import POLICIES, RuntimeConfig, cache_for
from infinigen.runtime.cache.layers import OffloadedLayer
from infinigen.runtime.config import PolicyName
from infinigen.runtime.kernels import scoring
from infinigen.runtime.kernels.buffers import store_slots
from infinigen.runtime.kernels.scoring import LEVELS, code_values, group_scores, quantize_rows
from infinigen.runtime.selection.policies import row_bits
from infinigen.runtime.selection.policies.base import LayerView
from infinigen.runtime.selection.policies.h2o import H2OPolicy
from infinigen.runtime.selection.policies.infinigen import always_fetched
from infinigen.runtime.selection.policies.int4 import GroupQuantizer
from infinigen.runtime.selection.policies.quest import PAGE, QuestPolicy


@pytest.fixture(scope="module", params=DEVICES)
def tiny_llama(request, tokenizer):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return tiny_setup(tokenizer, "llama", request.param)


def test_the_policy_names_of_the_config_are_the_registry():
    assert sorted(get_args(PolicyName)) == sorted(POLICIES)
    assert all(name == policy.name for name, policy in POLICIES.items())


def fake_layer(n: int, batch: int = 1, kv_heads: int = 1, capacity: int | None = None) -> SimpleNamespace:
    """What a policy reads from its offloaded layer, without a model: ``n`` slots in use of
    ``capacity`` (default n), the rest invalid."""
    slots = torch.arange(4096)
    capacity = capacity or n
    layer = SimpleNamespace(
        used=n,
        capacity=capacity,
        valid=slots[:capacity].expand(batch, kv_heads, capacity) < n,
        all_slots=lambda k: slots[:k],
    )
    layer.device_used = lambda: torch.tensor([layer.used])
    return layer


def test_h2o_keeps_heavy_hitters_and_the_recent_window_and_forgets_evictions():
    policy = H2OPolicy(RuntimeConfig(policy="h2o", budget=0.5, min_tokens=1))
    layer = fake_layer(20, capacity=24)  # buffers sized by the capacity, as captured selections read them
    policy.stored(layer, slice(0, 20), torch.zeros(1, 1, 20, 4))
    heavy = [0, 3, 7, 9, 12]
    mass = torch.full((1, 1, 20), 0.01)
    mass[..., heavy] = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.3])
    mass[..., 15] = 0.5  # recent now; later heavier than slot 12
    policy.attended(layer, None, mass)
    first = policy.select(layer, None, None)  # keep 10 = 5 recent (15..19) + 5 heaviest
    assert first.count.tolist() == [10]
    assert first.indices[0, 0, :10].tolist() == heavy + [15, 16, 17, 18, 19]

    layer.used, layer.valid = 21, torch.arange(24).expand(1, 1, 24) < 21
    policy.stored(layer, slice(20, 21), torch.zeros(1, 1, 1, 4))  # one decoded token
    slots = first.indices[..., :10]
    step_mass = torch.zeros(1, 1, 10)
    step_mass[..., 0] = 0.1  # slot 0 stays heavy
    policy.attended(layer, slots, step_mass)
    second = policy.select(layer, None, None)
    # 16..20 recent; 15 leaves the window and pushes out the lightest heavy hitter, 12
    assert second.count.tolist() == [10]
    assert second.indices[0, 0, :10].tolist() == [0, 3, 7, 9, 15, 16, 17, 18, 19, 20]
    policy.scores[..., 12] = 100.0  # gone for good, however heavy afterwards
    assert 12 not in policy.select(layer, None, None).indices[0, 0, :10].tolist()


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [128, 64, 16])
def test_group_quantizer_round_trip_error_is_at_most_half_a_step(bits, dtype, head_dim):
    codec = GroupQuantizer(bits)
    rows = (torch.randn(2, 3, 7, 2, head_dim, generator=torch.Generator().manual_seed(bits)) * 3).to(dtype)
    stored = codec.encode(rows)
    assert stored.dtype == dtype and stored.shape == (*rows.shape[:-1], codec.stored_dim(head_dim, dtype))
    if head_dim >= 64:  # whole groups of 64: exactly the advertised bits
        assert stored.numel() * dtype.itemsize * 8 == rows.numel() * codec.bits_per_value
    out = torch.empty(rows.shape, dtype=torch.float32)
    codec.decode(stored, out)
    _, _, scale = codec.quantize(rows)
    step = scale.float().repeat_interleave(min(64, head_dim), dim=-1)
    error = (out - rows.float()).abs()
    assert (error <= step / 2 * (1 + 1e-3) + 1e-6).all()
    assert error.max() > 0  # it does quantize


@pytest.mark.parametrize(("bits", "dtype", "width", "overlap"), [(8, torch.int8, 24, 0.9), (4, torch.uint8, 12, 0.6)])
def test_quantized_partial_keys_score_as_their_values_and_keep_the_ranking(bits, dtype, width, overlap):
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 2, 200, 24, generator=generator) * torch.linspace(0.1, 5, 24)  # (B, kv, n, r)
    queries = torch.randn(2, 6, 24, generator=generator)  # 3 query heads per KV head
    valid = torch.rand(2, 2, 200, generator=generator) > 0.2
    codes, scale = quantize_rows(keys, bits)
    assert codes.dtype == dtype and codes.shape[-1] == width and scale.shape == keys.shape[:3]
    values = code_values(codes)
    assert values.abs().max() == LEVELS[bits]
    assert ((values * scale[..., None] - keys).abs() <= scale[..., None] / 2 + 1e-6).all()
    scores = group_scores(queries, codes, valid, scale)
    torch.testing.assert_close(scores, group_scores(queries, values.float() * scale[..., None], valid))
    exact = group_scores(queries, keys, valid)
    top = 40
    kept = [
        len(set(a.tolist()) & set(b.tolist())) / top
        for a, b in zip(scores.topk(top).indices.flatten(0, 1), exact.topk(top).indices.flatten(0, 1), strict=True)
    ]
    assert min(kept) >= overlap  # the top 20% by quantized scores are mostly the top 20% by exact ones


def tile_maxima(scores: torch.Tensor) -> torch.Tensor:
    """(B, kv_heads, n) -> the best of each TOKENS_PER_PROGRAM-slot tile of each row (B * kv_heads, tiles)."""
    tile = scoring.TOKENS_PER_PROGRAM
    padded = torch.nn.functional.pad(scores, (0, -scores.shape[-1] % tile), value=-math.inf)
    return padded.unflatten(-1, (-1, tile)).amax(-1).flatten(0, 1)


FUSED_SCORES_CHECK = r"""
import torch
from test_policies import tile_maxima
from infinigen.runtime.kernels.scoring import fused_group_scores, group_scores, quantize_rows
g = torch.Generator().manual_seed(0)
B, kv, G, cap, n, c = 2, 3, 4, 300, 257, 40
keys = torch.randn(B, kv, cap, c, generator=g)
valid = torch.rand(B, kv, cap, generator=g) > 0.3
q = torch.randn(B, kv * G, c, generator=g)
for bits in (8, 4):
    codes, scale = quantize_rows(keys, bits)
    out, tile_max = fused_group_scores(q, codes[:, :, :n], valid[:, :, :n], scale[:, :, :n])
    ref = group_scores(q, codes[:, :, :n], valid[:, :, :n], scale[:, :, :n])
    assert out.shape == ref.shape == (B, kv, n) and out.dtype == torch.float32
    assert torch.equal(out.isinf(), ref.isinf()), "masked slots"
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    assert torch.equal(tile_max, tile_maxima(out))
print("ok")
"""


@pytest.mark.skipif(scoring.triton is None, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the runtime tests run the compiled kernel")
def test_fused_scores_in_interpreter():
    """The Triton kernel (run by Triton's CPU interpreter) scores 8- and 4-bit codes in slices of
    capacity-sized buffers as the PyTorch path does, -inf where invalid."""
    run_in_interpreter(FUSED_SCORES_CHECK)


def check_rotated_partial_query(device: str) -> None:
    """The one-kernel partial query of a RoPE model equals the rotation then the projection in PyTorch:
    Llama, and a Gemma 3 global layer (q norm, head_dim 256, its own rotary base)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    from infinigen.architectures import model_spec
    from infinigen.runtime.selection.speculation import projected_query, rotated_partial_query, rotated_query

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=1)
    config.num_attention_heads, config.num_key_value_heads = 4, 2
    gemma = Gemma3TextConfig(
        vocab_size=32, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    for model, layer, kind in ((LlamaForCausalLM(config), 0, ()), (Gemma3ForCausalLM(gemma), 1, ("full_attention",))):
        model = model.to(device)
        spec, attention = model_spec(model.config), model.model.layers[layer].self_attn
        x = torch.randn(3, 1, 64, device=device)
        positions = torch.tensor([[5, 6], [9, 10], [0, 1]], device=device)  # the last of each row is the token's
        rope = model.model.rotary_emb(x, positions, *kind)
        projection = torch.randn(spec.n_heads, spec.head_dim, 6, device=device)
        expected = torch.einsum("bhd,hdr->bhr", rotated_query(attention, spec, x[:, 0], rope), projection)
        fused = rotated_partial_query(projected_query(attention, spec, x[:, 0]), rope, projection)
        torch.testing.assert_close(fused, expected)


@pytest.mark.skipif(scoring.triton is None, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the compiled kernel is tested")
def test_rotated_partial_query_in_interpreter():
    run_in_interpreter(
        "from test_policies import check_rotated_partial_query\ncheck_rotated_partial_query('cpu')\nprint('ok')"
    )


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_rotated_partial_query_on_cuda():
    check_rotated_partial_query("cuda")


def check_store_token_codes(device: str, dtype: torch.dtype) -> None:
    """``store_token_codes`` writes a decode token's codes and scale where PyTorch (project,
    ``quantize_rows``, ``store_slots``) writes them: codes within one step, the same scale (to the
    projection's rounding in 16-bit dtypes), nothing else touched."""
    generator = torch.Generator().manual_seed(0)
    batch, kv_heads, d, r, capacity = 2, 3, 24, 10, 50
    exact = dtype == torch.float32
    for bits in (8, 4):
        keys = torch.randn(batch, kv_heads, 1, d, generator=generator).to(device, dtype)
        keys[1, 2] = 0  # all-zero keys: the least scale, zero codes
        projection = torch.randn(kv_heads, d, r, generator=generator).to(device, dtype)
        slots = torch.tensor([[3, 7, 49], [0, 0, 12]], device=device)
        codes, scale = quantize_rows(
            torch.randn(batch, kv_heads, capacity, r, generator=generator).to(device, dtype), bits
        )
        token_codes, token_scale = quantize_rows(torch.matmul(keys, projection), bits)
        expected_codes = store_slots(codes.clone(), slots, token_codes, capacity)
        expected_scale = store_slots(scale.clone(), slots, token_scale, capacity)
        scoring.store_token_codes(keys, projection, slots, codes, scale)
        torch.testing.assert_close(scale, expected_scale, rtol=1e-5 if exact else 2e-2, atol=0)
        differ = code_values(codes).int() - code_values(expected_codes).int()
        assert differ.abs().max() <= 1 and (not exact or bool((differ != 0).sum() <= 2))
        scoring.store_token_codes(
            keys, projection, torch.tensor([20], device=device).expand(batch, kv_heads), codes, scale
        )
        torch.testing.assert_close(scale[:, :, 20], token_scale[:, :, 0], rtol=1e-5 if exact else 2e-2, atol=0)


@pytest.mark.skipif(scoring.triton is None, reason="triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the compiled kernel is tested")
def test_store_token_codes_in_interpreter():
    script = "import torch\nfrom test_policies import check_store_token_codes\n"
    run_in_interpreter(script + "check_store_token_codes('cpu', torch.float32)\nprint('ok')")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_token_codes_on_cuda(dtype):
    check_store_token_codes("cuda", dtype)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("bits", [8, 4])
def test_fused_scores_on_cuda_match_the_pytorch_path(bits):
    generator = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 8, 1000, 40, generator=generator)
    codes, scale = quantize_rows(keys.bfloat16(), bits)
    valid = torch.rand(2, 8, 1000, generator=generator) > 0.3
    queries = torch.randn(2, 32, 40, generator=generator).bfloat16()
    n = 777  # a slice of capacity-sized buffers, as the runtime passes them
    sliced = (codes[:, :, :n], valid[:, :, :n], scale[:, :, :n])
    fused, tile_max = scoring.fused_group_scores(queries.cuda(), *(t.cuda() for t in sliced))
    expected = group_scores(queries.float(), sliced[0], sliced[1], sliced[2].float())
    assert torch.equal(fused.isinf().cpu(), ~valid[:, :, :n])
    torch.testing.assert_close(fused.cpu(), expected, rtol=1e-4, atol=1e-3)
    assert torch.equal(tile_max, tile_maxima(fused))


def test_quest_page_bounds_bound_every_token_of_their_page():
    generator = torch.Generator().manual_seed(0)
    batch, kv_heads, group, d, n = 2, 2, 3, 8, 75
    keys = torch.randn(batch, kv_heads, n, d, generator=generator)
    policy = QuestPolicy(RuntimeConfig(policy="quest"))
    layer = fake_layer(n, batch, kv_heads)
    policy.stored(layer, slice(0, 40), keys[:, :, :40])  # a prefill, ending mid-page
    for t in range(40, n):  # decode appends
        policy.stored(layer, slice(t, t + 1), keys[:, :, t : t + 1])
    victims = torch.tensor([[3, 50], [17, 74]])  # overwrites widen the bounds
    new_keys = torch.randn(batch, kv_heads, 1, d, generator=generator) * 3
    policy.stored(layer, victims, new_keys)
    keys.scatter_(2, victims[..., None, None].expand(-1, -1, 1, d), new_keys)
    query = torch.randn(batch, kv_heads * group, d, generator=generator)
    pages = -(-n // PAGE)
    bounds = policy.upper_bounds(query, pages)  # (B, kv_heads, pages)
    logits = torch.einsum("bkgd,bktd->bkgt", query.view(batch, kv_heads, group, d), keys).amax(dim=2)
    padded = torch.nn.functional.pad(logits, (0, pages * PAGE - n), value=-torch.inf)
    page_best = padded.unflatten(2, (pages, PAGE)).amax(dim=-1)
    assert (bounds >= page_best - 1e-5).all()
    assert ((bounds - page_best) < 0.5 * bounds.abs().mean()).float().mean() > 0.2  # and not uselessly loose


def test_quest_selects_whole_pages_within_the_cache(tiny_llama):
    model, artifact = tiny_llama
    cache = cache_for(model, artifact, policy="quest", budget=0.3)
    device = model.device
    greedy(model, {"input_ids": torch.randint(3, 512, (2, 45), device=device)}, cache, new_tokens=3)
    layer = cache.offloaded[0]
    selection = layer.policy.select(
        layer, torch.randn(2, model.config.hidden_size, device=device), cache.rope(layer.index)
    )
    assert (selection.count % PAGE == 0).all()
    kept = torch.arange(selection.indices.shape[-1], device=device) < selection.count[:, None, None]
    pages = selection.indices.unflatten(-1, (-1, PAGE))
    whole = pages == pages[..., :1] + torch.arange(PAGE, device=device)
    assert whole.where(kept.unflatten(-1, (-1, PAGE)), True).all() and (pages[..., 0] % PAGE == 0).all()
    attended = cache.fetch_mask(layer, selection)[..., :-1]
    assert (selection.indices[attended] < layer.used).all() and selection.indices.max() < layer.capacity


@pytest.fixture(scope="module")
def tiny_setups(tokenizer):
    """tiny_setup(arch, device), made once per module."""
    made = {}

    def get(arch: str, device: str):
        if (arch, device) not in made:
            made[arch, device] = tiny_setup(tokenizer, arch, device)
        return made[arch, device]

    return get


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_every_policy_decodes_within_its_budget(tiny_setups, arch, policy, device):
    """The shared matrix: each policy through generate() on a padded batch, its fetches within budget,
    and only from the offloaded layers: on tiny Gemma 3 the full-attention layers 3 and 5, never a
    sliding-window one (prompts of 40 and 64 tokens, window 8)."""
    model, artifact = tiny_setups(arch, device)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (40, 64)]
    cache = cache_for(model, artifact, policy=policy, budget=0.25)
    out = greedy(model, padded_batch(prompts, pad=1, device=model.device), cache, new_tokens=6)
    assert out.shape == (2, 6)
    stats = cache.summary()
    if not POLICIES[policy].offloads:
        assert stats["bytes_host_to_device"] == 0
        return
    assert set(stats["per_layer"]) == ({3, 5} if arch == "gemma3" else {2})
    fraction = stats["fraction_fetched"]
    assert 0 < fraction <= (0.25 + PAGE / 64 if POLICIES[policy].budgeted else 1.0)
    codec = POLICIES[policy].codec
    bits = codec.bits_per_value if codec else row_bits(RuntimeConfig(policy=policy))  # 8: the default
    assert stats["fraction_bytes"] == pytest.approx(fraction * bits / 16, abs=1e-3)


class NarrowView:
    """A layer as ``LayerView`` shows it: reading anything else fails."""

    members = frozenset(name for name in dir(LayerView) if not name.startswith("_"))

    def __init__(self, layer: OffloadedLayer) -> None:
        self.layer = layer

    def __getattr__(self, name: str):
        if name not in self.members:
            raise AttributeError(f"a policy read layer.{name}, which LayerView does not offer")
        return getattr(self.layer, name)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_policies_read_their_layer_through_the_layer_view_only(tiny_llama, policy, monkeypatch):
    model, artifact = tiny_llama
    cache = cache_for(model, artifact, policy=policy, budget=0.3)
    for layer in cache.offloaded:
        for method in ("select", "stored", "attended"):
            real = getattr(layer.policy, method)
            monkeypatch.setattr(layer.policy, method, lambda layer, *args, real=real: real(NarrowView(layer), *args))
    inputs = {"input_ids": torch.randint(3, 512, (2, 30), generator=torch.Generator().manual_seed(7))}
    assert greedy(model, {k: v.to(model.device) for k, v in inputs.items()}, cache, new_tokens=4).shape == (2, 4)


@pytest.mark.parametrize(("policy", "agreement"), [("int4", 0.9), ("int2", 0.5)])
def test_quantized_kv_tracks_dense_and_moves_fewer_bytes(tokenizer, policy, agreement, device):
    model, artifact = tiny_setup(tokenizer, "qwen2", device)
    ids = torch.randint(3, 512, (2, 72), generator=torch.Generator().manual_seed(2)).to(device)
    dense = teacher_forced_argmax(model, ids, 40, cache_for(model, artifact, policy="full", kv_bits=16))
    full_bytes = cache_for(model, artifact, policy="full", kv_bits=16)
    teacher_forced_argmax(model, ids, 40, full_bytes)
    quantized = cache_for(model, artifact, policy=policy)
    assert float((teacher_forced_argmax(model, ids, 40, quantized) == dense).float().mean()) >= agreement
    moved, full_moved = quantized.summary()["bytes_host_to_device"], full_bytes.summary()["bytes_host_to_device"]
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    stored = quantized.policy_type.codec.stored_dim(head_dim, model.dtype)
    assert moved == full_moved * stored // head_dim


@pytest.mark.cuda
@pytest.mark.parametrize(("policy", "alpha"), [(policy, None) for policy in sorted(POLICIES)] + [("infinigen", 2.0)])
def test_captured_selection_decodes_as_launched_kernels(tiny_llama, policy, alpha):
    """CUDA graphs replay the same selection, also across capacity changes (small pool blocks make
    the captures repeat while decoding), and with a finite alpha, whose count a score's last bit can
    change (one GPU: what tensor parallelism adds, the count's all-reduce, is not in this test)."""
    model, artifact = tiny_llama
    if model.device.type != "cuda":
        pytest.skip("CUDA graphs need CUDA")
    inputs = {"input_ids": torch.randint(3, 512, (2, 40), generator=torch.Generator().manual_seed(5)).cuda()}
    settings = dict(policy=policy, budget=0.3, block_tokens=16) | ({} if alpha is None else {"alpha": alpha})
    captured = cache_for(model, artifact, **settings)
    tokens = greedy(model, inputs, captured, new_tokens=30)
    assert all(layer.selection_graph.capacity == layer.capacity for layer in captured.offloaded)
    launched = cache_for(model, artifact, cuda_graphs=False, **settings)
    assert torch.equal(tokens, greedy(model, inputs, launched, new_tokens=30))
    assert all(layer.selection_graph is None for layer in launched.offloaded)
    assert captured.summary()["fraction_fetched"] == launched.summary()["fraction_fetched"]


@pytest.mark.cuda
def test_captured_selection_survives_a_longer_shared_arange(tiny_llama, monkeypatch):
    """A layer's selection graph reads the cache's shared arange (``all_slots``); another caller may
    replace it by a longer one between replays. The graph keeps the one it read alive: its memory
    is not handed out again, and junk written to new allocations does not reach the selection."""
    from infinigen.runtime.cache.graphs import SelectionGraph

    model, artifact = tiny_llama
    if model.device.type != "cuda":
        pytest.skip("CUDA graphs need CUDA")
    replay, junk = SelectionGraph.__call__, []

    def replay_then_grow(graph, layer, hidden, norm, rope):
        out = replay(graph, layer, hidden, norm, rope)
        old = layer.cache.slot_range
        if old.numel() < 4096:
            layer.cache.all_slots(old.numel() + 1)  # replaces the arange the graph was captured with
            junk.append(torch.full_like(old, -7))  # the size just freed, unless the graph holds it
        return out

    monkeypatch.setattr(SelectionGraph, "__call__", replay_then_grow)
    inputs = {"input_ids": torch.randint(3, 512, (2, 40), generator=torch.Generator().manual_seed(5)).cuda()}
    settings = dict(policy="infinigen", budget=0.3, block_tokens=16, recent_tokens=4)
    tokens = greedy(model, inputs, cache_for(model, artifact, **settings), new_tokens=30)
    assert junk, "the arange was replaced"
    launched = cache_for(model, artifact, cuda_graphs=False, **settings)
    assert torch.equal(tokens, greedy(model, inputs, launched, new_tokens=30))


@pytest.mark.cuda
def test_automatic_garbage_collection_during_a_capture_leaves_it_intact(tiny_llama, monkeypatch):
    """Python's collector may run at any allocation, also inside a selection's capture, and free an
    unreachable cache whose CUDA graphs are then destroyed: that would end the capture."""
    model, artifact = tiny_llama
    if model.device.type != "cuda":
        pytest.skip("CUDA graphs need CUDA")
    inputs = {"input_ids": torch.randint(3, 512, (2, 40), generator=torch.Generator().manual_seed(6)).cuda()}
    settings = dict(budget=0.3, block_tokens=16)
    expected = greedy(model, inputs, cache_for(model, artifact, cuda_graphs=False, **settings), new_tokens=20)
    dead = cache_for(model, artifact, **settings)
    greedy(model, inputs, dead, new_tokens=20)
    dead.itself = dead  # only the cyclic collector can free it
    del dead
    real_select = OffloadedLayer.select

    def select_with_collection(layer, *args):
        if torch.cuda.is_current_stream_capturing():
            thresholds = gc.get_threshold()
            gc.set_threshold(1, 1, 1)  # the next allocations trigger full automatic collections
            _ = [[] for _ in range(8)]
            gc.set_threshold(*thresholds)
        return real_select(layer, *args)

    monkeypatch.setattr(OffloadedLayer, "select", select_with_collection)
    assert torch.equal(greedy(model, inputs, cache_for(model, artifact, **settings), new_tokens=20), expected)


def test_sinks_and_recent_window_are_always_fetched(tokenizer, device):
    """With sink_tokens / recent_tokens, infinigen's selection holds each row's first cached tokens
    (after its left padding) and the last slots, within the same count as without them."""
    model, artifact = tiny_setup(tokenizer, "llama", device)
    inputs = padded_batch([list(range(5, 45)), list(range(7, 30))], 1, device)
    plain = cache_for(model, artifact, budget=0.25)
    greedy(model, inputs, plain, new_tokens=3)
    cache = cache_for(model, artifact, budget=0.25, sink_tokens=2, recent_tokens=3)
    greedy(model, inputs, cache, new_tokens=3)
    first = inputs["attention_mask"].int().argmax(dim=-1)  # (B,): each row's first real token
    for layer, plain_layer in zip(cache.offloaded, plain.offloaded, strict=True):
        selection, _ = layer.last_selection
        assert torch.equal(selection.count, plain_layer.last_selection[0].count)
        used = layer.used - 1  # the selection was made before the last token was stored
        for b in range(inputs["input_ids"].shape[0]):
            kept = selection.indices[b, :, : int(selection.count[b])]
            wanted = [int(first[b]), int(first[b]) + 1, used - 3, used - 2, used - 1]
            assert bool(torch.isin(torch.tensor(wanted, device=device), kept).all()), (b, kept, wanted)
    # a window longer than the context takes at most half of each row's budget, the last slots
    layer = cache.offloaded[0]
    n = layer.capacity
    cached = layer.valid[:, :, :n].sum(dim=-1)  # (B, kv_heads)
    layer.cache.slot.fill_(layer.used)  # as at a selection: the next token's slot
    window = always_fetched(layer, n, 0, 1000, 0.25)
    assert torch.equal(window.sum(dim=-1), (cached * 0.125).long())
    assert bool(window[:, :, : layer.used - int((cached * 0.125).max())].logical_not().all())
