"""Multi-token steps after the first (transformers' chunked prefill): later chunks read the cached rows
back from the pool a block at a time (``KVPool.read_rows``) and attend over them block by block."""

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
    """A later chunk reads the earlier ones as block copies (``KVPool.read_rows``), in blocks smaller than
    the past: the same logits as through the row gather of the same slots, for rows a codec compresses
    and for 8-bit rows."""
    model, artifact = tiny_setup(tokenizer, "llama", device)
    prompts = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(3)).tolist() for n in (13, 23)]
    inputs = padded_batch(prompts, pad=1, device=device)

    def generated() -> torch.Tensor:  # every step's logits (steps, B, vocab)
        cache = cache_for(model, artifact, policy=policy, prefill_block_tokens=5, **settings)
        kwargs = {cache_argument(model): cache, "prefill_chunk_size": 8, "pad_token_id": 1}
        out = model.generate(
            **inputs, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs
        )
        return torch.stack(out.logits)

    by_blocks = generated()
    reads = []

    def gathered(pool, lo, hi, staged, dtype, out=None):
        reads.append((lo, hi))
        rows = torch.empty(*staged.shape[:2], 2, hi - lo, staged.shape[-1], dtype=dtype, device=staged.device)
        pool.gather(torch.arange(lo, hi, device=rows.device).expand(*rows.shape[:2], hi - lo), None, rows)
        return rows.transpose(2, 3) if out is None else out.copy_(rows.transpose(2, 3))

    monkeypatch.setattr(KVPool, "read_rows", gathered)
    assert torch.equal(generated(), by_blocks), "the same logits"
    assert (0, 5) in reads and (5, 8) in reads and (15, 16) in reads, "the chunks read the pool 5 slots at a time"


@pytest.mark.parametrize("policy,settings", [("full", {}), ("infinigen", {"kv_bits": 8}), ("int4", {})])
def test_a_later_chunk_attends_to_blocks_fetched_during_the_layer_before(
    tokenizer, policy, settings, device, monkeypatch
):
    """Once a layer's own block copies are queued, the next offloaded layer's earlier blocks are: that layer
    attends over them instead of staging its own, with the same logits as without fetching ahead. Only a
    layer after an offloaded one is fetched for, once per later chunk, into one region a chunk reuses."""
    from infinigen.runtime.cache import attention

    model, artifact = tiny_setup(tokenizer, "llama", device)
    prompts = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(5)).tolist() for n in (13, 23)]
    inputs = padded_batch(prompts, pad=1, device=device)
    fetched, staged = [], []  # (layer, end) of each layer's blocks fetched ahead / staged as it attends

    regions = []  # each fetch's region: its memory

    def recorded(calls: list, read):
        return lambda cache, layer, end, *rest: calls.append((layer.index, end)) or read(cache, layer, end, *rest)

    def into_regions(*args):
        blocks, region = fetch_ahead(*args)
        regions.append(region.data_ptr())
        return blocks, region

    fetch_ahead = recorded(fetched, attention.fetch_ahead)
    monkeypatch.setattr(attention, "FEW_QUERIES", 0)  # the blocks as staged ones are (spans: the test below)
    monkeypatch.setattr(attention, "fetch_ahead", into_regions)
    monkeypatch.setattr(attention, "_staged", recorded(staged, attention._staged))

    def generated(ahead: bool) -> tuple[torch.Tensor, list[int]]:  # every step's logits, the offloaded layers
        options = {"prefill_block_tokens": 5, "prefill_fetch_ahead": ahead, "dense_layers": 0, **settings}
        cache = cache_for(model, artifact, policy=policy, **options)
        kwargs = {cache_argument(model): cache, "prefill_chunk_size": 8, "pad_token_id": 1}
        out = model.generate(
            **inputs, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs
        )
        offloaded = [layer.index for layer in cache.layers if hasattr(layer, "pool")]
        return torch.stack(out.logits), offloaded

    behind, offloaded = generated(False)
    assert not fetched and staged == [(i, end) for end in (8, 16) for i in offloaded]
    staged.clear()
    ahead, _ = generated(True)
    assert torch.equal(ahead, behind), "the same logits"
    assert staged == [(offloaded[0], 8), (offloaded[0], 16)] and len(offloaded) > 1
    assert fetched == [(i, end) for end in (8, 16) for i in offloaded[1:]] and len(offloaded) == 3
    assert regions[0] == regions[1] and regions[2] == regions[3], "one region per chunk"


