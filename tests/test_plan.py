"""The memory plan (``runtime.memory.plan``) against bytes counted by hand, its shedding order, its
refusal line, and ``infinigen plan``."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from conftest import invoke, tiny_model
from helpers import llama_config
from transformers import AutoModelForCausalLM

from infinigen.bench.shapes import shape_config
from infinigen.runtime.config import RuntimeConfig
from infinigen.runtime.memory import plan as memory

BF16 = torch.bfloat16


def parts(found: memory.MemoryPlan) -> dict[str, int]:
    return {p.name: p.nbytes for p in found.parts}


def test_the_8b_shape_weights_and_kv_counted_by_hand():
    """Llama-3-8B: 8,030,261,248 parameters (embeddings and LM head apart), and each KV part from its
    geometry: 8 KV heads of 128, 2 bytes a value."""
    model = memory.model_of(shape_config("llama-3-8b"), BF16)
    h, layers, mlp, vocab, kv = 4096, 32, 14336, 128256, 8 * 128
    params = vocab * h * 2 + layers * (2 * h * h + 2 * h * kv + 3 * h * mlp + 2 * h) + h
    assert params == 8_030_261_248 and model.weight_bytes == 2 * params
    work = memory.Workload(batch=2, context=20000, new_tokens=100, prefill_chunk=4096)
    config = RuntimeConfig(reuse_rows="off", kv_bits=16)
    found = parts(memory.plan(model, BF16, work, config))
    row = kv * 2 * 2  # a token's K and V of every KV head, bytes
    assert found["dense layers' KV"] == 2 * 2 * row * 20100  # the run's length, from the start
    capacity = 20 * 1024  # 20,100 tokens in pool blocks of 1,024
    # a slot's valid flag, 4-bit codes of 64 partial channels and a bf16 scale; 30 offloaded layers
    assert found["offloaded layers' slot state"] == 30 * 2 * 8 * capacity * (1 + 32 + 2)
    assert found["decode: fetch staging"] == 2 * 2 * row * (math.ceil(0.1 * capacity) + 1)
    assert found["CPU KV pool"] == 30 * 2 * 8 * capacity * 512  # 512-byte rows
    assert found["prefill: attention mask"] == 2 * 4096 * 20000  # booleans, the last chunk's over every key
    # a later chunk's attention at its most, in chunks of 1,024: the last full chunk's own causal block, its keys
    # and values repeated for 32 query heads, the output in bf16 and float32; unpadded, no block of 4,096 earlier
    # keys repeats its KV (each KV head's query group folds into the queries)
    chunked = parts(memory.plan(model, BF16, replace(work, prefill_chunk=1024), config))
    assert chunked["prefill: attention"] == 2 * 32 * 1024 * 128 * (2 * 2 + 2 + 8)
    # a layer's activations at its attention (residual, normed copy, projections before and after rotary, output
    # and its projection); the MLP's exceed them by less than the attention's workspace: nothing more counted
    assert chunked["prefill: a layer's activations"] == 2 * 1024 * 2 * (4 * h + 2 * (32 + 2 * 8) * 128)
    assert 2 * 1024 * 2 * (2 * h + 3 * mlp) < chunked["prefill: a layer's activations"] + chunked["prefill: attention"]
    assert chunked[memory.MLP_BEYOND] == 0
    # two blocks of 4,096 earlier rows staged for a later chunk; 8-bit rows: codes, and the rows they decode to
    assert found["prefill: earlier chunks' blocks"] == 2 * 2 * 8 * 4096 * 2 * 256
    eight = parts(memory.plan(model, BF16, work, replace(config, kv_bits=8)))
    assert eight["prefill: earlier chunks' blocks"] == 2 * 2 * 8 * 4096 * 2 * (128 + 256)
    # exact decoding's verification at the run's end, the decode's parts held: two staged blocks of the first
    # offloaded layer, the next one's every row fetched ahead (K and V of 256 bytes each)
    exact = memory.plan(model, BF16, work, replace(config, exact=True))
    assert parts(exact)["decode: exact decoding's verification"] == 2 * 8 * 2 * (2 * 4096 + 20100) * 256
    assert exact.gpu("decode") == memory.plan(model, BF16, work, config).gpu("decode") + 2 * 8 * 2 * 28292 * 256


def test_exact_decoding_fetches_ahead_before_it_keeps_rows_of_earlier_steps():
    """A verification reads every row as a later chunk does, at about the bus's time where the next layer's rows
    are fetched ahead: under --exact (8B shape, 1 x 128K, a 24 GB card, 16-bit rows) the plan keeps the fetch and
    fewer rows of earlier steps; with the fetch not asked, the rows of the same budget stay (resident_extra 1)."""
    model = memory.model_of(shape_config("llama-3-8b"), BF16)
    work = memory.Workload(batch=1, context=131072, new_tokens=128, prefill_chunk=4096)
    budget = memory.budget_bytes(24, torch.device("cpu"))
    exact = RuntimeConfig(kv_bits=16, exact=True)
    fetching = memory.plan(model, BF16, work, exact, budget)
    staged = memory.plan(model, BF16, work, replace(exact, prefill_fetch_ahead=False), budget)
    assert fetching.fits and fetching.config.prefill_fetch_ahead and fetching.config.resident_extra == 0.0
    assert fetching.shed == ("rows of earlier steps: resident_extra 0",)
    assert staged.fits and staged.config.resident_extra == 1.0
    # the fetch with those rows would not fit: what the verification reads ahead is the difference
    kept = memory.plan(model, BF16, work, replace(staged.config, prefill_fetch_ahead=True))
    assert not replace(kept, budget=budget).fits
    assert (fetching.config.dense_layers, fetching.workload.prefill_chunk) == (2, 4096)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "opt", "gemma3"])
def test_weights_are_the_models_parameters(arch):
    """On the meta device, the plan counts what the model holds (biases, tied or untied heads, OPT's
    learned positions, Gemma 3's norms): a materialized tiny model's parameters, once each."""
    model = tiny_model(arch)
    expected = sum(p.numel() for p in model.parameters()) * 2
    assert memory.model_of(model.config, BF16).weight_bytes == expected


@pytest.mark.parametrize("arch", ["llama", "qwen2", "opt", "gemma3"])
@pytest.mark.parametrize("kv_bits", [16, 8])
def test_the_plan_counts_what_a_cache_holds(tokenizer, arch, kv_bits):
    """A tiny model decoded through the runtime (chunked prefill, then decode steps): its dense layers'
    buffers, its sliding-window rings (Gemma 3), its offloaded layers' slot state (validity, 4-bit partial
    keys and their scales; 8-bit rows' scales and channel factors), its speculators' partial projections
    (2.4 GB for OPT-30B: a plan without them missed its peak by 5-8%), its CPU pools and its decode steps' two
    staging buffers hold exactly the bytes the plan gives them; the run crosses a pool block while decoding,
    and the staging buffers, made at the run's last capacity, never grow (a doubled one ran a plan out)."""
    from helpers import tiny_setup

    from infinigen.architectures import model_spec
    from infinigen.runtime import cache_argument, cache_for, decode
    from infinigen.runtime.cache.layers import DenseLayer, OffloadedLayer
    from infinigen.runtime.cache.sliding import SlidingLayer
    from infinigen.runtime.selection.speculation import padded_channels

    model, artifact = tiny_setup(tokenizer, arch, "cpu")
    work = memory.Workload(batch=2, context=240, new_tokens=40, prefill_chunk=64)  # 256 slots, then 384
    config = RuntimeConfig(block_tokens=128, reuse_rows="off", kv_bits=kv_bits)
    ids = torch.randint(3, 512, (2, work.context), generator=torch.Generator().manual_seed(0))
    kwargs = dict(max_new_tokens=work.new_tokens, do_sample=False, pad_token_id=1, custom_generate=decode)
    with cache_for(model, artifact, **vars(config)) as cache:
        model.generate(ids, **{cache_argument(model): cache}, prefill_chunk_size=work.prefill_chunk, **kwargs)

        def held(kind) -> int:
            return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if type(layer) is kind)

        offloaded = [layer for layer in cache.layers if isinstance(layer, OffloadedLayer)]
        state = sum(
            layer.valid.nbytes + layer.policy.partial_key_cache.nbytes + layer.policy.partial_key_scale.nbytes
            for layer in offloaded
        )
        if kv_bits == 8:
            state += sum(layer.pool.scales.nbytes + layer.pool.factors.nbytes for layer in offloaded)
        pools = sum(layer.pool.nbytes for layer in offloaded)
        projections = sum(b.nbytes for layer in offloaded for b in layer.speculator.buffers())
        staging = {name: buffer.nbytes for name, buffer in cache.buffers.items()}
        dense_layers = sum(type(layer) is DenseLayer for layer in cache.layers)
        dense_held, sliding_held = held(DenseLayer), held(SlidingLayer)  # close lets the layers go
    channels = padded_channels(artifact.channels(offloaded[0].index).shape[-1])
    found = memory.plan(memory.model_of(model.config, torch.float32), torch.float32, work, config, channels=channels)
    planned = parts(found)
    spec = model_spec(model.config)
    kv_row = 2 * spec.n_kv_heads * spec.head_dim * 2 * 4  # 2 rows of float32 K and V
    dense = planned["dense layers' KV"]
    assert dense == dense_layers * kv_row * work.tokens  # told the run's length: never grown
    assert dense_held == dense and sliding_held == planned["sliding windows' KV"]
    assert state == planned["offloaded layers' slot state"] and pools == planned["CPU KV pool"]
    assert projections == planned["speculators' projections"] > 0  # OPT's: folded query rows over the hidden size
    assert min(dense, state, pools) > 0 and (sliding_held > 0) == (arch == "gemma3")
    assert {name for name, _ in staging} == {"rows"}  # one per layer parity (a tiny model may use one)
    assert all(2 * nbytes == planned["decode: fetch staging"] for nbytes in staging.values())


