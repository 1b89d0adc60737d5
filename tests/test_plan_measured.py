"""The memory plan against what CUDA measures: peaks within the plan's (bench's decoding, exact decoding, a
padded batch) and caches that give their memory back (CUDA tests; skipped without a GPU)."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import llama_config
from transformers import AutoModelForCausalLM

from infinigen.runtime.config import RuntimeConfig
from infinigen.runtime.memory import plan as memory

BF16 = torch.bfloat16

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@CUDA
def test_a_hundred_caches_give_their_memory_back(tokenizer):
    """A server's or an eval loop's hundredth cache runs where the first did: after ``close()`` the
    device holds what it held before (the side streams' workspaces, made by the first, aside)."""
    from helpers import tiny_setup

    from infinigen.runtime import cache_argument, cache_for, decode

    model, artifact = tiny_setup(tokenizer, "llama", "cuda")
    ids = torch.randint(3, 512, (2, 200), generator=torch.Generator().manual_seed(0)).cuda()
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 1, "custom_generate": decode}

    def one() -> None:
        with cache_for(model, artifact, budget=0.2) as cache:
            model.generate(ids, **{cache_argument(model): cache}, prefill_chunk_size=64, **kwargs)

    one()
    gc.collect()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    for _ in range(100):
        one()
    gc.collect()  # a cache's reference cycles go with it
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == held


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("policy", ["dense", "full", "infinigen"])
def test_measured_peak_within_the_plan(policy):
    """A 0.6 GB model at 2 x 16K, prefilled in chunks of 4,096 and decoded as ``bench`` does: the measured
    peak is within 10% of the plan's (the 8B shape's are: BENCHMARKS.md, "A small GPU")."""
    from infinigen.bench.runs import BenchCase, Decoder, make_cache
    from infinigen.bench.shapes import random_artifact

    config = llama_config(hidden=1024, layers=8, heads=8, kv_heads=4, mlp=4096, vocab=32000, positions=32768)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=BF16).eval()
    artifact = random_artifact(model, "test", 0.5) if policy == "infinigen" else None
    case = BenchCase(
        policy, 2, 16384, gen_len=8, runtime={"reuse_rows": "on"} if policy == "infinigen" else {}, prefill_chunk=4096
    )
    planned = memory.plan(memory.model_of(config, BF16), BF16, memory.Workload(2, 16384, 11, 4096), case.config)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        decoder = Decoder(model, make_cache(model, artifact, case), case)
        decoder.prefill_seconds()
        decoder.step_seconds()
    measured = max(decoder.warmup_peak, torch.cuda.max_memory_allocated())
    assert abs(planned.peak_gpu / measured - 1) <= 0.10, (planned.peak_gpu, measured)


@pytest.mark.cuda
@CUDA
def test_exact_decoding_peaks_within_the_plan():
    """The same model at 2 x 16K decoding exactly (a verification over every row every 4 drafts): the
    measured peak within 10% of the plan's, as the other runs' are (on an H200, 2026-12-03: 5.3% above it,
    with the verification counted in decoding's workspace, below the prefill's)."""
    import infinigen
    from infinigen.bench.shapes import random_artifact
    from infinigen.runtime import cache_argument

    config = llama_config(hidden=1024, layers=8, heads=8, kv_heads=4, mlp=4096, vocab=32000, positions=32768)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=BF16).eval()
    artifact = random_artifact(model, "test", 0.5)
    ids = torch.randint(1, 32000, (2, 16384), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    settings = RuntimeConfig(exact=True, kv_bits=16)
    planned = memory.plan(memory.model_of(config, BF16), BF16, memory.Workload(2, 16384, 16, 4096), settings)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with infinigen.cache_for(model, artifact, exact=True, kv_bits=16) as cache, torch.no_grad():
        kwargs = {cache_argument(model): cache, "custom_generate": infinigen.decode, "prefill_chunk_size": 4096}
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16, **kwargs)
        assert cache.verified.verifications > 0
    measured = torch.cuda.max_memory_allocated()  # the weights too, as the plan counts them
    assert abs(planned.peak_gpu / measured - 1) <= 0.10, (planned.peak_gpu, measured)


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("policy", ["full", "infinigen"])
def test_a_padded_batch_peaks_within_the_plan(tokenizer, policy):
    """A batch job's batch: many rows of different lengths, left-padded, so every prefill attention takes a mask (a bias
    per query and key) and the prefill's workspace, not the KV, sets the peak. The measured peak never exceeds the
    plan (a batch of 256 SmolLM2 prompts the plan had admitted once ran out of memory), and the plan is within 25% of
    it."""
    from infinigen.bench.shapes import random_artifact
    from infinigen.runtime import cache_for
    from infinigen.runtime.text import generate_ids

    config = llama_config(hidden=576, layers=6, heads=9, kv_heads=3, mlp=1536, vocab=4096, positions=8192)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float16).eval()
    artifact = random_artifact(model, "test", 0.5) if policy == "infinigen" else None
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(2000, 4000, (48,), generator=generator).tolist()
    prompts = [torch.randint(3, 4096, (n,), generator=generator).tolist() for n in lengths]
    work = memory.Workload(len(prompts), max(lengths), 4, 1024, padded=True)
    planned = memory.plan(memory.model_of(config, torch.float16), torch.float16, work, RuntimeConfig(policy=policy))
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    with cache_for(model, artifact, **memory.cache_settings(planned)) as cache:
        generate_ids(model, tokenizer, prompts, cache, max_new_tokens=4, prefill_chunk=1024)
    measured = torch.cuda.max_memory_allocated()
    assert measured <= planned.peak_gpu <= 1.25 * measured, (planned.peak_gpu, measured)


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("policy", ["full", "infinigen"])
def test_a_kept_prompts_warm_run_peaks_within_its_plan(policy):
    """A question about a kept 16K document (a server's second question): restoring the kept prompt's GPU parts
    (the dense layers' KV, the partial keys) and prefilling only the question never exceed the plan the run was
    admitted with, which the cold run that kept it measured within 10% of."""
    import infinigen
    from infinigen.bench.shapes import random_artifact
    from infinigen.runtime import cache_argument

    config = llama_config(hidden=1024, layers=8, heads=8, kv_heads=4, mlp=4096, vocab=32000, positions=32768)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=BF16).eval()
    artifact = random_artifact(model, "test", 0.5) if policy == "infinigen" else None
    generator = torch.Generator().manual_seed(0)
    document = torch.randint(1, 32000, (1, 16384), generator=generator)
    prompts = infinigen.PromptCache()

    def run(question: torch.Tensor) -> tuple[int, int, int]:
        ids = torch.cat([document, question], dim=1).cuda()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        with infinigen.cache_for(model, artifact, prompts=prompts, policy=policy) as cache, torch.no_grad():
            kwargs = {cache_argument(model): cache, "custom_generate": infinigen.decode, "prefill_chunk_size": 4096}
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8, **kwargs)
            return cache.reused_tokens, cache.memory_plan.peak_gpu, torch.cuda.max_memory_allocated()

    cached, planned, measured = run(torch.randint(1, 32000, (1, 64), generator=generator))
    assert cached == 0 and abs(planned / measured - 1) <= 0.10, (planned, measured)
    cached, planned, measured = run(torch.randint(1, 32000, (1, 64), generator=generator))
    assert cached == 16384 and measured <= planned, (planned, measured)