@pytest.mark.cuda
def test_blocks_fetched_ahead_keep_the_scales_they_were_queued_with(tokenizer, monkeypatch):
    """8-bit blocks fetched ahead are dequantised on the transfer stream with the pool's scales, which the
    layer's own store of the chunk then grows (a new tensor: 8-token pool blocks, 8-token chunks). Held
    back (a sleep queued before each fetch), the copies still read the scales they were queued with,
    whose memory served nothing else meanwhile: the same logits as without fetching ahead."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from infinigen.runtime.cache import attention

    model, artifact = tiny_setup(tokenizer, "llama", "cuda")
    ids = torch.randint(3, 512, (1, 64), generator=torch.Generator().manual_seed(6)).cuda()
    fetch_ahead = attention.fetch_ahead

    def held_back(cache, *args):
        with torch.cuda.stream(cache.stream):
            torch.cuda._sleep(20_000_000)  # ~10 ms of the transfer stream's time
        return fetch_ahead(cache, *args)

    def generated(ahead: bool) -> torch.Tensor:
        options = dict(kv_bits=8, block_tokens=8, prefill_block_tokens=8, prefill_fetch_ahead=ahead, dense_layers=0)
        cache = cache_for(model, artifact, policy="infinigen", **options)
        kwargs = {cache_argument(model): cache, "prefill_chunk_size": 8, "pad_token_id": 1}
        out = model.generate(
            input_ids=ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs
        )
        return torch.stack(out.logits)

    monkeypatch.setattr(attention, "FEW_QUERIES", 0)  # each block attended apart, as staged blocks are
    behind = generated(False)
    monkeypatch.setattr(attention, "fetch_ahead", held_back)
    assert torch.equal(generated(True), behind), "the same logits"


def test_later_chunks_mask_only_the_blocks_that_hold_padding(tokenizer, device, monkeypatch):
    """A left-padded batch (prompts of 13 and 23 tokens: 10 padding keys) in 8-token chunks, read back 5
    rows a block: the blocks before the padding's end carry the mask, the rest none (the flash kernel on
    CUDA), with the same tokens as dense."""
    from infinigen.runtime.cache import attention
    from infinigen.runtime.kernels import chunk_attention

    model, artifact = tiny_setup(tokenizer, "llama", device)
    prompts = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(4)).tolist() for n in (13, 23)]
    inputs = padded_batch(prompts, pad=1, device=device)
    expected = greedy(model, inputs, DynamicCache())
    masked = []  # per block read by a later chunk: (its keys, whether it carries a mask, causal)
    block_attention = chunk_attention.block_attention

    def recorded(query, keys, values, allowed, scale, causal=False):
        masked.append((keys.shape[2], allowed is not None, causal))
        return block_attention(query, keys, values, allowed, scale, causal)

    monkeypatch.setattr(chunk_attention, "block_attention", recorded)
    monkeypatch.setattr(attention, "FEW_QUERIES", 0)  # every block apart (spans: the test below)
    cache = cache_for(model, artifact, policy="full", prefill_block_tokens=5, **EXACT)
    out = model.generate(
        **inputs,
        max_new_tokens=4,
        do_sample=False,
        pad_token_id=1,
        prefill_chunk_size=8,
        **{cache_argument(model): cache},
    )
    assert torch.equal(out[:, inputs["input_ids"].shape[1] :], expected[:, :4])
    layers = len(cache.layers)  # dense layers read their buffer in the same blocks
    # chunk 2 (past 8): blocks 0-5, 5-8 masked, its own (8-16, padding to 10) masked;
    # chunk 3 (past 16): 0-5, 5-10 masked, 10-15, 15-16 and its own (16-23) not
    second = [(5, True, False), (3, True, False), (8, True, True)]
    third = [(5, True, False), (5, True, False), (5, False, False), (1, False, False), (7, False, True)]
    assert masked == second * layers + third * layers


@pytest.mark.parametrize("policy", ["full", "infinigen"])
def test_a_forward_of_a_few_tokens_attends_the_keys_after_the_padding_in_one_span(
    tokenizer, policy, device, monkeypatch
):
    """Exact decoding's verification, and any chunk of at most ``FEW_QUERIES`` tokens: where a layer's earlier
    keys lie on the GPU together (a dense layer's buffer, blocks fetched ahead), those after the padding are
    attended at once; staged blocks are attended as they come. Logits as with every block apart, to rounding."""
    from infinigen.runtime.cache import attention
    from infinigen.runtime.kernels import chunk_attention

    model, artifact = tiny_setup(tokenizer, "llama", device)
    prompts = [torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(4)).tolist() for n in (13, 23)]
    inputs = padded_batch(prompts, pad=1, device=device)
    block_attention, blocks = chunk_attention.block_attention, []

    def recorded(query, keys, values, allowed, scale, causal=False):
        blocks.append((keys.shape[2], allowed is not None, causal))
        return block_attention(query, keys, values, allowed, scale, causal)

    monkeypatch.setattr(chunk_attention, "block_attention", recorded)

    def generated() -> tuple[torch.Tensor, list[str], list]:
        blocks.clear()
        cache = cache_for(model, artifact, policy=policy, prefill_block_tokens=5, min_tokens=2, **EXACT)
        kwargs = {cache_argument(model): cache, "prefill_chunk_size": 8, "pad_token_id": 1}
        out = model.generate(
            **inputs, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs
        )
        kinds = ["staged" if i == cache.config.dense_layers else "together" for i in range(len(cache.layers))]
        return torch.stack(out.logits), kinds, list(blocks)

    logits, kinds, spans = generated()
    monkeypatch.setattr(attention, "FEW_QUERIES", 0)
    apart, _, _ = generated()
    assert torch.allclose(logits, apart, atol=1e-5, rtol=0)
    # chunk 3 (past 16, padding to 10): 0-5, 5-10 masked, then 10-16 at once where together
    third = {"staged": [(5, True, False), (5, True, False), (5, False, False), (1, False, False), (7, False, True)]}
    third["together"] = [(5, True, False), (5, True, False), (6, False, False), (7, False, True)]
    second = [(5, True, False), (3, True, False), (8, True, True)]  # chunk 2 (past 8): masked throughout
    assert spans == second * len(kinds) + [block for kind in kinds for block in third[kind]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_attention_merges_to_sdpa(device, dtype):
    """A chunk's attention over blocks of keys (grouped heads, a masked key, a causal last block), merged
    by log-sum-exp, equals SDPA over all of them; a query that may read no key gives 0, and one that may
    read no key of a block still reads the others (a left-padded row's first block). On CUDA, bf16 blocks
    without a mask run the flash kernel, masked ones the efficient kernel."""
    from torch.nn import functional as F

    from infinigen.runtime.kernels.chunk_attention import merged_attention

    torch.manual_seed(0)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    query = torch.randn(2, 4, 6, 16, device=device, dtype=dtype)
    keys, values = (torch.randn(2, 2, 15, 16, device=device, dtype=dtype) for _ in range(2))
    allowed = torch.ones(2, 1, 6, 15, dtype=torch.bool, device=device).tril(diagonal=9)
    allowed[1, :, :, 3] = False  # a padding key of row 1
    allowed[0, :, 0] = False  # a query of row 0 that reads nothing
    allowed[1, :, 2, :4] = False  # one of row 1 that reads nothing of the first block (padding), then keys
    expected = F.scaled_dot_product_attention(
        query, keys.repeat_interleave(2, 1), values.repeat_interleave(2, 1), attn_mask=allowed, scale=0.3
    ).transpose(1, 2)
    spans = [(0, 4), (4, 9), (9, 15)]
    blocks = [(keys[:, :, a:b], values[:, :, a:b], allowed[..., a:b], False) for a, b in spans]
    got = merged_attention(query, blocks, 0.3)
    assert torch.allclose(got[:, 1:], expected[:, 1:], atol=atol) and torch.allclose(got[1], expected[1], atol=atol)
    assert torch.equal(got[0, 0], torch.zeros_like(got[0, 0]))
    causal = [(keys[:, :, :9], values[:, :, :9], None, False), (keys[:, :, 9:], values[:, :, 9:], None, True)]
    expected = F.scaled_dot_product_attention(
        query, keys.repeat_interleave(2, 1), values.repeat_interleave(2, 1), attn_mask=allowed.new_ones(6, 15).tril(9)
    )
    assert torch.allclose(merged_attention(query, causal, 0.25), expected.transpose(1, 2), atol=atol)


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