def test_sliding_layers_hold_their_window():
    """Gemma 3's local layers keep a ring of ``window`` slots whatever the context; its global layers
    offload (beyond the dense ones)."""
    config = tiny_model("gemma3").config
    windows = [config.sliding_window if t == "sliding_attention" else None for t in config.layer_types]
    model = memory.model_of(config, BF16)
    work = memory.Workload(batch=3, context=5000)
    found = parts(memory.plan(model, BF16, work, RuntimeConfig(policy="full")))
    row = config.num_key_value_heads * config.head_dim * 2 * 2
    assert found["sliding windows' KV"] == 3 * row * sum(w for w in windows if w is not None)


def test_dense_policy_keeps_every_layer_on_the_gpu():
    model = memory.model_of(shape_config("llama-3-8b"), BF16)
    found = parts(memory.plan(model, BF16, memory.Workload(1, 8192), RuntimeConfig(policy="dense")))
    assert found["dense layers' KV"] == 32 * 8192 * 8 * 128 * 2 * 2  # the prompt exactly: no token more
    assert "CPU KV pool" not in found and "resident rows" not in found


@pytest.mark.parametrize("kv_bits", [16, 8])
def test_shedding_follows_the_documented_order(kv_bits):
    """As the budget shrinks, decoding gives up rows of earlier steps (2 -> 1 -> 0; with 8-bit rows each kept 16-bit on
    the GPU, then 8-bit), then reuse; the prefill halves its chunk; dense layers go (down to 0: layer 0 then selects
    from its own input) only where neither suffices. Each phase gives up only what it needs: the settings chosen move
    one way through that order, and each plan's statement says what was given up. Fetching the next layer's prefill
    blocks ahead (speed alone) is kept only where that leaves room."""
    model = memory.model_of(shape_config("llama-3-8b"), BF16)
    work = memory.Workload(batch=4, context=65536, new_tokens=64, prefill_chunk=4096)
    config = RuntimeConfig(streamed_layers=0, kv_bits=kv_bits)  # streamed weights, the last resort: below
    kept = [(extra, bits) for extra in (2.0, 1.0, 0.0) for bits in ((16, 8) if kv_bits == 8 else (16,))]
    decoding = {**{(True, *setting): i for i, setting in enumerate(kept)}, (False, 0.0, 16): len(kept)}
    states, ahead = [], []
    for budget in range(memory.plan(model, BF16, work, config).needed_gpu, model.weight_bytes, -25_000_000):
        found = memory.plan(model, BF16, work, config, budget)
        if not found.fits:
            break
        assert found.needed_gpu <= budget
        extra = found.config.resident_extra_or_default if found.reuse else 0.0
        bits = (found.config.resident_bits or 16) if found.reuse else 16
        dense_given_up, chunk_shrunk_by = 2 - found.config.dense_layers, 4096 // found.workload.prefill_chunk
        state = (dense_given_up, decoding[found.reuse, extra, bits], chunk_shrunk_by)
        said = [f"rows of earlier steps: resident_extra {extra:g}"] if found.reuse and extra < 2 else []
        said += ["rows kept on the GPU: 8-bit"] * (found.reuse and bits == 8) + ["row reuse off"] * (not found.reuse)
        said += [f"dense layers: {found.config.dense_layers}"] * (state[0] > 0)
        said += [f"prefill chunk: {found.workload.prefill_chunk} tokens"] * (state[2] > 1)
        said += ["prefill: no layer's blocks fetched ahead"] * (not found.config.prefill_fetch_ahead)
        assert list(found.shed) == said
        states.append(state)
        ahead.append(found.config.prefill_fetch_ahead)
    assert states == sorted(states), "a smaller budget never gets back what a larger one gave up"
    assert ahead[0] and not all(ahead)
    reached = {s[1] for s in states}
    assert reached == set(range(len(kept) + 1)) if kv_bits == 16 else {0, 1, len(kept) - 1, len(kept)} <= reached
    assert max(s[2] for s in states) >= 4 and states[-1][0] == 2


