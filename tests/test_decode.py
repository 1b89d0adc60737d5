"""The decoding loop (``infinigen.decode`` as transformers' ``custom_generate``) and whole-step CUDA
graphs (``StepGraph``): the same tokens as transformers' own loop, for every policy; on CUDA the
captured steps replay the eager ones exactly, across buffer growth."""

from __future__ import annotations

import importlib

import pytest
import torch
from helpers import EXACT, EXACT_POLICIES, greedy, padded_batch, tiny_setup
from transformers import DynamicCache, TextStreamer

import infinigen
from infinigen import runtime
from infinigen.errors import InfinigenError
from infinigen.runtime import POLICIES, StepGraph, cache_argument, cache_for
from infinigen.runtime.generation import prefill


def prompts_batch(device, lengths=(9, 23, 16), seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return padded_batch([torch.randint(3, 512, (n,), generator=generator).tolist() for n in lengths], 1, device)


def decoded(model, inputs, cache, new_tokens: int = 12, **kwargs) -> torch.Tensor:
    out = model.generate(
        **inputs,
        max_new_tokens=new_tokens,
        pad_token_id=1,
        custom_generate=infinigen.decode,
        **{cache_argument(model): cache},
        **kwargs,
    )
    return out[:, inputs["input_ids"].shape[1] :]


@pytest.mark.parametrize("block_tokens", [1024, 8])  # 8: the buffers grow every few steps
@pytest.mark.parametrize("policy", [*EXACT_POLICIES, "dense"])
@pytest.mark.parametrize("arch", ["opt", "llama", "gemma3"])
def test_decode_at_full_budget_is_exact(tokenizer, arch, policy, block_tokens, device):
    model, artifact = tiny_setup(tokenizer, arch, device)
    inputs = prompts_batch(device)
    expected = greedy(model, inputs, DynamicCache(), new_tokens=20)
    cache = cache_for(model, artifact, policy=policy, block_tokens=block_tokens, **EXACT)
    assert torch.equal(decoded(model, inputs, cache, new_tokens=20, do_sample=False), expected)


@pytest.mark.parametrize(("policy", "alpha"), [(policy, None) for policy in sorted(POLICIES)] + [("infinigen", 2.0)])
def test_decode_equals_generate_for_every_policy(tokenizer, policy, alpha, device):
    """Lossy settings too: the loop (and on CUDA its graphs) changes nothing but the launches,
    so tokens and the fetch statistics are those of transformers' loop. Also with a finite alpha,
    whose count a score's last bit can change (under tensor parallelism in float32 the two loops
    have departed: this tells whether one GPU does too)."""
    model, artifact = tiny_setup(tokenizer, "llama", device)
    inputs = prompts_batch(device, seed=3)
    settings = dict(policy=policy, budget=0.3, block_tokens=16, min_tokens=2)
    if alpha is not None:
        settings["alpha"] = alpha
    plain_cache, decode_cache = (cache_for(model, artifact, **settings) for _ in range(2))
    expected = greedy(model, inputs, plain_cache, new_tokens=24)
    assert torch.equal(decoded(model, inputs, decode_cache, new_tokens=24, do_sample=False), expected)
    if policy != "dense":
        plain, loop = plain_cache.summary(), decode_cache.summary()
        assert loop["fraction_fetched"] == plain["fraction_fetched"] > 0
        assert loop["bytes_host_to_device"] == plain["bytes_host_to_device"]
        assert loop["bytes_device_to_host"] == plain["bytes_device_to_host"]


@pytest.mark.parametrize("policy", ["infinigen", "h2o"])
def test_decode_with_row_reuse_matches_generate(tokenizer, policy, device):
    """Row reuse through the decoding loop (on CUDA: captured steps, across buffer growth every 16
    tokens), the selection alone attended (resident_extra 0): the tokens of transformers' loop without
    reuse, the same rows selected and attended, fewer moved."""
    model, artifact = tiny_setup(tokenizer, "llama", device)
    inputs = prompts_batch(device, seed=5)
    settings = dict(policy=policy, budget=0.3, block_tokens=16, min_tokens=2)
    plain_cache, reuse_cache = (
        cache_for(model, artifact, **settings, reuse_rows="off"),  # on CUDA "auto" would reuse too
        cache_for(model, artifact, **settings, reuse_rows="on", resident_extra=0.0),  # by default 2
    )
    expected = greedy(model, inputs, plain_cache, new_tokens=24)
    assert torch.equal(decoded(model, inputs, reuse_cache, new_tokens=24, do_sample=False), expected)
    plain, reusing = plain_cache.summary(), reuse_cache.summary()
    assert reusing["resident_extra"] == 0.0
    for name in ("fraction_fetched", "fraction_attended"):
        assert reusing[name] == pytest.approx(plain[name], abs=1e-4)
    assert reusing["fraction_moved"] < reusing["fraction_fetched"]
    assert 0 < reusing["bytes_host_to_device"] < plain["bytes_host_to_device"]


def test_decode_with_a_limited_pool_matches_generate(tokenizer, device):
    """A full pool evicts on the host: those steps run eagerly, with the same result."""
    model, artifact = tiny_setup(tokenizer, "llama", device)
    inputs = prompts_batch(device, lengths=(20, 20), seed=4)
    spec = cache_for(model, artifact).spec
    row_bytes = 2 * spec.head_dim * model.dtype.itemsize
    gb = (24 * (spec.n_layers - 2) * 2 * spec.n_kv_heads * row_bytes + 0.5) / 1e9  # 24 tokens per sequence
    settings = dict(budget=0.5, cpu_pool_gb=gb, block_tokens=8, kv_bits=16)  # 16-bit rows: the pool sized above
    plain_cache, decode_cache = (cache_for(model, artifact, **settings) for _ in range(2))
    expected = greedy(model, inputs, plain_cache, new_tokens=12)
    assert torch.equal(decoded(model, inputs, decode_cache, do_sample=False), expected)
    assert decode_cache.summary()["evicted_tokens"] == plain_cache.summary()["evicted_tokens"] > 0


def test_decode_chunked_prefill_and_one_token(tokenizer, device):
    model, artifact = tiny_setup(tokenizer, "llama", device)
    inputs = prompts_batch(device, lengths=(9, 23))
    expected = greedy(model, inputs, DynamicCache(), new_tokens=12)
    chunked = decoded(model, inputs, cache_for(model, artifact, **EXACT), do_sample=False, prefill_chunk_size=8)
    assert torch.equal(chunked, expected)
    one = decoded(model, inputs, cache_for(model, artifact), new_tokens=1, do_sample=False)
    assert torch.equal(one, expected[:, :1])


def test_decode_samples_as_generate_does(tokenizer, device):
    model, artifact = tiny_setup(tokenizer, "qwen2", device)
    inputs = prompts_batch(device, lengths=(16, 16), seed=2)
    samples = []
    for use_decode in (False, True):
        torch.manual_seed(0)
        cache = cache_for(model, artifact, **EXACT)
        kwargs = dict(do_sample=True, top_k=50, pad_token_id=1, max_new_tokens=10, **{cache_argument(model): cache})
        if use_decode:
            kwargs["custom_generate"] = infinigen.decode
        samples.append(model.generate(**inputs, **kwargs))
    assert torch.equal(samples[0], samples[1])


def test_decode_streams_and_stops_at_eos(tokenizer, device, capsys):
    model, artifact = tiny_setup(tokenizer, "llama", device)
    inputs = prompts_batch(device, lengths=(12,))
    free = decoded(model, inputs, cache_for(model, artifact), new_tokens=8, do_sample=False)
    eos = int(free[0, 3])
    stopped = decoded(
        model,
        inputs,
        cache_for(model, artifact),
        new_tokens=8,
        do_sample=False,
        eos_token_id=eos,
        decode_streamer=TextStreamer(tokenizer, skip_prompt=True),
    )
    assert torch.equal(stopped[0], free[0, : int((free[0] == eos).nonzero()[0]) + 1])
    assert capsys.readouterr().out.split() == tokenizer.decode(stopped[0]).split()


def test_lazy_names_are_not_shadowed_by_submodules():
    """``infinigen.decode`` stays the function once the modules behind the lazy names are imported
    (a submodule named ``decode`` would replace it: generate ignores a module as custom_generate)."""
    modules = {name: importlib.import_module(path) for name, path in runtime._LAZY.items()}
    for name, module in modules.items():
        assert getattr(runtime, name) is getattr(module, name), name
    assert infinigen.decode is modules["decode"].decode and callable(infinigen.decode)


def test_decode_needs_an_infinigen_cache(tokenizer):
    model, _ = tiny_setup(tokenizer, "llama", "cpu")
    with pytest.raises(InfinigenError, match="needs an InfinigenCache"):
        decoded(model, prompts_batch("cpu"), DynamicCache(), do_sample=False)


@pytest.mark.parametrize(
    ("policy", "reuse_rows", "kv_bits"),
    [
        ("infinigen", False, 16),
        ("dense", False, 16),  # no selection stream forked: the capture must not join it
        ("full", False, 16),
        ("quest", False, 16),
        ("int4", False, 16),
        ("infinigen", True, 16),
        ("quest", True, 16),
        ("full", False, 8),
        ("infinigen", True, 8),
    ],
)
@torch.no_grad()
def test_step_graph_replays_the_eager_step_exactly(tokenizer, policy, reuse_rows, kv_bits, device):
    """On CUDA, steps are captured and replayed (across pool growth: 8-token blocks); the logits equal
    those of the same steps run eagerly (graphs off), bit for bit; with 8-bit rows too (quantised
    as captured writes, dequantised by the captured gather)."""
    if device != "cuda":
        pytest.skip("CUDA graphs need CUDA")
    model, artifact = tiny_setup(tokenizer, "llama", device)
    inputs = prompts_batch(device)
    runs = []
    for graphs in (False, True):
        settings = dict(policy=policy, budget=0.3, block_tokens=8, cuda_graphs=graphs, reuse_rows=reuse_rows)
        settings["kv_bits"] = kv_bits
        cache = cache_for(model, artifact, **settings)
        logits = prefill(model, cache, inputs["input_ids"], inputs["attention_mask"])
        step, position = StepGraph(model, cache), inputs["attention_mask"].sum(-1, keepdim=True) - 1
        steps, replays = [], 0
        for _ in range(20):
            position = position + 1
            logits = step(logits.argmax(-1, keepdim=True), position).clone()
            steps.append(logits)
            replays += step.graph is not None
        runs.append((torch.stack(steps), replays))
    (eager, eager_replays), (graphed, graphed_replays) = runs
    assert eager_replays == 0 and graphed_replays >= 10
    assert torch.equal(graphed, eager)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_capture_first_returns_idle_cached_memory_when_the_device_runs_short():
    from infinigen.runtime.cache.graphs import make_room

    device = torch.device("cuda")
    torch.cuda.empty_cache()
    assert not make_room(device)  # nothing idle in the allocator's cache
    free = torch.cuda.mem_get_info(device)[0]
    block = torch.empty(int(free * 0.6), dtype=torch.uint8, device=device)
    del block  # 60% of what was free is now cached and idle, 40% free: a capture could not use it
    assert make_room(device)
    assert torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) < free * 0.1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_capture_that_runs_out_of_memory_says_so_and_leaves_the_stream_usable():
    """An out-of-memory inside a capture reaches the caller as one (the batch runner reruns such a batch
    in halves), not as the capture's own "unjoined work" error; the stream then runs work again."""
    from infinigen.runtime.cache.graphs import capture

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.ones(4, device="cuda").sum()  # the stream's lazy initialisation, outside the capture

    def runs_out() -> torch.Tensor:
        torch.ones(4, device="cuda").add_(1)
        raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")

    with pytest.raises(torch.OutOfMemoryError, match="raised by the test"):
        capture(runs_out, stream)
    graph, out = capture(lambda: torch.ones(4, device="cuda") * 2, stream)
    graph.replay()
    assert torch.equal(out, torch.full((4,), 2.0, device="cuda"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("policy", ["infinigen", "dense"])
def test_a_finished_cache_leaves_no_gpu_memory_behind(tokenizer, policy):
    """Decoding with a fresh cache, again and again in one process (a bench sweep, an evaluation),
    must not hold more GPU memory each time: the caches share the process's side streams (a new
    stream that multiplies matrices gets a cuBLAS workspace that lives as long as the process)."""
    import gc

    model, artifact = tiny_setup(tokenizer, "llama", "cuda")
    inputs = prompts_batch("cuda")

    def decode_once() -> int:
        decoded(model, inputs, cache_for(model, artifact, policy=policy, budget=0.3, block_tokens=8))
        gc.collect()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    decode_once()  # the process's first use: its streams, workspaces and kernels
    held = decode_once()
    assert [decode_once() - held for _ in range(3)] == [0, 0, 0]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_replayed_step_times_its_waits_for_rows(tokenizer):
    """The compute stream's waits for fetched rows are timed inside the captured step too: the
    summary gives the last replay's (what `bench` reports as wait ms per step)."""
    model, artifact = tiny_setup(tokenizer, "llama", "cuda")
    cache = cache_for(model, artifact, budget=0.3, block_tokens=1024)
    decoded(model, prompts_batch("cuda"), cache)
    summary = cache.summary()
    assert summary["replayed_steps"] > 0 and cache.step_wait_events
    assert 0 <= summary["last_replay_wait_ms"] < 1e3
