"""Every caller under the memory plan: a cache made from Python plans at its first prefill, takes the plan's
settings, ``infinigen.decode`` takes the plan's prefill chunk, and a forward the plan does not fit is refused
in one line before it allocates (``runtime.cache.planning``). Budgets are given (``gpu_memory_gb``) so that
the plan's choices run on the CPU as on a GPU."""

from __future__ import annotations

import pytest
import torch
from helpers import EXACT, greedy, tiny_setup
from transformers import DynamicCache

from infinigen.errors import InfinigenError
from infinigen.runtime import cache_argument, cache_for, config_from, decode
from infinigen.runtime.cache.layers import DenseLayer
from infinigen.runtime.memory import plan as memory

BATCH, CONTEXT, NEW = 4, 480, 6
# no side stream's cuBLAS workspace (graphs, a speculating policy's selection): the prefill sets the peak
PREFILL_BOUND = dict(policy="full", cuda_graphs=False, **EXACT)


def prompts(device, batch: int = BATCH, context: int = CONTEXT) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 500, (batch, context), generator=generator).to(device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def gb_between(model, settings: dict) -> tuple[float, int]:
    """A ``gpu_memory_gb`` whose budget holds the module's run with its prompt in chunks, not in one forward,
    and the chunk the plan then takes (the largest of its halvings that needs less than one forward: a
    chunk's mask and blocks of earlier keys cost more than they save at larger ones)."""
    config = config_from(settings)

    def needed(chunk: int | None) -> int:
        return memory.plan_for(model, config, memory.Workload(BATCH, CONTEXT, NEW, chunk), None).needed_gpu

    whole = needed(None)
    chunk = next(c for c in (256, 128, 64, 32) if needed(c) < whole)
    return ((whole + needed(chunk)) // 2 + memory.CONTEXT_BYTES) / 1e9, chunk


def generated(model, inputs, cache, **kwargs) -> torch.Tensor:
    kwargs = {cache_argument(model): cache, "max_new_tokens": NEW, "do_sample": False, "pad_token_id": 1} | kwargs
    with torch.no_grad():
        return model.generate(**inputs, **kwargs)[:, inputs["input_ids"].shape[1] :]


def test_decode_takes_the_plans_chunk_where_none_or_a_larger_one_is_asked(tokenizer):
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    inputs = prompts("cpu")
    gb, chunk = gb_between(model, PREFILL_BOUND)
    expected = greedy(model, inputs, DynamicCache(), new_tokens=NEW)
    for asked in (None, 1024):  # none, or more than the prompt
        cache = cache_for(model, artifact, gpu_memory_gb=gb, **PREFILL_BOUND)
        chunking = {} if asked is None else {"prefill_chunk_size": asked}
        assert torch.equal(generated(model, inputs, cache, custom_generate=decode, **chunking), expected)
        said = cache.summary()["memory_plan"]
        assert (said["prefill_chunk"], said["prefill_chunk_asked"]) == (chunk, asked)
        assert said["given_up"] == f"prefill chunk: {chunk} tokens"
    smaller = cache_for(model, artifact, gpu_memory_gb=gb, **PREFILL_BOUND)  # a smaller chunk asked is kept
    assert torch.equal(
        generated(model, inputs, smaller, custom_generate=decode, prefill_chunk_size=chunk // 2), expected
    )
    assert smaller.summary()["memory_plan"]["prefill_chunk"] == chunk // 2


def test_plain_generate_is_refused_before_its_prompt_forward_allocates(tokenizer):
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    inputs = prompts("cpu")
    gb, chunk = gb_between(model, PREFILL_BOUND)
    embedded = []
    hook = model.get_input_embeddings().register_forward_hook(lambda *args: embedded.append(1))
    try:
        cache = cache_for(model, artifact, gpu_memory_gb=gb, **PREFILL_BOUND)
        line = f"a prompt forward of {BATCH} x {CONTEXT} tokens at once does not fit"
        with pytest.raises(InfinigenError, match=line) as refused:
            generated(model, inputs, cache)
        assert "custom_generate=infinigen.decode" in str(refused.value)
        assert f"prefill_chunk_size={chunk}" in str(refused.value) and "\n" not in str(refused.value)
        assert embedded == []  # refused in the stack's pre-hook: not one layer ran
        assert not any(layer.is_initialized for layer in cache.layers)
    finally:
        hook.remove()
    # transformers' own loop with the chunk the line names runs, and gives the same tokens
    chunked = cache_for(model, artifact, gpu_memory_gb=gb, **PREFILL_BOUND)
    expected = greedy(model, inputs, DynamicCache(), new_tokens=NEW)
    assert torch.equal(generated(model, inputs, chunked, prefill_chunk_size=chunk), expected)


def test_a_cache_takes_the_plans_settings_at_its_first_prefill(tokenizer):
    """A budget that keeps one dense layer of the two asked: the cache's layers are made again before any KV
    is stored, and the tokens are still dense decoding's (budget 1.0, 16-bit rows); the settings as given stay
    readable."""
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    settings = dict(PREFILL_BOUND, dense_layers=2)
    work = memory.Workload(BATCH, CONTEXT, NEW)
    config = config_from(settings)

    def dense_kept(budget: int) -> int:
        found = memory.plan_for(model, config, work, budget)
        return found.config.dense_layers if found.fits else -1

    full = memory.plan_for(model, config, work, None).needed_gpu
    budget = next(b for b in range(full, 0, -max(1, full // 2000)) if dense_kept(b) == 1)
    cache = cache_for(model, artifact, gpu_memory_gb=(budget + memory.CONTEXT_BYTES + 1) / 1e9, **settings)
    assert sum(isinstance(layer, DenseLayer) for layer in cache.layers) == 2  # as asked, until it plans
    expected = greedy(model, prompts("cpu"), DynamicCache(), new_tokens=NEW)
    assert torch.equal(generated(model, prompts("cpu"), cache, custom_generate=decode), expected)
    assert sum(isinstance(layer, DenseLayer) for layer in cache.layers) == 1
    assert (cache.config.dense_layers, cache.asked.dense_layers) == (1, 2)
    assert "dense layers: 1" in cache.summary()["memory_plan"]["given_up"]


def test_a_run_the_plan_cannot_hold_is_refused_in_one_line_before_its_prefill(tokenizer):
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    weights = memory.loaded_model(model).weight_bytes
    cache = cache_for(model, artifact, gpu_memory_gb=(weights + memory.CONTEXT_BYTES) / 1e9)
    with pytest.raises(InfinigenError, match=rf"does not fit: {BATCH} x {CONTEXT} tokens \(\+{NEW} new\)") as refused:
        generated(model, prompts("cpu"), cache, custom_generate=decode)
    assert "\n" not in str(refused.value)
    assert not any(layer.is_initialized for layer in cache.layers)


def test_a_run_that_outgrows_its_plan_is_planned_again_or_refused(tokenizer):
    """transformers' chunked prefill shows the prompt a chunk at a time: each larger context is planned
    again with the settings that run; where the whole prompt no longer fits, the chunk that would pass the
    plan is refused in one line (``infinigen.decode`` plans the whole run first and fits it)."""
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    inputs = prompts("cpu")
    expected = greedy(model, inputs, DynamicCache(), new_tokens=NEW)
    roomy = cache_for(model, artifact, **PREFILL_BOUND, gpu_memory_gb=1000)
    assert torch.equal(generated(model, inputs, roomy, prefill_chunk_size=96), expected)
    assert roomy.memory_plan.workload.context == CONTEXT  # planned again as the chunks came
    assert roomy.memory_plan.workload.tokens >= CONTEXT + NEW  # and as the decode steps passed its length
    half = memory.Workload(BATCH, CONTEXT // 2, 0, 96)
    gb = (memory.plan_for(model, config_from(PREFILL_BOUND), half, None).needed_gpu + memory.CONTEXT_BYTES) / 1e9
    tight = cache_for(model, artifact, **PREFILL_BOUND, gpu_memory_gb=gb)
    with pytest.raises(InfinigenError, match=r"this run grew to .* past what its memory plan fits") as refused:
        generated(model, inputs, tight, prefill_chunk_size=96)
    assert "custom_generate=infinigen.decode" in str(refused.value) and "\n" not in str(refused.value)


def test_a_given_plan_is_the_caches_and_cache_for_takes_a_plan_or_settings(tokenizer):
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    work = memory.Workload(BATCH, CONTEXT, NEW, 128)
    found = memory.plan_for(model, config_from({}), work, None)
    cache = cache_for(model, artifact, plan=found)
    assert cache.memory_plan is found
    out = generated(model, prompts("cpu"), cache, custom_generate=decode, prefill_chunk_size=128)
    assert cache.memory_plan is found and out.shape == (BATCH, NEW)  # within it: not planned again
    with pytest.raises(InfinigenError, match="a plan or settings, not both"):
        cache_for(model, artifact, plan=found, budget=0.2)


@pytest.mark.cuda
def test_ten_caches_in_a_row_stay_within_their_plans_on_cuda(tokenizer):
    """The tenth request as the first: each cache plans within the device's memory as it then is, and its
    measured peak stays within its plan."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model, artifact = tiny_setup(tokenizer, "llama", "cuda")
    inputs = prompts("cuda")
    first, after = None, []
    weights = memory.loaded_model(model).weight_bytes
    for _ in range(10):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with cache_for(model, artifact) as cache:
            out = generated(model, inputs, cache, custom_generate=decode)
            found = cache.memory_plan
        # the plan counts the streams' cuBLAS workspaces, which the first run allocates for good
        assert torch.cuda.max_memory_allocated() - base <= (found.peak_gpu - weights) * 1.1
        first = out if first is None else first
        assert torch.equal(out, first)
        torch.cuda.synchronize()
        after.append(torch.cuda.memory_allocated())
    assert len(set(after[1:])) == 1  # every later cache returns the memory it took