def test_padding_costs_the_prefill_a_mask_and_a_bias(tokenizer):
    """Rows of different lengths give every prefill attention a mask: a one-shot prefill then counts the mask and
    transformers' SDPA workspace (KV repeated per query head, the mask as a bias: a second copy where its rows are
    not 16-aligned), a chunked one each block's bias; equal lengths count neither (a batch job plans its batches so)."""
    from infinigen.batch.records import Request
    from infinigen.batch.runner import Planner, Prepared, batch_plan

    model = memory.model_of(shape_config("llama-3-8b"), BF16)
    config, spec = RuntimeConfig(), model.spec
    heads, d, e = spec.n_heads, spec.head_dim, 2
    for context, copies, aligned in ((4096, 1, 4096), (4100, 2, 4112)):
        one_shot = memory.Workload(4, context, 8)
        plain, padded = (memory.plan(model, BF16, replace(one_shot, padded=p), config) for p in (False, True))
        assert "prefill: attention" not in {p.name for p in plain.parts}
        sdpa = 4 * (3 * heads * context * d * e + copies * context * aligned * e)
        attention, mlp = (4 * context * e * n for n in (4 * 4096 + 2 * 48 * d, 2 * 4096 + 3 * 14336))
        # the mask, and the attention's moment with SDPA's workspace where that outgrows the MLP's
        assert padded.gpu("prefill") - plain.gpu("prefill") == 4 * context * context + max(attention + sdpa, mlp) - mlp
    chunked = memory.Workload(4, 16384, 8, 4096)
    plain, padded = (memory.plan(model, BF16, replace(chunked, padded=p), config) for p in (False, True))
    blocks = config.prefill_block_tokens
    first = 4 * (3 * heads * 4096 * d * e + 4096 * 4096 * e)
    later = 4 * heads * (2 * blocks * d * e + 4096 * d * (e + 8))
    assert padded.gpu("prefill") - plain.gpu("prefill") == max(first, later + 4 * 4096 * blocks * e) - later

    planner = Planner(tokenizer, memory.model_of(tiny_model("llama").config, BF16), BF16, {"policy": "full"})
    rows = [Prepared(Request(i, i + 1, "x"), [5] * n, 4) for i, n in enumerate((40, 40, 30))]
    assert not batch_plan(planner, rows[:2]).workload.padded and batch_plan(planner, rows).workload.padded


