"""The attention function of a forward with an ``InfinigenCache``, registered with transformers as
``ATTENTION`` (``AttentionInterface``; its masks are SDPA's, ``AttentionMaskInterface``).

A decode step attends over the rows fetched for the layer plus the current token, through their
per-head validity (``grouped_decode_attention``); multi-token steps attend densely. The cache of the
running forward reaches the function through the block's attention module (``bind``), set by the
block's hooks (``cache.hooks``) for the duration of the block.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from infinigen.runtime.cache.layers import DenseLayer, OffloadedLayer
from infinigen.runtime.kernels import chunk_attention, decode_attention
from infinigen.runtime.kernels.triton_support import on_triton

ATTENTION = "infinigen"
# SDPA backends for every attention we run: cuDNN's builds a plan per new KV length (~1 ms of host
# time per call on an H200, so once per layer and decode step).
DENSE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# A prompt's chunk builds a plan once per layer: cuDNN's kernel takes a padded batch's mask at about twice
# the efficient kernel's speed on an H200; flash stays first where no mask is needed.
PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, *DENSE_BACKENDS[1:]]
BOUND = "_infinigen_cache"  # the attribute a block's attention holds the running cache under, during the block


def grouped_decode_attention(query, keys, values, valid, scaling, need_probs: bool = False):
    """One query token over gathered rows. query (B, H, 1, d); keys/values (B, kv_heads, S, d);
    valid (B, kv_heads or 1, S). Grouped-query heads share their KV head's rows (no repeat): each KV
    head's group of queries is one short query sequence. Returns the output (B, 1, H, d), as
    transformers' attention functions do, and, if ``need_probs``, the attention probabilities
    (B, kv_heads, G, S) (else None)."""
    batch, heads, _, head_dim = query.shape
    kv_heads = keys.shape[1]
    grouped = query.view(batch, kv_heads, heads // kv_heads, head_dim)
    if not need_probs and on_triton(query.device):  # split-KV kernel
        out = decode_attention.split_decode_attention(grouped, keys, values, valid, scaling)
        return out.reshape(batch, 1, heads, head_dim), None
    if not need_probs:  # one fused kernel
        with sdpa_kernel(DENSE_BACKENDS):
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=valid[:, :, None, :], scale=scaling)
        return out.reshape(batch, 1, heads, head_dim), None
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scaling  # (B, kv_heads, G, S)
    probs = scores.masked_fill(~valid[:, :, None, :], -math.inf).softmax(dim=-1)
    out = torch.matmul(probs.to(values.dtype), values)  # (B, kv_heads, G, d)
    return out.reshape(batch, 1, heads, head_dim), probs


def attention_mass(query, keys, mask, scaling, chunk: int = 256) -> torch.Tensor:
    """Attention probability each key receives in a multi-token step, summed over the queries and each
    KV head's group. query (B, H, T, d); keys (B, kv_heads, S, d); mask (B, 1, T, S) bool, or None
    for plain causal. Returns (B, kv_heads, S) float32; queries in chunks bound the memory."""
    batch, heads, length, head_dim = query.shape
    kv_heads, total = keys.shape[1], keys.shape[2]
    grouped = query.view(batch, kv_heads, heads // kv_heads, length, head_dim)
    key_columns = keys[:, :, None].transpose(-1, -2)  # (B, kv_heads, 1, d, S)
    mass = torch.zeros(batch, kv_heads, total, dtype=torch.float32, device=query.device)
    for start in range(0, length, chunk):
        stop = min(start + chunk, length)
        scores = torch.matmul(grouped[:, :, :, start:stop], key_columns).float() * scaling  # (B, kv, G, c, S)
        if mask is not None:
            allowed = mask[:, :, None, start:stop]
        else:
            positions = torch.arange(start, stop, device=query.device) + total - length
            allowed = torch.arange(total, device=query.device) <= positions[:, None]
        probs = scores.masked_fill(~allowed, -math.inf).softmax(dim=-1).nan_to_num(0.0)  # padding rows: 0
        mass += probs.sum(dim=(2, 3))
    return mass


def dense_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, on ``DENSE_BACKENDS`` (``PREFILL_BACKENDS`` for several queries)."""
    backends = PREFILL_BACKENDS if query.shape[2] > 1 else DENSE_BACKENDS
    with sdpa_kernel(backends, set_priority=True):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def bind(attention: nn.Module, cache) -> None:
    """Give a decoder block's attention the cache of the running forward, for that block only."""
    setattr(attention, BOUND, cache)


