"""The runtime through transformers' generate(): exactness at full budget, sparse decoding on a real
model, padding, eviction, bad settings. Runs on CPU in CI and on CUDA where present."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch
from conftest import GEMMA3_WINDOW, tiny_model
from helpers import EXACT, EXACT_POLICIES, greedy, padded_batch, teacher_forced_argmax, tiny_setup
from transformers import DynamicCache

from infinigen.architectures import attention_norm, decoder_layers, mlp_norm
from infinigen.errors import InfinigenError
from infinigen.models import LoadedModel, ModelSource
from infinigen.prepare import prepare_artifact
from infinigen.runtime import InfinigenCache, cache_argument, cache_for
from infinigen.runtime.cache.layers import OffloadedLayer
from infinigen.runtime.kernels.scoring import LEVELS, code_values


@pytest.mark.parametrize("policy", EXACT_POLICIES)
@pytest.mark.parametrize("arch", ["opt", "llama", "qwen2", "qwen3", "gemma3"])
def test_full_budget_is_exact_tiny(tokenizer, arch, policy, device):
    """Padded prompts of 9 to 23 tokens: on tiny Gemma 3 longer than its sliding window of 8."""
    model, artifact = tiny_setup(tokenizer, arch, device)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (9, 23, 16)]
    inputs = padded_batch(prompts, pad=1, device=device)
    expected = greedy(model, inputs, DynamicCache())
    assert torch.equal(greedy(model, inputs, cache_for(model, artifact, policy=policy, **EXACT)), expected)


def test_budget_one_fetches_every_token_whatever_the_family(tokenizer):
    """Budget 1.0 needs no other setting: every cached token moves (an alpha given is kept)."""
    for arch in ("opt", "llama"):
        model, artifact = tiny_setup(tokenizer, arch, "cpu")
        cache = cache_for(model, artifact, budget=1.0)
        assert cache.config.alpha == math.inf
        greedy(model, {"input_ids": torch.randint(3, 512, (2, 24))}, cache, new_tokens=4)
        assert cache.summary()["fraction_fetched"] == 1.0
        assert cache_for(model, artifact, budget=1.0, alpha=5.0).config.alpha == 5.0  # given: kept


@pytest.mark.parametrize("arch", ["opt", "llama", "gemma3"])
@pytest.mark.parametrize(("lookahead_from", "attention_layers"), [("input", 0), ("input", 1), ("attention", 0)])
def test_where_each_selection_reads(tokenizer, arch, device, monkeypatch, lookahead_from, attention_layers):
    """Layer i's one-layer-ahead selection reads the residual stream entering layer i-1, or the one
    after layer i-1's attention (the input of its MLP norm), as ``lookahead_from`` and
    ``attention_lookahead_layers`` (counted among the offloaded layers) say, under layer i's own
    attention norm and rotary cos/sin: on tiny Gemma 3 the offloaded layers 1, 3, 5 are global layers
    selected from sliding ones, whose rotary base differs. At budget 1 decoding stays exact."""
    model, artifact = tiny_setup(tokenizer, arch, device)
    inputs = padded_batch([list(range(3, 20)), list(range(40, 50))], pad=1, device=device)
    expected = greedy(model, inputs, DynamicCache())
    settings = dict(lookahead_from=lookahead_from, attention_lookahead_layers=attention_layers, **EXACT)
    cache = cache_for(model, artifact, dense_layers=1, **settings)
    assert cache.offloaded_indices == ([1, 3, 5] if arch == "gemma3" else [1, 2])
    seen: dict[tuple[str, int], list] = {}  # (what, layer) -> one entry per decode step

    def record(what: str, layer: int, hidden: torch.Tensor, rope=None) -> None:
        if hidden.numel() == 2 * hidden.shape[-1]:  # decode steps: one token per row
            seen.setdefault((what, layer), []).append(hidden.reshape(2, hidden.shape[-1]))
            seen.setdefault((what + " rope", layer), []).append(rope)

    blocks = decoder_layers(model)
    handles = []
    for j, block in enumerate(blocks):
        handles.append(
            block.register_forward_pre_hook(
                lambda m, args, kwargs, j=j: record(
                    "input", j, args[0] if args else kwargs["hidden_states"], kwargs.get("position_embeddings")
                ),
                with_kwargs=True,
            )
        )
        handles.append(mlp_norm(block).register_forward_pre_hook(lambda m, args, j=j: record("attention", j, args[0])))
    real_prefetch = OffloadedLayer.prefetch

    def recording_prefetch(layer, hidden, norm, rope):
        record("selection", layer.index, hidden, rope)
        torch.testing.assert_close(norm(hidden), attention_norm(blocks[layer.index])(hidden))  # its own norm
        return real_prefetch(layer, hidden, norm, rope)

    monkeypatch.setattr(OffloadedLayer, "prefetch", recording_prefetch)
    assert torch.equal(greedy(model, inputs, cache), expected)
    for handle in handles:
        handle.remove()
    for rank, layer in enumerate(cache.offloaded_indices):
        after = lookahead_from == "attention" or rank < attention_layers
        source = seen["attention" if after else "input", layer - 1]
        assert len(seen["selection", layer]) == len(source) == 11  # one per decode step (the prefill selects nothing)
        assert all(torch.equal(a, b) for a, b in zip(seen["selection", layer], source, strict=True))
        for used, own, previous in zip(
            seen["selection rope", layer], seen["input rope", layer], seen["input rope", layer - 1], strict=True
        ):
            assert (used is None) == (own is None) == (arch == "opt")
            if own is not None:
                assert all(torch.equal(a, b) for a, b in zip(used, own, strict=True))
                assert torch.equal(own[0], previous[0]) == (arch != "gemma3")  # Gemma 3: another base


@pytest.mark.parametrize("arch", ["opt", "llama"])
def test_layer_0_offloaded_selects_from_its_own_input(tokenizer, arch, device, monkeypatch):
    """With no dense layer (the memory plan's last resort), layer 0 has no layer before it: each decode
    step selects its rows from layer 0's own input, under its own norm, before it runs. At budget 1
    decoding stays exact; below it, layer 0 fetches its share like any offloaded layer."""
    model, artifact = tiny_setup(tokenizer, arch, device)
    inputs = padded_batch([list(range(3, 20)), list(range(40, 50))], pad=1, device=device)
    blocks, inputs_of_0, selected_from = decoder_layers(model), [], []
    handle = blocks[0].register_forward_pre_hook(
        lambda m, args, kwargs: inputs_of_0.append(args[0] if args else kwargs["hidden_states"]), with_kwargs=True
    )
    real_prefetch = OffloadedLayer.prefetch

    def recording_prefetch(layer, hidden, norm, rope):
        if layer.index == 0:
            selected_from.append(hidden)
            torch.testing.assert_close(norm(hidden), attention_norm(blocks[0])(hidden))
        return real_prefetch(layer, hidden, norm, rope)

    monkeypatch.setattr(OffloadedLayer, "prefetch", recording_prefetch)
    try:
        expected = greedy(model, inputs, DynamicCache())
        inputs_of_0.clear()
        cache = cache_for(model, artifact, dense_layers=0, **EXACT)
        assert cache.offloaded_indices == [0, 1, 2]
        assert torch.equal(greedy(model, inputs, cache), expected)
    finally:
        handle.remove()
    decode_inputs = [h.reshape(2, -1) for h in inputs_of_0 if h.shape[1] == 1]
    assert len(selected_from) == len(decode_inputs) == 11
    assert all(torch.equal(a, b) for a, b in zip(selected_from, decode_inputs, strict=True))
    with cache_for(model, artifact, dense_layers=0, budget=0.3) as cache:
        greedy(model, inputs, cache, new_tokens=4)
        assert 0 < cache.summary()["per_layer"][0]["fraction_mean"] < 1


@pytest.mark.parametrize("policy", ["dense", "full", "infinigen"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_sliding_window_layers_keep_their_window_on_the_device(tokenizer, attention, policy, device):
    """Gemma 3's sliding-window layers keep their last window of KV on the compute device whatever the
    policy, as a ring of 8 slots (24 new tokens after padded prompts of 9 to 23 wrap it several
    times); only full-attention layers past ``dense_layers`` are offloaded. Eager and SDPA models
    decode exactly as transformers' own cache does."""
    model = tiny_model("gemma3", attn_implementation=attention).to(device)
    artifact = prepare_artifact(LoadedModel(model, tokenizer, ModelSource("tiny-gemma3", None, "local")), tokens=128)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (9, 23, 16)]
    inputs = padded_batch(prompts, pad=1, device=device)
    expected = greedy(model, inputs, DynamicCache(), new_tokens=24)
    cache = cache_for(model, artifact, policy=policy, **EXACT)
    assert torch.equal(greedy(model, inputs, cache, new_tokens=24), expected)
    kinds = [type(layer).__name__ for layer in cache.layers]
    full = "DenseLayer" if policy == "dense" else "OffloadedLayer"
    assert kinds == ["SlidingLayer", "DenseLayer", "SlidingLayer", full, "SlidingLayer", full]
    for layer in cache.layers[::2]:
        assert layer.capacity == GEMMA3_WINDOW and layer.length == 23 + 23  # the last new token is not stored
    assert model.config._attn_implementation == attention