def test_the_8b_shape_at_16_x_32k_fits_a_24_gb_card_only_with_every_step_shed(monkeypatch):
    """The capacity the GPU-budget issue asks for on a 24 GB card: 16 x 32K of the 8B shape fits once decoding, the
    prefill (chunks of 512, blocks no larger), the dense layers (none: layer 0 selects from its own input) and the
    default 8-bit rows (their scales on the GPU) have all given way; with 1,024-token chunks it does not."""
    model = memory.model_of(shape_config("llama-3-8b"), BF16)
    work = memory.Workload(16, 32768, 8, 4096)
    budget = memory.budget_bytes(24, torch.device("cpu"))
    config = RuntimeConfig(streamed_layers=0)
    found = memory.plan(model, BF16, work, config, budget)
    shed = (
        "row reuse off",
        "dense layers: 0",
        "prefill chunk: 512 tokens",
        "rows: 16-bit (no room for 8-bit rows' scales)",
        "prefill: no layer's blocks fetched ahead",
    )
    assert found.fits and found.shed == shed and found.config.kv_bits == 16
    assert not memory.plan(model, BF16, work, replace(config, kv_bits=8), budget).fits  # 8-bit rows asked: kept
    assert found.config.prefill_block_tokens == 512
    monkeypatch.setattr(memory, "SMALLEST_CHUNK", 1024)
    assert not memory.plan(model, BF16, work, config, budget).fits


