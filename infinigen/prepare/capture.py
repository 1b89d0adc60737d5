"""Record every layer's attention queries and keys, exactly as the attention kernel sees them.

A capturing attention function is registered through transformers' public
``AttentionInterface``; it stores q (post-RoPE, post q-norm, OPT's 1/sqrt(d) included) and k
(post-RoPE, one per KV head, before any GQA repeat) and then runs the stock SDPA attention,
so the forward pass itself is unchanged. Under tensor parallelism each rank's attention sees its own
heads: they are gathered from every rank, and each rank builds the same artifact a single process would.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from infinigen.tensor_parallel import all_heads

CAPTURE = "infinigen_capture"

# layer index -> list of (q, k) per calibration sample; q: (heads, T, d), k: (kv_heads, T, d)
_records: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] | None = None


def _capturing_attention(module, query, key, value, attention_mask, **kwargs):
    if _records is not None:  # under tensor parallelism every rank records every head: the artifact is whole
        q = all_heads(query[0].detach(), module).to("cpu", torch.float32)
        k = all_heads(key[0].detach(), module).to("cpu", torch.float32)
        _records.setdefault(module.layer_idx, []).append((q, k))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(CAPTURE, _capturing_attention)
AttentionMaskInterface.register(CAPTURE, sdpa_mask)


@contextmanager
def capture_qk(model: PreTrainedModel) -> Iterator[dict[int, list[tuple[torch.Tensor, torch.Tensor]]]]:
    """Within the block, forward passes of ``model`` (batch 1) record q/k per layer."""
    global _records
    previous = model.config._attn_implementation
    _records = {}
    model.set_attn_implementation(CAPTURE)
    try:
        yield _records
    finally:
        model.set_attn_implementation(previous)
        _records = None