PROMPTS = [
    "The old house on the corner of the street had stood there for a hundred years, and",
    "The capital of France is Paris, and the capital of Italy is",
    "Once upon a time",
]


@pytest.fixture
def smollm2_on(smollm2, smollm2_artifact, device):
    model = smollm2.model.to(device)
    yield model, smollm2.tokenizer, smollm2_artifact
    smollm2.model.to("cpu")


def smollm2_inputs(tokenizer, device, prompts=PROMPTS):
    return padded_batch([tokenizer(p).input_ids for p in prompts], pad=tokenizer.pad_token_id or 0, device=device)


@pytest.mark.parametrize("policy", ["full", "infinigen"])
def test_full_budget_is_exact_smollm2(smollm2_on, policy, device):
    model, tokenizer, artifact = smollm2_on
    inputs = smollm2_inputs(tokenizer, device)
    expected = greedy(model, inputs, DynamicCache(), new_tokens=16)
    assert torch.equal(greedy(model, inputs, cache_for(model, artifact, policy=policy, **EXACT), 16), expected)


def test_sparse_decoding_fetches_its_budget_and_tracks_dense_smollm2(smollm2_on, device):
    """On real text (the bundled PG-19 excerpt, a ~2K-token prompt) the budget is the fraction fetched
    (within 20%), and sparse decoding mostly keeps dense's top-1."""
    from infinigen.prepare.calibration import bundled_text

    model, tokenizer, artifact = smollm2_on
    ids = tokenizer(bundled_text(), return_tensors="pt").input_ids.to(device)
    prefix, budget = ids.shape[1] - 48, 0.1
    with torch.no_grad():
        dense = model(ids).logits[:, prefix - 1 : -1].argmax(-1)
    cache = cache_for(model, artifact, budget=budget)
    sparse = teacher_forced_argmax(model, ids, prefix, cache)
    agreement = float((sparse == dense).float().mean())
    fetched = cache.summary()["fraction_fetched"]
    print(f"SmolLM2, budget {budget}: top-1 agreement with dense {agreement:.3f}, {fetched:.3f} of the KV fetched")
    assert abs(fetched - budget) <= 0.2 * budget
    assert agreement >= 0.75  # seen on CPU: 0.81 over 96 tokens


