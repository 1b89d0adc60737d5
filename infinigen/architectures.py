"""What the tool needs to know about a model's attention, detected from its config.

Two families are supported:
- OPT: no rotary embedding, biased q/k projections; the skew folds exactly into W_q / W_k.
- Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3): rotary embedding and grouped-query
  attention; the skew acts on post-RoPE q/k, one matrix per KV head.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from infinigen.errors import InfinigenError

ROPE_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED = ("opt", *ROPE_FAMILY)
Norm = Callable[[torch.Tensor], torch.Tensor]  # a norm module, or a function computing the same


@dataclass(frozen=True)
class ModelSpec:
    """Attention geometry of a decoder-only model."""

    model_type: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    max_positions: int

    @property
    def rope(self) -> bool:
        return self.model_type != "opt"

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 without grouped-query attention)."""
        return self.n_heads // self.n_kv_heads


def model_spec(config) -> ModelSpec:
    """Read the attention geometry from a transformers config, or fail naming what is supported."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        raise InfinigenError(f"unsupported architecture {model_type!r}: supported are {', '.join(SUPPORTED)}")
    if model_type == "opt" and not getattr(config, "do_layer_norm_before", True):
        # their attention reads the un-normalised residual stream: the selections' inputs assume a norm
        raise InfinigenError("OPT with post-norm layers (do_layer_norm_before=False, e.g. opt-350m) is not supported")
    n_heads = config.num_attention_heads
    hidden = config.hidden_size
    n_kv_heads = getattr(config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(config, "head_dim", None) or hidden // n_heads
    return ModelSpec(
        model_type=model_type,
        n_layers=config.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        max_positions=config.max_position_embeddings,
    )


def decoder_stack(model: nn.Module) -> nn.Module:
    """The module that runs the decoder blocks of a causal-LM model of a supported family (and builds
    their attention masks)."""
    inner = model.model
    return inner.decoder if model.config.model_type == "opt" else inner


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The list of decoder blocks of a causal-LM model of a supported family."""
    return decoder_stack(model).layers


def attention_norm(layer: nn.Module) -> nn.Module:
    """The norm whose output is a decoder block's attention input."""
    return layer.self_attn_layer_norm if hasattr(layer, "self_attn_layer_norm") else layer.input_layernorm


def one_kernel_norm(norm: nn.Module) -> Norm:
    """``norm`` as one kernel where PyTorch has one: a plain RMS norm (``weight * x / sqrt(mean(x^2) +
    eps)``: Llama, Mistral, Qwen) through ``F.rms_norm``, which transformers' module runs as about seven
    element-wise kernels; any other norm as itself. The same values up to the last bit of rounding:
    for the selections' inputs, never for the model's own compute."""
    plain = type(norm).__name__.endswith("RMSNorm") and isinstance(getattr(norm, "variance_epsilon", None), float)
    if not plain or getattr(norm, "bias", None) is not None or norm.weight.dim() != 1:
        return norm
    return functools.partial(
        F.rms_norm, normalized_shape=norm.weight.shape, weight=norm.weight, eps=norm.variance_epsilon
    )


def mlp_norm(layer: nn.Module) -> nn.Module:
    """The norm whose input is a decoder block's residual stream after its attention (pre-norm blocks)."""
    return layer.final_layer_norm if hasattr(layer, "final_layer_norm") else layer.post_attention_layernorm


def fingerprint(model: nn.Module) -> str:
    """A short hash of the q/k projection weights: identifies the base model an artifact was made for.

    Weights are rounded to bfloat16 first so that loading the same checkpoint in float32,
    float16 or bfloat16 gives the same fingerprint; a strided subset of rows keeps it fast
    for large models.
    """
    digest = hashlib.sha256()
    for layer in decoder_layers(model):
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
            weight = proj.weight.detach()
            stride = max(1, weight.shape[0] // 64)
            rows = weight[::stride].to(device="cpu", dtype=torch.bfloat16).contiguous()
            digest.update(rows.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]
