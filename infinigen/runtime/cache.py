"""``InfinigenCache``: a transformers ``Cache`` whose offloaded layers keep KV in CPU memory, plus the
public extension points that connect it to a model:

- a registered attention function (``AttentionInterface``) that attends over a decode step's
  fetched rows with their per-head validity mask, and is plain SDPA for anything else;
- a forward pre-hook on each decoder layer: it finds the cache of the running forward (and the
  rotary cos/sin) and, during decode, starts the next layer's selection and prefetch.

The hooks are installed once per model and act only when an ``InfinigenCache`` is passed in.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from infinigen.architectures import attention_norm, decoder_layers, model_spec
from infinigen.artifacts import Artifact
from infinigen.errors import InfinigenError
from infinigen.runtime.config import RuntimeConfig
from infinigen.runtime.layers import DenseLayer, Fetched, OffloadedLayer, pool_tokens
from infinigen.runtime.policies import Selection, make_policy
from infinigen.runtime.speculation import LayerSpeculator
from infinigen.runtime.stats import summarize

ATTENTION = "infinigen"


class InfinigenCache(Cache):
    def __init__(self, model: PreTrainedModel, config: RuntimeConfig, artifact: Artifact | None = None) -> None:
        self.spec = model_spec(model.config)
        self.config = config = config.for_model(self.spec.model_type)
        self.policy = make_policy(config)
        if self.policy.speculates and artifact is None:
            raise InfinigenError(f"policy {config.policy!r} needs an artifact: run `infinigen prepare` first")
        if self.policy.speculates and config.dense_layers < 1:
            raise InfinigenError("speculation needs the previous layer: dense_layers must be at least 1")
        n_layers = self.spec.n_layers
        dense = n_layers if not self.policy.offloads else min(config.dense_layers, n_layers)
        self.n_offloaded = n_layers - dense
        blocks = decoder_layers(model)
        layers: list = [DenseLayer() for _ in range(dense)]
        for i in range(dense, n_layers):
            speculator = None
            if self.policy.speculates:
                param = next(model.parameters())
                speculator = LayerSpeculator(self.spec, artifact, i, blocks[i].self_attn, param.device, param.dtype)
            layers.append(OffloadedLayer(i, self.policy, config, speculator, blocks[i].self_attn, runtime=self))
        super().__init__(layers=layers)
        self.rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.device = next(model.parameters()).device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.buffers: list[torch.Tensor] = [torch.empty(0, device=self.device)] * 2
        self.wait_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.slot_range = torch.arange(0, device=self.device)
        # Diagnostics for `infinigen bench --breakdown`: skip the row moves (compute only), or keep
        # each step's gathers to replay them alone (transfer only).
        self.move_rows = True
        self.kept_gathers: list[tuple] | None = None
        install(model)

    @property
    def offloaded(self) -> list[OffloadedLayer]:
        return [layer for layer in self.layers if isinstance(layer, OffloadedLayer)]

    def pool_limit(self, batch: int, dtype: torch.dtype) -> int | None:
        """Tokens per (batch row, KV head) each offloaded layer's pool may hold (whole blocks)."""
        tokens = pool_tokens(
            self.config.cpu_pool_gb, self.n_offloaded, batch, self.spec.n_kv_heads, self.spec.head_dim, dtype
        )
        if tokens is None:
            return None
        tokens -= tokens % self.config.block_tokens if tokens >= self.config.block_tokens else 0
        return tokens

    # --- transfers ---------------------------------------------------------------------------

    def _buffer(self, parity: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A view of one of two reusable staging buffers (double buffering across layers)."""
        numel = math.prod(shape)
        buffer = self.buffers[parity]
        if buffer.dtype != dtype or buffer.numel() < numel:
            buffer = torch.empty(max(numel, 2 * buffer.numel()), dtype=dtype, device=self.device)
            if self.stream is not None:
                buffer.record_stream(self.stream)
            self.buffers[parity] = buffer
        return buffer[:numel].view(shape)

    def fetch(self, layer: OffloadedLayer, selection: Selection) -> Fetched:
        """Start moving the selected rows of ``layer`` into a staging buffer; return it with its validity."""
        batch, kv_heads = layer.valid.shape[:2]
        n, device = layer.used, self.device
        indices, count = selection.indices, selection.count
        if indices is None:
            indices = self.all_slots(n).expand(batch, kv_heads, n)
        k = indices.shape[-1]
        rows = self._buffer(layer.index % 2, (batch, kv_heads, 2, k + 1, self.spec.head_dim), layer.dtype)
        valid = torch.empty(batch, kv_heads, k + 1, dtype=torch.bool, device=device)
        valid[:, :, :k] = layer.valid.gather(-1, indices)
        if count is not None:
            valid[:, :, :k] &= self.all_slots(k) < count[:, None, None]
        layer.stats.record(count if count is not None else n, n, batch, kv_heads)
        if layer.max_tokens is not None:
            layer.record_fetch(indices, valid[:, :, :k])
        if self.kept_gathers is not None:
            self.kept_gathers.append((layer.pool, indices, count, rows[:, :, :, :k]))
        ready = self._gather(layer, indices, count, rows[:, :, :, :k]) if self.move_rows else None
        return Fetched(rows, valid, ready)

    def _gather(self, layer: OffloadedLayer, indices, count, out) -> torch.cuda.Event | None:
        """The row move itself: inline on CPU; on CUDA on the transfer stream, after the compute
        stream's work so far, returning the event that marks its end."""
        if self.stream is None:
            layer.pool.gather(indices, count, out)
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            layer.pool.gather(indices, count, out)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        for tensor in (indices, count):
            if tensor is not None:
                tensor.record_stream(self.stream)
        return ready

    def all_slots(self, n: int) -> torch.Tensor:
        """arange(n) on the device, cached."""
        if self.slot_range.numel() < n:
            self.slot_range = torch.arange(max(n, 2 * self.slot_range.numel()), device=self.device)
        return self.slot_range[:n]

    def wait(self, fetched: Fetched) -> None:
        """Make the compute stream wait for a prefetch (timed with events when collecting stats)."""
        if fetched.ready is None:
            return
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        torch.cuda.current_stream(self.device).wait_event(fetched.ready)
        after.record()
        self.wait_events.append((before, after))

    def summary(self) -> dict:
        if self.wait_events:
            torch.cuda.synchronize(self.device)
        wait_ms = sum(b.elapsed_time(a) for b, a in self.wait_events)
        offloaded = self.offloaded
        dtype = offloaded[0].dtype if offloaded and offloaded[0].is_initialized else torch.float16
        row_bytes = 2 * self.spec.head_dim * torch.finfo(dtype).bits // 8
        pool_bytes = sum(layer.pool.nbytes for layer in offloaded if layer.is_initialized)
        return {"policy": self.policy.name, **summarize(offloaded, row_bytes, wait_ms, pool_bytes)}


# --- attention and hooks -----------------------------------------------------------------------


def grouped_decode_attention(query, keys, values, valid, scaling):
    """One query token over gathered rows. query (B, H, 1, d); keys/values (B, kv_heads, S, d);
    valid (B, kv_heads, S). Grouped-query heads share their KV head's rows (no repeat).
    Returns (B, 1, H, d), as transformers' attention functions do."""
    batch, heads, _, head_dim = query.shape
    kv_heads = keys.shape[1]
    grouped = query.view(batch, kv_heads, heads // kv_heads, head_dim)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scaling  # (B, kv_heads, G, S)
    scores = scores.masked_fill(~valid[:, :, None, :], -math.inf)
    out = torch.matmul(scores.softmax(dim=-1).to(values.dtype), values)  # (B, kv_heads, G, d)
    return out.reshape(batch, 1, heads, head_dim)


def infinigen_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    cache = getattr(module, "_infinigen_cache", None)
    layer = cache.layers[module.layer_idx] if cache is not None else None
    if isinstance(layer, OffloadedLayer):
        if layer.attention_valid is not None:
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            return grouped_decode_attention(query, key, value, layer.attention_valid, scale), None
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            layer.mark_padding(attention_mask[:, 0, -1, -query.shape[2] :])
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


AttentionInterface.register(ATTENTION, infinigen_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def install(model: PreTrainedModel) -> None:
    """Connect ``model`` to InfinigenCache (idempotent): attention function and decoder-layer hooks."""
    if model.config._attn_implementation != ATTENTION:
        model.set_attn_implementation(ATTENTION)
    if getattr(model, "_infinigen_installed", False):
        return
    blocks = decoder_layers(model)
    norms = [attention_norm(block) for block in blocks]
    for j, block in enumerate(blocks):
        block.register_forward_pre_hook(_step_hook(j, norms), with_kwargs=True)
    model._infinigen_installed = True


def _step_hook(j: int, norms: list[nn.Module]):
    """Before decoder layer j: bind the running cache to its attention, and during decode start the
    selection and prefetch of layer j+1 (and of layer 0 itself, when it is offloaded).

    The next layer's attention input is approximated by the residual stream entering layer j,
    normalised with layer j+1's own attention norm.
    """

    def hook(block: nn.Module, args, kwargs):
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        cache = cache if isinstance(cache, InfinigenCache) else None
        block.self_attn._infinigen_cache = cache
        if cache is None:
            return
        if j == 0:
            cache.rope = kwargs.get("position_embeddings")
        hidden = args[0] if args else kwargs["hidden_states"]  # (B, q_len, hidden)
        if hidden.shape[1] != 1:  # prefill: nothing to select
            return
        ahead = [0] if j == 0 else []  # layer 0 has no previous layer: it selects from its own input
        ahead += [j + 1] if j + 1 < len(norms) else []
        for target in ahead if cache.policy.lookahead else [j]:
            layer = cache.layers[target]
            if isinstance(layer, OffloadedLayer) and layer.is_initialized:
                layer.prefetch(norms[target](hidden[:, 0]), cache.rope)

    return hook