def test_batched_equals_one_by_one_smollm2(smollm2_on, device):
    """Rows of a padded batch decode independently: same tokens as one prompt at a time."""
    model, tokenizer, artifact = smollm2_on
    batch = greedy(model, smollm2_inputs(tokenizer, device), cache_for(model, artifact), new_tokens=10)
    for row, prompt in enumerate(PROMPTS):
        alone = greedy(model, smollm2_inputs(tokenizer, device, [prompt]), cache_for(model, artifact), new_tokens=10)
        assert torch.equal(batch[row, : alone.shape[1]], alone[0]), prompt  # alone stops at its EOS


def pool_gb(tokens: int, kv_heads: int = 2, head_dim: int = 16, layers: int = 1) -> float:
    return (tokens * layers * kv_heads * 2 * head_dim * 4 + 0.5) / 1e9  # float32 rows (kv_bits 16); GB of 10^9 bytes


@pytest.mark.parametrize("eviction", ["counter", "fifo", "lru"])
def test_small_pool_evicts_and_stays_consistent(tokenizer, eviction, device):
    model, artifact = tiny_setup(tokenizer, "llama", device)
    cache = cache_for(
        model, artifact, cpu_pool_gb=pool_gb(32), block_tokens=8, eviction=eviction, budget=0.5, kv_bits=16
    )
    inputs = {"input_ids": torch.randint(3, 512, (1, 20), device=device)}
    out = greedy(model, inputs, cache, new_tokens=30)
    assert out.shape == (1, 30)
    stats = cache.summary()
    assert stats["evicted_tokens"] == 20 + 29 - 32  # 49 tokens stored (the last one generated is not), 32 slots
    layer = cache.layers[2]
    assert isinstance(layer, OffloadedLayer) and layer.used == 32 and layer.length == 49
    assert bool(layer.valid[:, :, :32].all())
    keys = torch.stack([block[:, :, :, 0] for block in layer.pool.blocks], dim=2).flatten(2, 3)  # (B, h, 32, d)
    partial = layer.speculator.partial_keys(keys.to(device))  # (B, h, 32, r)
    codes = code_values(layer.policy.partial_key_cache[:, :, :32])
    stored = codes * layer.policy.partial_key_scale[:, :, :32, None]
    step = partial.abs().amax(dim=-1, keepdim=True) / LEVELS[layer.policy.config.partial_key_bits]
    # quantized: each value off by at most half a step
    assert bool(((stored - partial).abs() <= step / 2 + 1e-6).all())
    assert int(layer.fetch_count[:, :, :32].sum()) > 0


