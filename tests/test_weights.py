"""Streamed weights (runtime.weights): decoder layers kept in host memory and copied into a few slots one
layer ahead give the resident model's tokens exactly, with transformers' own cache and with the runtime's
(whose speculation reads the next layer's query projection ahead of its forward), and leave the model
as it was found."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import invoke, tiny_model
from helpers import EXACT, greedy, padded_batch, tiny_setup

from infinigen.architectures import decoder_layers
from infinigen.errors import InfinigenError
from infinigen.runtime import RuntimeConfig, cache_for
from infinigen.runtime.memory.sizing import streamed_layer_indices
from infinigen.runtime.weights import StreamedWeights, layer_bytes, place_weights, streamed_weights

PROMPTS = [[5, 9, 23, 7, 41, 3, 11, 60, 2, 17, 33, 8], [14, 6, 90, 21, 4, 12, 44]]


def snapshot(model) -> dict[str, tuple[torch.device, int, torch.Tensor]]:
    return {name: (p.device, p.data_ptr(), p.detach().clone()) for name, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "opt", "gemma3"])
@pytest.mark.parametrize("streamed, ahead", [((1,), 0), ((0, 1, 2), 0), ((0, 1, 2), 1), ((1, 2), 1)])
def test_streamed_layers_decode_as_resident_ones(tokenizer, arch, streamed, ahead, device):
    """Every slot count: fewer slots than streamed layers (each copied at every forward), as many (copied
    once), a layer alone; with transformers' DynamicCache, token for token."""
    model = tiny_model(arch).to(device)
    inputs = padded_batch(PROMPTS, 1, device)
    with torch.no_grad():
        resident = greedy(model, inputs)
        with StreamedWeights(model, streamed, device, ahead=ahead):
            assert torch.equal(greedy(model, inputs), resident)


@pytest.mark.parametrize("arch", ["llama", "opt", "gemma3"])
@pytest.mark.parametrize("policy", ["infinigen", "full"])
def test_streamed_weights_under_the_runtime_cache_reproduce_dense(tokenizer, arch, policy, device):
    """With the runtime's cache at budget 1.0 (dense decoding): the speculation of layer i+1 during layer i
    reads layer i+1's query projection, which ``ahead`` 1 keeps in its slot."""
    model, artifact = tiny_setup(tokenizer, arch, device)
    inputs = padded_batch(PROMPTS, 1, device)
    layers = range(len(decoder_layers(model)))
    with torch.no_grad():
        dense = greedy(model, inputs)
        with (
            StreamedWeights(model, layers, device, ahead=1),
            cache_for(model, artifact, policy=policy, **EXACT) as cache,
        ):
            assert torch.equal(greedy(model, inputs, cache), dense)


def test_the_model_is_left_as_it_was_found(tokenizer, device):
    """After close: every parameter on its device with its values, no hooks, no attribute; on the CPU the
    very same tensors (nothing copied where nothing had to move)."""
    model = tiny_model("llama").to(device)
    before = snapshot(model)
    hooks = [(len(b._forward_pre_hooks), len(b._forward_hooks)) for b in decoder_layers(model)]
    weights = StreamedWeights(model, [0, 2], device)
    assert streamed_weights(model) is weights
    with torch.no_grad():
        greedy(model, padded_batch(PROMPTS, 1, device), new_tokens=3)
    weights.close()
    assert streamed_weights(model) is None
    assert [(len(b._forward_pre_hooks), len(b._forward_hooks)) for b in decoder_layers(model)] == hooks
    for name, p in model.named_parameters():
        where, pointer, values = before[name]
        assert p.device == where and torch.equal(p.detach(), values), name
        if device == "cpu":
            assert p.data_ptr() == pointer, name


