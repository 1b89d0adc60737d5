"""Multi-token steps after the first (transformers' chunked prefill): later chunks read every cached
row back from the pool (``KVPool.read_range``) and attend densely over it."""

from __future__ import annotations

import pytest
import torch
from helpers import EXACT, greedy, padded_batch, tiny_setup
from transformers import DynamicCache

from infinigen.runtime import cache_argument, cache_for
from infinigen.runtime.memory.pool import KVPool


@pytest.mark.parametrize("policy", ["full", "infinigen"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_chunked_prefill_is_exact(tokenizer, arch, policy, device):
    """transformers' chunked prefill: later chunks attend over the pool's rows (and Gemma 3's sliding
    layers over the last window's, 8-token chunks of a 23-token prompt); same tokens as dense."""
    model, artifact = tiny_setup(tokenizer, arch, device)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (9, 23)]
    inputs = padded_batch(prompts, pad=1, device=device)
    expected = greedy(model, inputs, DynamicCache())
    name = cache_argument(model)
    cache = cache_for(model, artifact, policy=policy, **EXACT)
    out = model.generate(
        **inputs, max_new_tokens=12, do_sample=False, pad_token_id=1, prefill_chunk_size=8, **{name: cache}
    )
    assert torch.equal(out[:, inputs["input_ids"].shape[1] :], expected)


@pytest.mark.parametrize("policy,settings", [("int4", {}), ("infinigen", {"kv_bits": 8})])
def test_chunked_prefill_reads_rows_as_the_gather_would(tokenizer, policy, settings, device, monkeypatch):
    """A later chunk reads the earlier ones as block copies (``KVPool.read_range``): the same logits as
    through the row gather of every slot, for rows a codec compresses and for 8-bit rows."""
    model, artifact = tiny_setup(tokenizer, "llama", device)
    prompts = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(3)).tolist() for n in (13, 23)]
    inputs = padded_batch(prompts, pad=1, device=device)

    def generated() -> torch.Tensor:  # every step's logits (steps, B, vocab)
        cache = cache_for(model, artifact, policy=policy, **settings)
        kwargs = {cache_argument(model): cache, "prefill_chunk_size": 8, "pad_token_id": 1}
        out = model.generate(
            **inputs, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs
        )
        return torch.stack(out.logits)

    by_blocks = generated()
    reads = []

    def gathered(pool, end, out):
        reads.append(end)
        pool.gather(torch.arange(end, device=out.device).expand(*out.shape[:2], end), None, out)

    monkeypatch.setattr(KVPool, "read_range", gathered)
    assert torch.equal(generated(), by_blocks) and reads, "the same logits; the chunks read the pool"


def test_prefill_chunks_count_in_bytes_not_in_the_fraction_fetched(tokenizer, device):
    """A later prefill chunk re-reads every cached row (a multi-token step attends densely): those
    bytes are moved and counted, but the fraction fetched is that of the decode steps alone."""
    model, artifact = tiny_setup(tokenizer, "llama", device)
    ids = torch.randint(3, 512, (2, 40), generator=torch.Generator().manual_seed(2)).to(device)
    prompt, name = 32, cache_argument(model)
    summaries = []
    for chunk in (prompt, 8):
        cache = cache_for(model, artifact, policy="oracle", budget=0.25, allocation="uniform", reuse_rows="off")
        with torch.no_grad():
            for start in range(0, prompt, chunk):
                model(ids[:, start : start + chunk], **{name: cache})
            for t in range(prompt, ids.shape[1]):
                model(ids[:, t : t + 1], **{name: cache})
        summaries.append(cache.summary())
    whole, chunked = summaries
    assert chunked["fraction_fetched"] == whole["fraction_fetched"] == pytest.approx(0.25, abs=0.05)
    layers, kv_heads = len(cache.offloaded), model.config.num_key_value_heads
    reread = (8 + 16 + 24) * 2 * kv_heads * layers  # chunks 2-4 re-read 8, 16, 24 tokens of 2 rows
    row_bytes = cache.offloaded[0].pool.row_bytes
    assert chunked["bytes_host_to_device"] - whole["bytes_host_to_device"] == reread * row_bytes