def test_layers_define_every_attribute_at_construction(tokenizer):
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    settings = dict(cpu_pool_gb=pool_gb(32), block_tokens=8, budget=0.5, kv_bits=16)
    cache = cache_for(model, artifact, **settings)  # evicts: all bookkeeping
    before = [set(vars(layer)) for layer in cache.layers]
    greedy(model, {"input_ids": torch.randint(3, 512, (1, 20))}, cache, new_tokens=20)
    assert cache.summary()["evicted_tokens"] > 0
    assert [set(vars(layer)) for layer in cache.layers] == before


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_partial_key_cache_bits(tokenizer, bits, device):
    model, artifact = tiny_setup(tokenizer, "llama", device)
    cache = cache_for(model, artifact, partial_key_bits=bits, budget=0.5, alpha=1e9)
    greedy(model, {"input_ids": torch.randint(3, 512, (2, 30), device=device)}, cache, new_tokens=4)
    policy = cache.layers[2].policy
    assert policy.partial_key_cache.dtype == {4: torch.uint8, 8: torch.int8, 16: model.dtype}[bits]
    channels = cache.layers[2].speculator.key_projection.shape[-1]
    assert policy.partial_key_cache.shape[-1] == (channels // 2 if bits == 4 else channels)  # 4 bits: two a byte
    assert (policy.partial_key_scale is None) == (bits == 16)
    assert policy.partial_key_cache.shape[2] == cache.layers[2].capacity  # sized by the pool, no headroom


def test_pool_too_small_for_prompt(tokenizer):
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    cache = cache_for(model, artifact, cpu_pool_gb=pool_gb(8), block_tokens=8, kv_bits=16)
    with pytest.raises(InfinigenError, match="holds 8 tokens .* too few for 20 prompt tokens"):
        greedy(model, {"input_ids": torch.randint(3, 512, (1, 20))}, cache)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"budget": 0.0}, "budget must be in"),
        ({"budget": 1.5}, "budget must be in"),
        ({"alpha": -1.0}, "alpha must be non-negative"),
        ({"policy": "magic"}, "unknown policy 'magic'"),
        ({"eviction": "random"}, "eviction must be one of"),
        ({"lookahead_from": "output"}, "lookahead_from must be one of"),
        ({"attention_lookahead_layers": -1}, "attention_lookahead_layers must be >= 0"),
        ({"partial_key_bits": 2}, "partial_key_bits must be one of 4, 8, 16"),
        ({"reuse_rows": True, "cpu_pool_gb": 1.0}, "reuse_rows needs an unlimited CPU pool"),
        ({"gather_rows": 12}, "gather_rows must be a power of two"),
        ({"gather_programs": 0}, "gather_programs must be >= 1"),
        ({"reuse_rows": True, "policy": "int4"}, "reuse_rows keeps decoded rows: not for 'int4'"),
        ({"kv_bits": 4}, "kv_bits must be one of 16, 8"),
        ({"allocation": "greedy"}, "allocation must be one of adaptive, uniform"),
        ({"reuse_rows": "maybe"}, "reuse_rows must be one of auto, on, off"),
        ({"kv_bits": 8, "policy": "int2"}, "^kv_bits 8 is for policies that offload rows: 'int2' stores rows in its"),
        ({"kv_bits": 8, "policy": "dense"}, "^kv_bits 8 is for policies that offload rows: 'dense' keeps its KV on"),
        ({"kv_bits": 16, "resident_bits": 8}, "^resident_bits 8 keeps rows as they are moved: it needs kv_bits 8"),
        ({"resident_bits": 4}, "resident_bits must be one of 16, 8"),
    ],
)
def test_bad_settings(tokenizer, settings, message):
    model, artifact = tiny_setup(tokenizer, "qwen2", "cpu")
    with pytest.raises(InfinigenError, match=message):
        cache_for(model, artifact, **settings)