def test_streamed_layers_leave_the_device_until_their_turn(device):
    """Outside its forward a streamed layer's parameters are the host copy (a late reader cannot see
    another layer's weights in a reused slot); the slots are as large as the largest streamed layer, and
    on CUDA each layer's host copy is one pinned block of its size."""
    model = tiny_model("llama").to(device)
    blocks = decoder_layers(model)
    with StreamedWeights(model, [1, 2], device) as weights:
        assert all(p.device.type == "cpu" for b in blocks[1:] for p in b.parameters())
        assert all(p.device.type == torch.device(device).type for p in blocks[0].parameters())
        assert [s.numel() for s in weights.slots] == [layer_bytes(blocks[1])] * 2
        if device == "cuda":  # each layer in one pinned block of exactly its bytes (no power-of-two rounding)
            assert all(p.is_pinned() for b in blocks[1:] for p in b.parameters())
            assert [block.numel() for block in weights.pinned] == [layer_bytes(b) for b in blocks[1:]]
            for block, layer in zip(weights.pinned, blocks[1:], strict=True):
                start, end = block.data_ptr(), block.data_ptr() + block.numel()
                assert all(start <= p.data_ptr() < end for p in layer.parameters())


def test_slots_that_do_not_fit_leave_the_model_as_found(device, monkeypatch):
    """Out of memory for the GPU slots (the layers already moved to host memory): the error surfaces and
    every parameter is back on its device with its values, no hooks left, nothing attached."""
    model = tiny_model("llama").to(device)
    before = snapshot(model)
    empty = torch.empty

    def no_room(*args, **kwargs):
        if kwargs.get("dtype") == torch.uint8:  # a slot
            raise torch.OutOfMemoryError("CUDA out of memory (a test's)")
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", no_room)
    with pytest.raises(torch.OutOfMemoryError):
        StreamedWeights(model, [1, 2], device, ahead=1)
    monkeypatch.undo()
    assert streamed_weights(model) is None
    assert not any(block._forward_pre_hooks or block._forward_hooks for block in decoder_layers(model))
    for name, param in model.named_parameters():
        assert param.device == before[name][0] and torch.equal(param, before[name][2]), name


def test_bad_streaming_requests_are_refused_in_one_line():
    model = tiny_model("llama")
    for layers, ahead, words in (([], 0, "no decoder layer"), ([3], 0, "must lie in 0..2"), ([0], -1, "ahead")):
        with pytest.raises(InfinigenError, match=words):
            StreamedWeights(model, layers, "cpu", ahead=ahead)
    with StreamedWeights(model, [0], "cpu"), pytest.raises(InfinigenError, match="already streamed"):
        StreamedWeights(model, [1], "cpu")


def test_a_cache_streams_the_weights_its_plan_streams_and_restores_them(tokenizer, device):
    """``streamed_layers`` on a cache: its layers stream while it lives (dense decoding unchanged) and
    are back where they were after ``close()``; a model whose caller streams it already is left to it, and
    refused where it streams too few layers ahead for the policy's speculation."""
    model, artifact = tiny_setup(tokenizer, "llama", device)
    inputs = padded_batch(PROMPTS, 1, device)
    before = snapshot(model)
    with torch.no_grad():
        dense = greedy(model, inputs)
        with cache_for(model, artifact, streamed_layers=2, **EXACT) as cache:
            assert streamed_weights(model).order == [1, 2]
            assert not cache.graphs  # a captured step or selection would keep the slot each layer had then
            assert torch.equal(greedy(model, inputs, cache), dense)
        assert streamed_weights(model) is None
        assert all(p.device == before[name][0] for name, p in model.named_parameters())
        with cache_for(model, artifact, **EXACT) as cache:
            assert cache.graphs
        with StreamedWeights(model, [0, 1, 2], device, ahead=1) as ours:
            with cache_for(model, artifact, streamed_layers=2, **EXACT) as cache:
                assert streamed_weights(model) is ours
                assert torch.equal(greedy(model, inputs, cache), dense)
            assert streamed_weights(model) is ours
        with StreamedWeights(model, [1, 2], device), pytest.raises(InfinigenError, match="at least 1 layer ahead"):
            cache_for(model, artifact, **EXACT)  # its speculation would read a next layer still in host memory
        assert all(p.device == before[name][0] for name, p in model.named_parameters())