def unbind(attention: nn.Module) -> None:
    vars(attention).pop(BOUND, None)


def bound_cache(attention: nn.Module):
    """The ``InfinigenCache`` of the running forward, while its block runs; else None."""
    return vars(attention).get(BOUND)


def infinigen_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """The attention of a forward given an ``InfinigenCache``: a decode step attends over the
    layer's fetched rows through their validity; a multi-token step densely, marking padding and
    reporting attention mass to the policies that observe it. Without a bound cache (the name set
    on a model by hand): SDPA, which the registered mask function (``sdpa_mask``) suits."""
    cache = bound_cache(module)
    if cache is None:
        return dense_attention(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    layer = cache.layers[module.layer_idx]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    offloaded = isinstance(layer, OffloadedLayer)
    observes = offloaded and layer.policy.observes_attention
    if layer.attention_valid is not None:  # a decode step: the layer's validity is the mask
        if offloaded and cache.diagnostics.decode_probe is not None:
            cache.diagnostics.decode_probe(layer, query)
        out, probs = grouped_decode_attention(query, key, value, layer.attention_valid, scale, need_probs=observes)
        if observes:
            layer.policy.attended(layer, layer.attention_slots, probs.sum(dim=2))
        return out, None
    mask = attention_mask if attention_mask is not None and attention_mask.dtype == torch.bool else None
    if mask is not None:
        layer.mark_padding(mask[:, 0, -1, -query.shape[2] :], hidden_keys(mask) > 0)
    if observes:
        layer.policy.attended(layer, None, attention_mass(query, key, mask, scale))
    past = layer.past if offloaded else key.shape[2] - query.shape[2] if isinstance(layer, DenseLayer) else 0
    if past > 0 and (mask is not None or attention_mask is None):
        blocks = _past_and_chunk(cache, layer, key, value, mask, past)
        return chunk_attention.merged_attention(query, blocks, scale), None
    return dense_attention(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def hidden_keys(mask: torch.Tensor) -> int:
    """How far into the keys a forward's mask (B, 1, T, S) hides one from some row's last query, which reads
    every real key: the padding's end (0: no key hidden). Every key after it is read by every query after it,
    so those blocks need no mask. A host sync, once a forward: every layer is given the same mask, which
    keeps the answer."""
    hidden = getattr(mask, "_infinigen_hidden", None)
    if hidden is None:
        hidden_columns = ~mask[:, 0, -1].all(dim=0)  # (S,)
        positions = torch.arange(1, hidden_columns.shape[0] + 1, device=mask.device)
        hidden = mask._infinigen_hidden = int((hidden_columns * positions).max())
    return hidden


FEW_QUERIES = 64  # a forward of at most this many tokens (exact decoding's verification) reads its keys in spans


def _past_and_chunk(cache, layer, key, value, mask, past: int) -> Iterator[chunk_attention.Block]:
    """A later prefill chunk's keys in blocks: the earlier tokens (an offloaded layer's from its pool, a
    dense layer's from its buffer), then the chunk's own, causal. Only blocks that hold a hidden key
    (padding) carry the mask: the others take the flash kernel, which takes none. A forward of a few tokens
    reads the earlier keys after the padding as one span where they lie on the GPU together: its attention
    is brief beside their copies, and a block's attention and merge cost launches a block."""
    hidden = hidden_keys(mask) if mask is not None else 0
    whole_from = hidden if key.shape[2] - (0 if isinstance(layer, OffloadedLayer) else past) <= FEW_QUERIES else None
    if isinstance(layer, OffloadedLayer):
        earlier = pool_blocks(cache, layer, past, whole_from)
        chunk_keys, chunk_values = key, value
    else:
        spans = _spans(past, cache.config.prefill_block_tokens, whole_from)
        earlier = ((key[:, :, lo:hi], value[:, :, lo:hi]) for lo, hi in spans)
        chunk_keys, chunk_values = key[:, :, past:], value[:, :, past:]
    lo = 0
    for keys, values in earlier:
        yield keys, values, mask[:, :, :, lo : lo + keys.shape[2]] if lo < hidden else None, False
        lo += keys.shape[2]
    yield chunk_keys, chunk_values, mask[:, :, :, past:] if past < hidden else None, True


def _spans(end: int, step: int, whole_from: int | None) -> Iterator[tuple[int, int]]:
    """Blocks (lo, hi) of ``step`` tokens over 0 .. end-1; with ``whole_from``, every block from the first that
    starts at or after it on as one."""
    for lo in range(0, end, step):
        if whole_from is not None and lo >= whole_from:
            yield lo, end
            return
        yield lo, min(lo + step, end)


def pool_blocks(cache, layer: OffloadedLayer, end: int, whole_from: int | None = None):
    """Keys and values (B, kv_heads, n, d) of slots 0 .. end-1, ``prefill_block_tokens`` at a time, for a
    later prefill chunk's attention (``kernels.chunk_attention``). The blocks come from the pool on the
    transfer stream: fetched ahead during the previous layer (``fetch_ahead``; with ``whole_from``, those
    from there on as one span, ``_spans``), else through two staging buffers, the next block's copy queued
    before the current one is attended. Once this layer's copies are queued, the next layer's are (where
    the plan has room for them): an attention reads its blocks far faster than the bus brings them, and the
    previous layer's MLP hides them."""
    cache.count_fetch(layer, end, step=False)
    ahead, layer.fetched_ahead, region = layer.fetched_ahead, None, None
    if ahead is not None and ahead[0] == end:
        _, blocks, region = ahead
        step = cache.config.prefill_block_tokens
        spans = _spans(end, step, whole_from)
        blocks = [
            (region[:, :, lo:hi], [ready for _, ready in blocks[lo // step : -(-hi // step)]]) for lo, hi in spans
        ]
    else:  # none, or a stale one (a forward that stopped short), let go
        blocks = ((part, [ready]) for part, ready in _staged(cache, layer, end))
    del ahead
    for part, arrivals in blocks:
        for ready in arrivals:
            if ready is not None:
                torch.cuda.current_stream(cache.device).wait_event(ready)
        rows = part.transpose(2, 3)  # (B, kv_heads, 2, n, width)
        if layer.policy.codec is not None:
            decoded = torch.empty(*rows.shape[:-1], layer.head_dim, dtype=layer.dtype, device=cache.device)
            layer.policy.codec.decode(rows, decoded)
            rows = decoded
        yield rows[:, :, 0], rows[:, :, 1]
    following = cache.layers[layer.index + 1] if layer.index + 1 < len(cache.layers) else None
    if cache.config.prefill_fetch_ahead and isinstance(following, OffloadedLayer) and following.past_ahead(end):
        following.fetched_ahead = (end, *fetch_ahead(cache, following, end, region))


def _staged(cache, layer: OffloadedLayer, end: int) -> Iterator[tuple[torch.Tensor, torch.cuda.Event | None]]:
    """Slots 0 .. end-1 a block at a time through two staging buffers (the workspace: two blocks, never the
    layer's whole KV; 8-bit rows also two of their dequantised rows), with the transfer stream's event that
    each block is in."""
    pool, tokens = layer.pool, cache.config.prefill_block_tokens
    # the step's own, freed with it (a prefill's workspace, not the decode's); the compute stream's memory, so
    # that the transfer stream allocates none (each stream's freed memory serves only that stream)
    staged = [cache.on_both_streams(pool.new_block(tokens)) for _ in (0, 1)]
    decoded = [_decoded_block(cache, layer, tokens) if pool.kv_bits == 8 else None for _ in (0, 1)]
    released: list[torch.cuda.Event | None] = [None, None]  # compute-stream events: done reading a buffer
    if cache.stream is not None:  # the buffers' memory may have served queued compute work
        cache.stream.wait_stream(torch.cuda.current_stream(cache.device))

    def copied(lo: int) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        which = (lo // tokens) % 2
        if released[which] is not None:
            cache.stream.wait_event(released[which])
        hi = min(end, lo + tokens)
        out = decoded[which][:, :, : hi - lo] if decoded[which] is not None else None
        return _read(cache, layer, lo, hi, staged[which], out)

    pending = copied(0)
    for lo in range(0, end, tokens):
        current = pending
        if lo + tokens < end:
            pending = copied(lo + tokens)
        yield current
        if cache.stream is not None:  # its attention is queued: the buffer is free once that has run
            released[(lo // tokens) % 2] = torch.cuda.current_stream(cache.device).record_event()


def fetch_ahead(cache, layer: OffloadedLayer, end: int, region: torch.Tensor | None = None):
    """Every block of slots 0 .. end-1, their copies queued now on the transfer stream, into one region
    (B, kv_heads, end, 2, width) on the GPU: the plan's ``prefill: the next layer's earlier blocks``. The
    region passes from layer to layer through a chunk: its copies follow the compute stream's work so far,
    which includes the layer before's attention over it. 8-bit rows are dequantised into it as they arrive,
    their codes through one staging block. Returns the blocks (each with its copy's event) and the region."""
    pool, tokens = layer.pool, cache.config.prefill_block_tokens
    decoded = pool.kv_bits == 8
    if region is None:  # a chunk's first; the layer before's otherwise (same rows, same past)
        region = _decoded_block(cache, layer, end) if decoded else cache.on_both_streams(pool.new_block(end))
    if cache.stream is not None:  # after the reads of the region, and of any new memory, queued so far
        cache.stream.wait_stream(torch.cuda.current_stream(cache.device))
    codes = cache.on_both_streams(pool.new_block(tokens)) if decoded else None
    blocks = []
    for lo in range(0, end, tokens):
        hi = min(end, lo + tokens)
        staged, out = (codes, region[:, :, lo:hi]) if decoded else (region[:, :, lo:hi], None)
        blocks.append(_read(cache, layer, lo, hi, staged, out))
    return blocks, region


def _decoded_block(cache, layer: OffloadedLayer, tokens: int) -> torch.Tensor:
    """An empty (B, kv_heads, tokens, 2, head_dim) of the layer's dtype: 8-bit rows dequantised."""
    pool = layer.pool
    block = torch.empty(*pool.shape[:2], tokens, 2, layer.head_dim, dtype=layer.dtype, device=cache.device)
    return cache.on_both_streams(block)


def _read(cache, layer: OffloadedLayer, lo: int, hi: int, staged: torch.Tensor, out: torch.Tensor | None = None):
    """Slots lo .. hi-1 from the pool into ``staged`` (8-bit rows dequantised into ``out`` where given), on the
    transfer stream where there is one: the rows (B, kv_heads, n, 2, width) and the event that they are in
    (None off CUDA)."""
    if cache.stream is None:
        return layer.pool.read_rows(lo, hi, staged, layer.dtype, out), None
    with torch.cuda.stream(cache.stream):
        part = layer.pool.read_rows(lo, hi, staged, layer.dtype, out)
        ready = cache.stream.record_event()
    # a block fetched ahead is dequantised after the layer's own store of the chunk may have grown (replaced) its
    # 8-bit scales (``KVPool.reserve``): their memory must serve no other tensor before then
    if layer.pool.scales is not None:
        layer.pool.scales.record_stream(cache.stream)
    return part, ready


AttentionInterface.register(ATTENTION, infinigen_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