@pytest.mark.parametrize("policy", ["infinigen", "h2o", "quest", "oracle"])
@pytest.mark.parametrize("arch", ["opt", "llama", "gemma3"])
def test_row_reuse_attends_the_same_rows_and_moves_fewer(tokenizer, arch, policy, device):
    """With row reuse and the selection alone attended (resident_extra 0), a step moves only the rows
    its selection adds: the same tokens (the same rows attended, in other positions), the same
    fractions selected and attended, fewer rows and bytes moved."""
    model, artifact = tiny_setup(tokenizer, arch, device)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (40, 57)]
    inputs = padded_batch(prompts, pad=1, device=device)
    settings = dict(policy=policy, budget=0.3)
    plain = cache_for(model, artifact, **settings, reuse_rows="off")  # on CUDA "auto" would reuse too
    reusing = cache_for(model, artifact, **settings, reuse_rows="on", resident_extra=0.0)  # by default 2
    expected = greedy(model, inputs, plain, new_tokens=16)
    assert torch.equal(greedy(model, inputs, reusing, new_tokens=16), expected)
    before, after = plain.summary(), reusing.summary()
    assert (before["resident_extra"], after["resident_extra"]) == (0.0, 0.0)
    for name in ("fraction_fetched", "fraction_attended"):
        assert after[name] == pytest.approx(before[name], abs=1e-4)
    assert after["fraction_attended"] == after["fraction_fetched"] == pytest.approx(before["fraction_moved"], abs=1e-4)
    assert after["fraction_moved"] < after["fraction_fetched"]  # rows already on the GPU are attended, not moved
    assert 0 < after["bytes_host_to_device"] < before["bytes_host_to_device"]


@pytest.mark.parametrize(
    ("arch", "setting", "message"),
    [
        ("opt", {"do_layer_norm_before": False}, r"OPT with post-norm layers \(do_layer_norm_before=False"),
        ("gemma3", {"attn_logit_softcapping": 50.0}, r"^attention logit soft-capping \(attn_logit_softcapping=50.0\)"),
        ("gemma3", {"use_bidirectional_attention": True}, r"^bidirectional attention"),
    ],
)
def test_unsupported_attention_is_refused_clearly(arch, setting, message):
    with pytest.raises(InfinigenError, match=message):
        cache_for(tiny_model(arch, **setting), policy="full")


def test_infinigen_needs_an_artifact():
    with pytest.raises(InfinigenError, match="needs an artifact"):
        InfinigenCache(tiny_model("llama"), config=__import__("infinigen").RuntimeConfig())


def test_plain_generate_still_works_beside_a_cache(tokenizer):
    """A forward without the cache runs the model's own attention, also while the cache lives."""
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    ids = {"input_ids": torch.randint(3, 512, (1, 12))}
    before = greedy(model, ids)
    cache = cache_for(model, artifact)
    greedy(model, ids, cache)
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(greedy(model, ids), before)
    released = weakref.ref(cache)
    del cache
    gc.collect()
    assert released() is None  # the model keeps no reference to a finished cache (nor its GPU buffers)
    assert torch.equal(greedy(model, ids), before)


def test_a_failed_forward_keeps_no_reference_to_its_cache(tokenizer, monkeypatch):
    """A forward that raises in a layer (out of GPU memory, say) leaves no reference to its cache in
    the model: a caller that catches the error and retries smaller gets the memory back."""
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    cache = cache_for(model, artifact)

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

    monkeypatch.setattr(decoder_layers(model)[1].mlp, "forward", no_memory)
    with pytest.raises(torch.OutOfMemoryError):
        model(torch.randint(3, 512, (1, 12)), **{cache_argument(model): cache})
    released = weakref.ref(cache)
    del cache
    gc.collect()
    assert released() is None


def test_sampling_matches_dense_at_full_budget(tokenizer, device):
    model, artifact = tiny_setup(tokenizer, "qwen2", device)
    inputs = {"input_ids": torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(2)).to(device)}
    name = cache_argument(model)
    samples = []
    for cache in (DynamicCache(), cache_for(model, artifact, **EXACT)):
        torch.manual_seed(0)
        samples.append(
            model.generate(**inputs, max_new_tokens=10, do_sample=True, top_k=50, pad_token_id=1, **{name: cache})
        )
    assert torch.equal(samples[0], samples[1])