@pytest.mark.parametrize("ending", ["close", "collected"])
def test_a_caches_kv_is_let_go_before_its_streamed_weights_return(tokenizer, device, monkeypatch, ending):
    """At a budget that streams weights, the cache's KV and the whole model do not fit at once: closed or
    collected, the cache's layers are gone before a parameter goes back; the summary reads as before."""
    model, artifact = tiny_setup(tokenizer, "llama", device)
    layers_when_restored = []
    close = StreamedWeights.close

    def restoring(weights):
        layers_when_restored.append(len(cache_layers))
        close(weights)

    monkeypatch.setattr(StreamedWeights, "close", restoring)
    with torch.no_grad():
        cache = cache_for(model, artifact, policy="full", streamed_layers=2)
        cache_layers = cache.layers
        greedy(model, padded_batch(PROMPTS, 1, device), cache)
        summary = cache.summary()
        assert len(cache_layers) == 3 and summary["bytes_host_to_device"] > 0
        if ending == "close":
            cache.close()
            assert cache.summary() == summary
        del cache
    assert layers_when_restored == [0] and streamed_weights(model) is None


def test_a_model_in_host_memory_is_placed_without_its_streamed_layers(tokenizer, device):
    """``place_weights``: everything but the streamed layers goes to the device, those stream from host
    memory; the tokens are the resident model's."""
    model = tiny_model("qwen2")
    inputs = padded_batch(PROMPTS, 1, device)
    with torch.no_grad():
        resident = greedy(tiny_model("qwen2").to(device), inputs)
        weights = place_weights(model, device, RuntimeConfig(policy="full", streamed_layers=2))
        blocks = decoder_layers(model)
        assert weights.order == [1, 2] and all(p.device.type == "cpu" for b in blocks[1:] for p in b.parameters())
        others = [
            p for name, p in model.named_parameters() if not name.startswith(("model.layers.1.", "model.layers.2."))
        ]
        assert all(p.device.type == torch.device(device).type for p in others)
        assert torch.equal(greedy(model, inputs), resident)
        weights.close()


def test_generate_streams_the_layers_asked_and_says_so(prepared):
    """``infinigen generate --streamed-layers N``: the model loads with N of its layers in host memory
    (streamed), the same text as with none, the plan's summary saying so."""
    folder, out = prepared("llama")
    args = ("generate", str(folder), "--artifact", str(out), "--prompt", "the house was old and the street")
    args += ("--device", "cpu", "--max-new-tokens", "6", "--json")
    resident, streamed = invoke(*args), invoke(*args, "--streamed-layers", "2")
    assert resident.exit_code == 0 and streamed.exit_code == 0, streamed.output
    report = json.loads(streamed.stdout)
    assert report["outputs"] == json.loads(resident.stdout)["outputs"]
    assert report["stats"]["memory_plan"]["streamed_layers"] == 2
    assert json.loads(resident.stdout)["stats"]["memory_plan"]["streamed_layers"] == 0
    refused = invoke(*args, "--streamed-layers", "-1")
    assert refused.exit_code == 2 and "streamed_layers must be 0 or more" in refused.output


