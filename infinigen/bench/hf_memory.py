"""What transformers' own caches take on the GPU, in the memory plan's terms (``runtime.memory.plan``), so
that ``infinigen plan`` can say how large a batch and context each fits beside the runtime's policies.
An estimate from their code, not a plan they follow: ``bench`` runs them as they are, and where they do
not fit their error is their row.

- ``hf-dynamic`` (``DynamicCache``): every layer's KV on the GPU, grown by concatenation (a layer's old
  and new KV side by side while it grows);
- ``hf-offloaded`` (``DynamicCache(offloading=True)``): the KV in host memory, on the GPU the running
  layer's and the next one's (prefetched);
- both prefill through transformers' SDPA attention: past the first chunk or with padded rows, over a mask
  of every key (taken as a bias: ``sdpa_bias_bytes``) and, for grouped-query models, the keys and values
  repeated for each query head.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from infinigen.runtime.config import RuntimeConfig
from infinigen.runtime.memory.plan import (
    CUBLAS_WORKSPACE,
    MLP_BEYOND,
    SLACK,
    MemoryPlan,
    Model,
    Part,
    Workload,
    largest,
    layer_activations,
    model_of,
    sdpa_bias_bytes,
)


def hf_plan(model: Model, dtype: torch.dtype, work: Workload, name: str, budget: int | None = None) -> MemoryPlan:
    spec, e, batch = model.spec, dtype.itemsize, work.batch
    kv_row = spec.n_kv_heads * spec.head_dim * 2 * e  # a token's K and V of every KV head
    layer = batch * kv_row * work.tokens
    on_gpu = spec.n_layers if name == "hf-dynamic" else 2
    parts = [Part("weights", "gpu", model.weight_bytes), Part("KV on the GPU", "gpu", on_gpu * layer)]
    parts.append(Part("decode: a layer's KV growing", "gpu", layer, "decode"))
    if name == "hf-offloaded":
        parts.append(Part("KV in host memory", "host", spec.n_layers * layer))
    chunk = work.chunk
    attention, mlp = layer_activations(model, spec.n_heads, spec.n_kv_heads, spec.head_dim, batch * chunk * e)
    parts.append(Part("prefill: a layer's activations", "gpu", attention, "prefill"))
    workspace = 0
    if chunk < work.context or work.padded:
        parts.append(Part("prefill: attention mask", "gpu", batch * chunk * work.context, "prefill"))
        repeated = batch * spec.n_heads * work.context * spec.head_dim * 2 * e
        parts.append(Part("prefill: keys and values per query head", "gpu", repeated, "prefill"))
        bias = sdpa_bias_bytes(batch, chunk, work.context, e)
        parts.append(Part("prefill: the mask as a bias", "gpu", bias, "prefill"))
        workspace = repeated + bias
    parts.append(Part(MLP_BEYOND, "gpu", max(0, mlp - attention - workspace), "prefill"))
    parts.append(Part("prefill: logits", "gpu", batch * model.vocab * 4, "prefill"))
    return MemoryPlan(name, work, RuntimeConfig(policy="dense"), tuple(parts), budget)


def accelerate_weight_room(model: Model, dtype: torch.dtype, work: Workload, name: str, budget: int) -> int:
    """The GPU bytes accelerate may give weights (``max_memory``) beside transformers' cache ``name`` (its KV
    and workspace, ``hf_plan``) within ``budget``: at most 0 where the cache alone fills it."""
    return int(budget / (1 + SLACK)) - hf_plan(model, dtype, work, name).peak_gpu - CUBLAS_WORKSPACE


def accelerate_least_room(model: Model, dtype: torch.dtype) -> int:
    """The least room for weights in which accelerate's device map places a module on the GPU: the first
    module (the input embeddings) beside the room it keeps for the largest layer it streams there. With less
    its map sends the whole model to the host, and it runs there, not on the GPU."""
    return model.vocab * model.hidden * dtype.itemsize + model_of(model.config, dtype).layer_bytes


def accelerate_batch(model: Model, dtype: torch.dtype, work: Workload, name: str, budget: int) -> int | None:
    """The batch with the most tokens/s under accelerate's offloading with cache ``name``: the largest whose
    cache leaves weights ``accelerate_least_room``, None where not even one row does. A step
    copies the host-mapped weights (the same for any batch) and, with the offloaded cache, each row's KV:
    tokens/s grow with the batch."""
    least = accelerate_least_room(model, dtype)

    def fits(batch: int) -> bool:
        return accelerate_weight_room(model, dtype, replace(work, batch=batch), name, budget) >= least

    return largest(fits, 1, 4096) or None  # 4,096: as ``infinigen plan``'s largest batch