def test_a_large_batch_of_short_prompts_is_planned_by_its_length():
    """FlexGen's setting, OPT-30B at 144 x (512 + 32): pool blocks of the run's length (576 slots, not 1,024:
    host memory and the GPU's per-slot state at 56% of a whole block's), and prefill chunks below 256 tokens
    for a short prompt, where 144 rows of 256 tokens' activations do not fit."""
    model = memory.model_of(shape_config("opt-30b"), torch.float16)
    work = memory.Workload(144, 512, 32, 4096)
    found = memory.plan(
        model, torch.float16, work, RuntimeConfig(policy="full", streamed_layers=48, kv_bits=16), int(15.4e9)
    )
    assert found.config.block_tokens == 576 and found.fits
    row = 56 * 128 * 2 * 2  # a token's K and V of every head
    assert parts(found)["CPU KV pool"] == 46 * 144 * 576 * row  # 46 offloaded layers
    assert found.workload.prefill_chunk < 256 and found.workload.prefill_chunk >= 512 // 16
    long = memory.plan(
        model, torch.float16, replace(work, batch=1, context=8192), RuntimeConfig(policy="full", kv_bits=16)
    )
    assert long.config.block_tokens == 1024


def test_transformers_caches_estimated_by_hand():
    """``DynamicCache``: every layer's KV on the GPU, one layer's twice while it grows; offloaded: the
    running and the prefetched layer's; both repeat a chunk's keys for each query head in the prefill."""
    from infinigen.bench.hf_memory import hf_plan

    model = memory.model_of(shape_config("llama-3-8b"), BF16)
    work = memory.Workload(batch=2, context=8192, new_tokens=8, prefill_chunk=4096)
    layer = 2 * 8200 * 8 * 128 * 2 * 2
    dynamic, offloaded = (parts(hf_plan(model, BF16, work, name)) for name in ("hf-dynamic", "hf-offloaded"))
    assert dynamic["KV on the GPU"] == 32 * layer and offloaded["KV on the GPU"] == 2 * layer
    assert dynamic["decode: a layer's KV growing"] == layer and offloaded["KV in host memory"] == 32 * layer
    assert dynamic["prefill: keys and values per query head"] == 2 * 32 * 8192 * 128 * 2 * 2


def test_settings_asked_are_not_shed():
    """Row reuse asked on (not auto) is kept; only what is left to the plan gives way."""
    model = memory.model_of(shape_config("llama-3-8b"), BF16)
    work = memory.Workload(batch=4, context=65536, prefill_chunk=4096)
    asked = RuntimeConfig(reuse_rows="on", resident_extra=2.0)
    needed = memory.plan(model, BF16, work, asked).needed_gpu
    found = memory.plan(model, BF16, work, asked, needed - 10**9)
    assert found.reuse and "row reuse off" not in found.shed