def test_eval_loads_with_the_layers_its_runs_stream_in_host_memory(prepared, tmp_path, monkeypatch):
    """``eval ppl`` / ``needle`` / ``tasks`` where layers stream (asked here; planned for the eval's windows,
    longest prompt or largest group where the weights exceed the budget): the model loads with them in host
    memory, never whole on the device, every run plans with them, and the perplexities, answers and task
    scores are a resident run's."""
    import infinigen.runtime.weights as weights_module

    folder, out = prepared("llama")
    text = tmp_path / "text.txt"
    text.write_text("the house was old and the street was narrow and the walls were thin " * 40)
    placed = []
    place = weights_module.place_weights
    monkeypatch.setattr(weights_module, "place_weights", lambda *a: placed.append(a[2].streamed_layers) or place(*a))
    common = (str(folder), "--artifact", str(out), "--device", "cpu", "--json", "--budgets", "0.5")
    data = tmp_path / "toy.jsonl"
    line = {"context": "the house was old and the street", "choices": [" was", " the"]}
    data.write_text("".join(json.dumps(line | {"label": i % 2}) + "\n" for i in range(4)))
    runs = {
        "ppl": ("ppl", *common, "--text", str(text), "--window", "64", "--prefix", "32", "--windows", "2"),
        "needle": ("needle", *common, "--text", str(text), "--lengths", "96", "--depths", "0.5", "--trials", "1"),
        "tasks": ("tasks", *common, "--data", str(data), "--shots", "1", "--limit", "3", "--batch", "2"),
    }
    scores = {"ppl": lambda r: r["perplexity"], "needle": lambda r: r["accuracy"], "tasks": lambda r: r["average"]}
    for name, args in runs.items():
        resident, streamed = invoke("eval", *args), invoke("eval", *args, "--streamed-layers", "2")
        assert resident.exit_code == 0 and streamed.exit_code == 0, (name, streamed.output)
        rows = [json.loads(result.stdout)["results"] for result in (resident, streamed)]
        assert [scores[name](r) for r in rows[1]] == [scores[name](r) for r in rows[0]], name
        assert [[r["streamed_layers"] for r in run] for run in rows] == [[None, None], [2, 2]], name
    assert placed == [2, 2, 2]  # at load, once an eval; the resident runs placed nothing


def test_a_batch_job_loads_with_its_streamed_layers_in_host_memory(prepared, tmp_path, monkeypatch):
    """``generate --input`` where layers stream (asked here; planned where the weights exceed the budget):
    the model loads with them in host memory, every batch plans with them, the rows are a resident run's."""
    from test_batch import results, write_requests

    import infinigen.runtime.weights as weights_module

    folder, out = prepared("llama")
    write_requests(tmp_path / "in.jsonl", 12)
    args = ("generate", str(folder), "--artifact", str(out), "--input", str(tmp_path / "in.jsonl"), "--device", "cpu")
    args += ("--max-new-tokens", "6", "--max-batch", "4", "--json")
    placed = []
    place = weights_module.place_weights
    monkeypatch.setattr(weights_module, "place_weights", lambda *a: placed.append(a[2].streamed_layers) or place(*a))
    resident = invoke(*args, "--output", str(tmp_path / "resident.jsonl"))
    streamed = invoke(*args, "--output", str(tmp_path / "streamed.jsonl"), "--streamed-layers", "2")
    assert resident.exit_code == 0 and streamed.exit_code == 0, streamed.output
    assert placed == [2]  # at load, once; the resident run placed nothing
    assert results(tmp_path / "streamed.jsonl") == results(tmp_path / "resident.jsonl")