def test_beam_search_is_refused_clearly(tokenizer):
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    with pytest.raises(InfinigenError, match="beam search is not supported"):
        model.generate(
            torch.randint(3, 512, (1, 12)),
            max_new_tokens=4,
            num_beams=2,
            do_sample=False,
            pad_token_id=1,
            **{cache_argument(model): cache_for(model, artifact)},
        )


@pytest.mark.parametrize("arch", ["llama", "opt", "gemma3"])
def test_oracle_selects_the_exact_top_k(tokenizer, arch, monkeypatch):
    """Against logits from q/k captured in a plain forward (no cache): same sets, per KV head, in the
    first offloaded layer (Gemma 3's: a global layer, with its own rotary base)."""
    from infinigen.prepare.capture import capture_qk

    model, _ = tiny_setup(tokenizer, arch, "cpu")
    ids = torch.randint(3, 512, (1, 41), generator=torch.Generator().manual_seed(4))
    with capture_qk(model) as records, torch.no_grad():
        model(ids, use_cache=False)
    cache = cache_for(model, policy="oracle", budget=0.25)
    target = cache.offloaded_indices[0]  # the first: its input is exact (later ones follow a selection)
    q, k = records[target][0]  # q (heads, 41, d), k (kv_heads, 41, d)
    selections = []
    real_fetch = cache.fetch

    def recording_fetch(layer, sel, valid=None):
        selections.append((layer.index, sel))
        return real_fetch(layer, sel, valid)

    monkeypatch.setattr(cache, "fetch", recording_fetch)
    name = cache_argument(model)
    with torch.no_grad():
        model(ids[:, :40], **{name: cache})
        model(ids[:, 40:], **{name: cache})
    (selection,) = [sel for index, sel in selections if index == target]
    count = int(selection.count[0])
    assert count == 10  # 25% of 40 cached tokens
    logits = torch.einsum("hd,htd->ht", q[:, -1], k[:, :40].repeat_interleave(q.shape[0] // k.shape[0], 0))
    per_kv_head = logits.view(k.shape[0], -1, 40).amax(dim=1)
    for head in range(k.shape[0]):
        expected = set(per_kv_head[head].topk(count).indices.tolist())
        assert set(selection.indices[0, head, :count].tolist()) == expected


def test_without_selection_refetches_the_previous_selection(tokenizer, device, monkeypatch):
    """The ``--breakdown`` diagnostic ``select_rows = False``: no policy selection runs, and every
    offloaded layer fetches the rows it selected at the step before."""
    model, artifact = tiny_setup(tokenizer, "llama", device)
    cache = cache_for(model, artifact, budget=0.3, alpha=1e9)
    ids = torch.randint(3, 512, (2, 42), generator=torch.Generator().manual_seed(5)).to(device)
    name = cache_argument(model)
    fetched = []
    real_fetch = cache.fetch
    monkeypatch.setattr(cache, "fetch", lambda layer, *args: fetched.append(args[0]) or real_fetch(layer, *args))
    with torch.no_grad():
        model(ids[:, :40], **{name: cache})
        model(ids[:, 40:41], **{name: cache})
        before = [selection.indices.clone() for selection in fetched]
        fetched.clear()
        cache.diagnostics.select_rows = False
        for layer in cache.offloaded:
            monkeypatch.setattr(layer, "select", None)  # a selection would fail
        model(ids[:, 41:], **{name: cache})
    assert len(before) == len(fetched) == len(cache.offloaded) > 0
    assert all(torch.equal(a, b.indices) for a, b in zip(before, fetched, strict=True))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_selection_runs_beside_the_compute_stream(tokenizer, monkeypatch):
    """A prefetch's selection runs on the selection stream, so the compute stream goes on with the
    current layer; eager decoding at budget 1 stays exact (captured steps: the exactness tests)."""
    model, artifact = tiny_setup(tokenizer, "llama", "cuda")
    inputs = padded_batch([list(range(3, 20)), list(range(40, 50))], pad=1, device="cuda")
    expected = greedy(model, inputs, DynamicCache())
    cache = cache_for(model, artifact, cuda_graphs=False, **EXACT)
    streams = []
    for layer in cache.offloaded:
        real_select = layer.select
        monkeypatch.setattr(
            layer, "select", lambda *args, real=real_select: streams.append(torch.cuda.current_stream()) or real(*args)
        )
    assert torch.equal(greedy(model, inputs, cache), expected)
    assert streams and all(stream == cache.selection_stream for stream in streams)