def test_refusal_names_what_does_not_fit_and_the_nearest_settings():
    model = memory.model_of(shape_config("llama-3-8b"), BF16)
    work = memory.Workload(batch=8, context=131072, prefill_chunk=4096)
    config = RuntimeConfig(streamed_layers=0)  # with none streamed (as asked)
    found = memory.plan(model, BF16, work, config, 24 * 10**9)
    assert not found.fits
    line = memory.refusal(found)
    assert line.startswith("8 x 131072 tokens (+0 new) with infinigen needs")
    assert "the budget is 24.0 GB (the weights alone 16.06 GB); nearest that fits: --context " in line
    context = int(line.split("--context ")[1].split(",")[0])
    assert memory.plan(model, BF16, replace(work, context=context), config, 24 * 10**9).fits
    assert not memory.plan(model, BF16, replace(work, context=context + 1), config, 24 * 10**9).fits
    weights_only = memory.plan(model, BF16, work, config, 10 * 10**9)
    assert memory.refusal(weights_only).endswith("the weights alone do not fit")


def test_a_pool_larger_than_the_host_has_is_refused(monkeypatch, prepared):
    """Pinned pool pages cannot be swapped: a run whose CPU pool exceeds the host memory available now is
    refused in one line (with what halves or caps it) before the weights load."""

    model = memory.model_of(shape_config("llama-3-8b"), BF16)
    found = memory.plan(model, BF16, memory.Workload(1, 131072, 8), RuntimeConfig(kv_bits=16))
    monkeypatch.setattr(memory, "host_available_bytes", lambda: found.host + 1)
    assert memory.why_not(found) is None
    monkeypatch.setattr(memory, "host_available_bytes", lambda: found.host - 1)
    line = memory.why_not(found)
    assert line.startswith("does not fit in host memory: 1 x 131072 tokens (+8 new) with infinigen needs 16.23 GB")
    assert line.endswith("--kv-bits 8 halves the pool, --cpu-pool-gb caps it (evicting), or a shorter context or batch")
    monkeypatch.undo()
    folder, out = prepared("llama")
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 1000)
    args = ("generate", str(folder), "--artifact", str(out), "--prompt", "the house was old", "--device", "cpu")
    refused = invoke(*args)
    assert refused.exit_code == 2 and "does not fit in host memory" in refused.output
    assert len(refused.output.strip().splitlines()) == 1


def test_retired_blocks_count_as_available(monkeypatch):
    """The retired blocks of dropped pools count as available: the next pool reuses them."""
    from infinigen.runtime.memory import host_memory

    before = memory.host_available_bytes()
    monkeypatch.setattr(host_memory, "_retired", [(torch.device("cpu"), torch.empty(2**30, dtype=torch.uint8))])
    assert memory.host_available_bytes() - before == pytest.approx(2**30, rel=0.05)


def test_a_loaded_models_streamed_layers_are_not_counted_against_the_host_twice(monkeypatch):
    """Once loaded, the streamed layers hold their host memory already (it is gone from what is available):
    a plan beside the loaded model needs only the rest (a bench case at the batch its plan chose was refused)."""
    model = memory.model_of(shape_config("opt-30b"), torch.float16)
    found = memory.plan(model, torch.float16, memory.Workload(4, 1920, 16), RuntimeConfig(streamed_layers=20))
    weights = parts(found)[memory.STREAMED_WEIGHTS]
    monkeypatch.setattr(memory, "host_available_bytes", lambda: found.host - weights)
    assert not memory.fits_host(found) and memory.fits_host(replace(found, weights_loaded=True))
    assert f"and streamed weights ({memory.gb(weights)} GB)" in memory.why_not(found)