def test_bench_builds_a_random_shape_with_its_streamed_layers_in_host_memory():
    """A random model made with N layers spread through it in host memory (what ``bench`` builds where the
    weights exceed the GPU budget: never whole on the device) has a usual build's buffers; ``bench
    --streamed-layers 2,0`` runs each case of ours with the count it asks."""
    from infinigen.bench.shapes import random_model

    settings = RuntimeConfig(policy="full", streamed_layers=2)
    model = random_model("tiny-llama", "cpu", torch.float32, streamed=settings)
    usual = random_model("tiny-llama", "cpu", torch.float32)
    assert streamed_weights(model).order == [1, 3] and not any(p.is_meta for p in model.parameters())
    assert all(torch.equal(b, dict(usual.named_buffers())[n]) for n, b in model.named_buffers())
    streamed_weights(model).close()
    args = ("bench", "--shape", "tiny-llama", "--sizes", "2x64", "--policy", "dense,full,infinigen,hf-dynamic")
    result = invoke(
        *args, "--gen-len", "3", "--device", "cpu", "--dtype", "float32", "--streamed-layers", "2,0", "--json"
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["results"]
    assert all(row.get("error") is None and row["ms_per_step"] > 0 for row in rows)
    # weights within the budget: each case streams what it asks, its layers moved out for its run alone
    assert [row["streamed_layers"] for row in rows if row["policy"] != "hf-dynamic"] == [2, 0, 2, 0, 2, 0]


def test_a_bench_sweep_streams_weights_only_for_what_its_offloading_cases_need():
    """The 8B shape (16.06 GB of weights): on 24 GB the sweep loads every weight on the GPU, dense alone
    too (a case whose plan streams moves its own layers out); on 12 GB the weights stream, as many layers
    as ``infinigen`` needs at 1 x 32K, fewer than ``dense`` alone would make every case stream."""
    from infinigen.bench.runs import bench_cases
    from infinigen.bench.shapes import shape_config
    from infinigen.cli.bench import _streamed

    config = shape_config("llama-3-8b")
    settings = [{"policy": "dense"}, {"policy": "infinigen"}, {"policy": "hf-offloaded"}]
    on_24 = bench_cases(settings, [8], [16384], 8)
    assert _streamed(config, "bfloat16", "cpu", 24 * 10**9, on_24) is None
    assert _streamed(config, "bfloat16", "cpu", 24 * 10**9, on_24[:1]) is None
    on_12 = bench_cases(settings, [1], [32768], 8)
    both = _streamed(config, "bfloat16", "cpu", 12 * 10**9, on_12)
    offloading = _streamed(config, "bfloat16", "cpu", 12 * 10**9, on_12[1:])
    dense = _streamed(config, "bfloat16", "cpu", 12 * 10**9, on_12[:1])
    assert both.streamed_layers == offloading.streamed_layers < dense.streamed_layers < config.num_hidden_layers
    asked = bench_cases([{"policy": "infinigen", "streamed_layers": count} for count in (10, 20)], [1], [32768], 8)
    assert _streamed(config, "bfloat16", "cpu", 24 * 10**9, asked) is None  # each case streams its own
    with pytest.raises(InfinigenError, match=r"one count where the weights \(16.06 GB\) exceed .* got \[10, 20\]"):
        _streamed(config, "bfloat16", "cpu", 12 * 10**9, asked)


def test_an_auto_batch_loads_with_the_layers_its_throughput_plan_chose():
    """OPT-30B at 56 x 1,920 on 48 GB: the throughput plan admitted its pool beside 32 streamed layers' weights
    in host memory; the fewest-bytes plan of the same case streams more, whose weights would leave its pool no
    room. The model loads with the plan's count, and every case of ours runs with it."""
    from infinigen.bench.runs import bench_cases
    from infinigen.bench.shapes import shape_config
    from infinigen.cli.bench import _streamed, _with_streamed_layers

    config, budget = shape_config("opt-30b"), int(47.37e9)
    cases = bench_cases([{"policy": "infinigen"}, {"policy": "hf-accelerate"}], [56], [1920], 4)
    cases += bench_cases([{"policy": "infinigen"}], [4], [1920], 4)
    assert _streamed(config, "float16", "cpu", budget, cases).streamed_layers > 32
    plan = [{"batch": 56, "context": 1920, "streamed_layers": 32}]
    ran, loaded = _with_streamed_layers(list(cases), plan, config, "float16", "cpu", budget)
    assert loaded.streamed_layers == 32
    assert [case.config.streamed_layers for case in ran if case.ours] == [32, 32]


@pytest.mark.parametrize("layers, count", [(32, 17), (80, 43), (48, 23), (4, 2), (3, 3), (5, 9), (6, 0)])
def test_streamed_layers_spread_through_the_stack(layers, count):
    """The layers a plan streams: exactly as many as asked (at most all), the last among them, no two runs of
    resident layers differing by more than one (each hides the next streamed layer's copy)."""
    picked = streamed_layer_indices(RuntimeConfig(streamed_layers=count), layers)
    assert len(picked) == min(count, layers) and picked == sorted(set(picked))
    if picked:
        assert picked[-1] == layers - 1
        gaps = [b - a - 1 for a, b in zip([-1, *picked[:-1]], picked, strict=True)]
        assert max(gaps) - min(gaps) <= 1
