"""InfiniGen's speculation: the partial query of layer i from layer i-1's residual stream (the
``attention_input`` of ``Policy.select``), scored against layer i's partial key cache.

Partial keys: the artifact's kept channels of the skewed keys, ``k @ A[:, channels]`` per KV head
(post-RoPE keys for the Llama family; OPT keys as they are). Partial queries:
- OPT: ``[x, 1] @ W_partial.T``, W_partial the artifact's folded, scaled, skewed W_q rows;
- RoPE models: the layer's own q projection (and q norm), RoPE at the current position, then
  ``q @ (A[:, channels] * s)``, s the attention's own scale (``attention_scale``); the score is in
  logit units either way.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from infinigen.architectures import ModelSpec
from infinigen.artifacts import Artifact
from infinigen.runtime.kernels.triton_support import on_triton, tl, triton
from infinigen.tensor_parallel import head_shard


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def projected_query(attention: nn.Module, spec: ModelSpec, x: torch.Tensor) -> torch.Tensor:
    """A layer's query for one token before RoPE (q projection, q norm where the model has one):
    attention input (B, hidden) -> (B, heads, d), the heads this rank computes (``tensor_parallel``)."""
    q = attention.q_proj(x).view(x.shape[0], -1, spec.head_dim)
    return attention.q_norm(q) if hasattr(attention, "q_norm") else q


def attention_scale(attention: nn.Module, spec: ModelSpec) -> float:
    """The factor of q·k in a layer's attention logits: the module's own ``scaling`` where it has one
    (Gemma 3: ``query_pre_attn_scalar**-0.5``, not ``head_dim**-0.5``), else 1/sqrt(head_dim)."""
    scaling = getattr(attention, "scaling", None)
    return float(scaling) if scaling is not None else spec.head_dim**-0.5


def rotated_query(attention: nn.Module, spec: ModelSpec, x: torch.Tensor, rope) -> torch.Tensor:
    """A layer's query for one token, as its attention computes it (RoPE models, unscaled):
    attention input (B, hidden) -> (B, heads, d)."""
    q = projected_query(attention, spec, x)
    cos, sin = (t[:, -1, None, :] for t in rope)  # (B or 1, 1, d)
    return q * cos + rotate_half(q) * sin


def exact_query(attention: nn.Module, spec: ModelSpec, x: torch.Tensor, rope) -> torch.Tensor:
    """A layer's query for one token scaled so that ``query @ key`` is the attention logit:
    attention input (B, hidden) -> (B, heads, d)."""
    if spec.rope:
        return rotated_query(attention, spec, x, rope) * attention_scale(attention, spec)
    return (attention.q_proj(x) * attention.scaling).view(x.shape[0], -1, spec.head_dim)  # OPT scales after


def padded_channels(channels: int) -> int:
    """Partial channels rounded up to a multiple of 8 with zero columns: the same scores, aligned GEMMs
    (cuBLAS picks slow kernels for an odd inner dimension)."""
    return -(-channels // 8) * 8


class LayerSpeculator(nn.Module):
    """Partial query and key projections of one layer, on the compute device, for the heads this rank
    computes: the artifact's per-KV-head skew and channels, and OPT's folded partial query rows, are
    sliced in the order of the projections' shards (``tensor_parallel.head_shard``), so an artifact
    made on one device serves any tensor-parallel size."""

    def __init__(self, spec: ModelSpec, artifact: Artifact, layer: int, attention: nn.Module, device, dtype) -> None:
        super().__init__()
        self.spec = spec
        self.attention = attention  # the layer's attention module (RoPE models reuse its q projection)
        skew, channels = artifact.skew_matrix(layer), artifact.channels(layer)  # (h, d, d), (h, r)
        self.shard = head_shard(attention, skew.shape[-1])
        skew, channels = skew[self.shard.kv_heads], channels[self.shard.kv_heads]
        key_columns = torch.stack([head[:, kept] for head, kept in zip(skew, channels, strict=True)])  # (h, d, r)
        key_columns = F.pad(key_columns, (0, padded_channels(key_columns.shape[-1]) - key_columns.shape[-1]))
        self.register_buffer("key_projection", key_columns.to(device, dtype))
        partial_query = artifact.partial_query_weight(layer)
        if partial_query is None:
            scale = attention_scale(attention, spec)
            per_query_head = key_columns.repeat_interleave(self.shard.group_size, dim=0) * scale
            self.register_buffer("query_projection", per_query_head.to(device, dtype))  # (heads, d, r)
        else:
            partial_query = partial_query[self.shard.query_heads]
            partial_query = F.pad(partial_query, (0, 0, 0, key_columns.shape[-1] - partial_query.shape[1]))
            self.register_buffer("query_weight", partial_query[..., :-1].to(device, dtype))  # (heads, r, hidden)
            self.register_buffer("query_bias", partial_query[..., -1].to(device, dtype))  # (heads, r)

    def partial_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """(B, kv_heads, T, d) -> (B, kv_heads, T, r)."""
        return torch.matmul(keys, self.key_projection)  # broadcast over B: one batched GEMM

    def partial_query(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """The previous layer's residual under this layer's attention norm (B, hidden; ``Policy.select``'s
        ``attention_input``) -> (B, heads, r)."""
        if not self.spec.rope:
            return torch.einsum("bx,hrx->bhr", x, self.query_weight) + self.query_bias
        head_dim = self.spec.head_dim
        if on_triton(x.device) and head_dim & (head_dim - 1) == 0:
            return rotated_partial_query(projected_query(self.attention, self.spec, x), rope, self.query_projection)
        q = rotated_query(self.attention, self.spec, x, rope)
        return torch.einsum("bhd,hdr->bhr", q, self.query_projection)


def rotated_partial_query(q: torch.Tensor, rope, projection: torch.Tensor) -> torch.Tensor:
    """q (B, heads, d) before RoPE -> ``RoPE(q) @ projection`` (B, heads, r) in one kernel (PyTorch:
    seven per layer and step), d a power of two; the same values up to float32 rounding."""
    batch, heads, head_dim = q.shape
    cos, sin = (t[:, -1] for t in rope)  # (B or 1, d)
    channels = projection.shape[-1]
    out = torch.empty(batch, heads, channels, dtype=q.dtype, device=q.device)
    _rotated_partial_query_kernel[(batch * heads,)](
        q.contiguous(),
        cos,
        sin,
        projection,
        out,
        heads,
        cos.stride(0) if cos.shape[0] > 1 else 0,
        sin.stride(0) if sin.shape[0] > 1 else 0,
        head_dim=head_dim,
        channels=channels,
        channels_pow2=triton.next_power_of_2(channels),
    )
    return out


if triton is not None:

    @triton.jit
    def _rotated_partial_query_kernel(
        q,  # (B * heads, d) contiguous
        cos,  # (B or 1, d), row stride cos_stride (0: one row for every batch row)
        sin,  # likewise
        projection,  # (heads, d, channels) contiguous
        out,  # (B * heads, channels)
        heads,
        cos_stride,
        sin_stride,
        head_dim: tl.constexpr,  # a power of two
        channels: tl.constexpr,
        channels_pow2: tl.constexpr,
    ):
        row = tl.program_id(0)
        b = row // heads
        i = tl.arange(0, head_dim)
        c = tl.arange(0, channels_pow2)
        half: tl.constexpr = head_dim // 2
        value = tl.load(q + row * head_dim + i).to(tl.float32)
        partner = tl.load(q + row * head_dim + (i + half) % head_dim).to(tl.float32)
        rotated = value * tl.load(cos + b * cos_stride + i).to(tl.float32)
        rotated += tl.where(i < half, -partner, partner) * tl.load(sin + b * sin_stride + i).to(tl.float32)
        weights = tl.load(
            projection + (row % heads) * head_dim * channels + i[:, None] * channels + c[None, :],
            mask=(c < channels)[None, :],
            other=0,
        ).to(tl.float32)
        result = tl.sum(rotated[:, None] * weights, axis=0)
        tl.store(out + row * channels + c, result.to(out.dtype.element_ty), mask=c < channels)