def test_plan_command_json_and_table(monkeypatch):
    args = ["--shape", "llama-3-8b", "--gpu-memory-gb", "24", "--batch", "1", "--context", "131072", "--json"]
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 128 * 10**9)  # the GPU machine's host
    result = invoke("plan", *args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["fits"] and report["budget_gb"] == memory.gb(24e9 - memory.CONTEXT_BYTES)
    assert report["settings"]["prefill_chunk"] == 4096 and report["shed"]
    capacity = {row["policy"]: row for row in report["capacity"]}
    assert capacity["infinigen"]["largest_context"] >= 8 * capacity["dense"]["largest_context"]
    assert capacity["infinigen"]["largest_tokens"] >= 8 * capacity["hf-dynamic"]["largest_tokens"]
    # the host memory bounds it too: a smaller host, a shorter context (its pool), the GPU-resident cache as it was
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 32 * 10**9)
    smaller = {row["policy"]: row for row in json.loads(invoke("plan", *args).stdout)["capacity"]}
    assert smaller["infinigen"]["largest_context"] < capacity["infinigen"]["largest_context"]
    pool = memory.plan(
        memory.model_of(shape_config("llama-3-8b"), torch.bfloat16),
        torch.bfloat16,
        memory.Workload(1, smaller["infinigen"]["largest_context"] + 1024, 128, 4096),
        RuntimeConfig(gpu_memory_gb=24),
        memory.budget_bytes(24, torch.device("cpu")),
    )
    assert not memory.fits_host(pool) and smaller["hf-dynamic"] == capacity["hf-dynamic"]
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 128 * 10**9)
    names = {p["part"] for p in report["parts"]}
    assert {"weights", "decode: resident rows", "CPU KV pool", "prefill: attention mask"} <= names
    # 32 chunks of 4,096, each after the first reading the earlier ones' rows again: about half the pool each
    pool = sum(p["gb"] for p in report["parts"] if p["part"] == "CPU KV pool")
    assert report["prefill_moved_gb"] == pytest.approx(pool * 31 / 2, rel=1e-3)
    table = invoke("plan", *args[:-1])
    assert table.exit_code == 0 and "memory plan" in table.stdout and "largest context" in table.stdout
    assert "prefill over the bus" in table.stdout
    # the host too: a KV pool larger than the host memory available now is said to not fit, in the summary's words
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 10**9)
    short = json.loads(invoke("plan", *args).stdout)
    assert short["fits"] and not short["fits_host"] and short["host_available_gb"] == 1.0
    assert short["refusal"].startswith("does not fit in host memory: 1 x 131072 tokens")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("--shape llama-3-8b --context 0", "--batch and --context must be at least 1"),
        ("--shape llama-3-8b --gpu-memory-gb -1", "gpu_memory_gb must be positive, got -1.0"),
        ("--shape nope", "unknown shape 'nope'"),
        ("smollm2-135m --shape llama-3-8b", "give MODEL or --shape, not both"),
        ("--shape llama-3-8b --bus-gb-s 0", "--bus-gb-s must be a positive rate in GB/s, got 0.0"),
    ],
)
def test_plan_command_refuses_bad_input(args, message):
    result = invoke("plan", *args.split())
    assert result.exit_code == 2 and message in " ".join(result.output.split())


def test_the_plan_predicts_the_step_at_a_given_bus_rate():
    """The 8B shape at 1 x 128K + 128, the defaults, on a PCIe Gen4 link: 30 offloaded layers x 8 KV heads x a tenth
    of 131,200 tokens (13,120) of 256-byte 8-bit rows cross the bus a step, at 25 GB/s (without row reuse's saving:
    the rows a step selects again are not known before it runs)."""
    args = ["--shape", "llama-3-8b", "--gpu-memory-gb", "24", "--context", "131072", "--json"]
    result = invoke("plan", *args, "--bus-gb-s", "25")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["step_floor_ms"] == round(30 * 8 * 13_120 * 256 / 25e9 * 1e3, 2) == 32.24
    assert report["pinned_h2d_gb_s"] == 25 and report["bus_from"] == "--bus-gb-s"
    slower = json.loads(invoke("plan", *args, "--bus-gb-s", "12.5").stdout)
    assert slower["step_floor_ms"] == pytest.approx(2 * report["step_floor_ms"], abs=0.01)


def test_a_real_models_config_alone(tmp_path):
    """A checkpoint folder: its config is read, no weights (the folder has none)."""
    config = llama_config(hidden=64, layers=2, heads=4, kv_heads=2, mlp=128, vocab=256)
    config.save_pretrained(tmp_path)
    result = invoke("plan", str(tmp_path), "--gpu-memory-gb", "2", "--context", "1000", "--json")
    assert result.exit_code == 0, result.output
    weights = next(p for p in json.loads(result.stdout)["parts"] if p["part"] == "weights")
    assert weights["gb"] == round(sum(p.numel() for p in tiny_weights(config)) * 2 / 1e9, 3)


def tiny_weights(config):
    return AutoModelForCausalLM.from_config(config).parameters()
