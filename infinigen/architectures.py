"""What the tool needs to know about a model's attention, detected from its config.

Two families are supported:
- OPT: no rotary embedding, biased q/k projections; the skew folds exactly into W_q / W_k.
- Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Gemma 3): rotary embedding and grouped-query
  attention; the skew acts on post-RoPE q/k, one matrix per KV head. Gemma 3 also normalises q and
  k per head, scales logits by ``query_pre_attn_scalar**-0.5`` (the attention module's ``scaling``),
  and interleaves sliding-window layers (``sliding_windows``) with full-attention ones, each kind
  with its own rotary base.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from infinigen.errors import InfinigenError
from infinigen.tensor_parallel import full

ROPE_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
SLIDING = "sliding_attention"  # transformers' ``config.layer_types`` entry of a sliding-window layer
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
        raise InfinigenError(
            f"unsupported architecture {model_type!r}: supported are {', '.join(SUPPORTED)} "
            "(every policy, dense included, runs through infinigen's cache; plain transformers decodes it densely)"
        )
    if model_type == "opt" and not getattr(config, "do_layer_norm_before", True):
        # their attention reads the un-normalised residual stream: the selections' inputs assume a norm
        raise InfinigenError("OPT with post-norm layers (do_layer_norm_before=False, e.g. opt-350m) is not supported")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        # tanh-capped logits: the decode attention, the speculated scores and alpha all assume plain ones
        raise InfinigenError(
            f"attention logit soft-capping (attn_logit_softcapping={config.attn_logit_softcapping}) is not supported"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise InfinigenError("bidirectional attention (use_bidirectional_attention=True) is not supported")
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


def sliding_windows(config) -> tuple[int | None, ...]:
    """Per layer, the sliding window of a sliding-window attention layer (``config.layer_types``,
    Gemma 3's local layers), or None for full attention. A model-wide ``sliding_window`` without
    ``layer_types`` (Mistral) is not read here: those layers stay full-attention layers."""
    layer_types = getattr(config, "layer_types", None) or ()
    window = getattr(config, "sliding_window", None)
    windows = tuple(window if kind == SLIDING and window else None for kind in layer_types)
    return windows or (None,) * config.num_hidden_layers


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
    """The norm whose input is a decoder block's residual stream after its attention (pre-norm blocks).
    Gemma 3's ``post_attention_layernorm`` normalises the attention output before it joins the
    residual stream: there the MLP's input norm is ``pre_feedforward_layernorm``."""
    for name in ("final_layer_norm", "pre_feedforward_layernorm"):
        if hasattr(layer, name):
            return getattr(layer, name)
    return layer.post_attention_layernorm


def fingerprint(model: nn.Module) -> str:
    """A short hash of the q/k projection weights: identifies the base model an artifact was made for.

    Weights are rounded to bfloat16 first so that loading the same checkpoint in float32 or bfloat16
    gives the same fingerprint (float16 can round differently: ``qk_signature`` is the check that
    holds across dtypes); a strided subset of rows keeps it fast for large models.
    """
    digest = hashlib.sha256()
    for layer in decoder_layers(model):
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
            weight = full(proj.weight.detach())  # tensor parallel: the whole weight, as one process has it
            stride = max(1, weight.shape[0] // 64)
            rows = weight[::stride].to(device="cpu", dtype=torch.bfloat16).contiguous()
            digest.update(rows.view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


# The signature probes each of a layer's W_q and W_k with LEFT x RIGHT fixed Gaussian vectors: the
# bilinear forms u^T W v, divided by ||W||_F, each have variance 1 for any W and move, to first order,
# by u^T E v / ||W||_F when W moves by E. 4 x 8 per projection (64 per layer) keep the manifest small
# (~1 KB per layer) while their RMS estimates ||E||_F / ||W||_F within about ±25%.
SIGNATURE_LEFT, SIGNATURE_RIGHT = 4, 8
SIGNATURE_PROBES = 2 * SIGNATURE_LEFT * SIGNATURE_RIGHT  # per layer: W_q's, then W_k's
SIGNATURE_SEED = 20240710  # any fixed seed: the probes are part of the signature's definition
# Rounding a float32 weight to bfloat16 (8 significant bits) changes it by at most 2^-8 of itself, so
# a bfloat16 copy E = W_bf16 - W has ||E||_F <= 2^-8 ||W||_F: the norms move by at most 2^-8 of
# themselves and the normalised probes by an expected RMS of at most 2^-8. Weights of spread-out
# magnitudes round by about 0.45 * 2^-8 ~ 0.0018 in RMS (measured 0.0015-0.0018 on random models;
# float16, 11 bits, rounds 8x finer), so the bound itself, 2^-8 ~ 0.0039, leaves twice that for the
# 64 probes' sampling spread (about ±25%); weights 1% off in RMS (a fine-tune, another seed or
# checkpoint) move the probes by ~0.01 and are refused.
SIGNATURE_TOLERANCE = 2**-8


@dataclass(frozen=True)
class LayerSignature:
    """A dtype-independent summary of one layer's q/k projection weights (see ``qk_signature``)."""

    q_norm: float  # ||W_q||_F
    k_norm: float  # ||W_k||_F
    probes: tuple[float, ...]  # SIGNATURE_PROBES normalised bilinear forms u^T W v / ||W||_F


@torch.no_grad()
def _probe(weight: torch.Tensor) -> tuple[float, list[float]]:
    """||W||_F and the normalised probes of one projection, in float64 (no TF32, no dtype effects)."""
    n_out, n_in = weight.shape
    generator = torch.Generator().manual_seed(SIGNATURE_SEED)
    left = torch.randn(n_out, SIGNATURE_LEFT, generator=generator, dtype=torch.float64)
    right = torch.randn(n_in, SIGNATURE_RIGHT, generator=generator, dtype=torch.float64).to(weight.device)
    squares, forms = 0.0, torch.zeros(SIGNATURE_LEFT, SIGNATURE_RIGHT, dtype=torch.float64)
    step = max(1, 2**22 // n_in)  # rows per chunk: a float64 copy of at most 32 MB at a time
    for start in range(0, n_out, step):
        rows = weight[start : start + step].to(torch.float64)
        squares += float(rows.square().sum())
        forms += left[start : start + step].mT @ (rows @ right).cpu()
    norm = math.sqrt(squares)
    return norm, ((forms.flatten() / norm).tolist() if norm > 0 else [0.0] * forms.numel())


def qk_signature(model: nn.Module) -> tuple[LayerSignature, ...]:
    """Per layer: the q/k weights' norms and fixed random probes, in float64; equal within
    ``SIGNATURE_TOLERANCE`` for the same checkpoint loaded in any dtype (``signature_mismatch``)."""
    signature = []
    for layer in decoder_layers(model):
        q_norm, q_probes = _probe(full(layer.self_attn.q_proj.weight.detach()))
        k_norm, k_probes = _probe(full(layer.self_attn.k_proj.weight.detach()))
        probes = tuple(round(p, 5) for p in q_probes + k_probes)  # 1e-5 steps: far below the tolerance
        signature.append(LayerSignature(float(f"{q_norm:.7g}"), float(f"{k_norm:.7g}"), probes))
    return tuple(signature)


def signature_mismatch(stored: tuple[LayerSignature, ...], loaded: tuple[LayerSignature, ...]) -> str | None:
    """None when ``loaded`` matches ``stored`` within ``SIGNATURE_TOLERANCE``; else the first difference."""
    if len(stored) != len(loaded):
        return f"{len(stored)} layers vs {len(loaded)}"
    for i, (made_for, given) in enumerate(zip(stored, loaded, strict=True)):
        for name, a, b in (("W_q norm", made_for.q_norm, given.q_norm), ("W_k norm", made_for.k_norm, given.k_norm)):
            if not abs(a - b) <= SIGNATURE_TOLERANCE * max(a, b):  # `not <=`: a NaN is a mismatch
                return f"layer {i}: {name} {a:.6g} vs {b:.6g}"
        if len(made_for.probes) != len(given.probes):
            return f"layer {i}: {len(made_for.probes)} probes vs {len(given.probes)}"
        squares = sum((a - b) ** 2 for a, b in zip(made_for.probes, given.probes, strict=True))
        rms = math.sqrt(squares / max(1, len(made_for.probes)))
        if not rms <= SIGNATURE_TOLERANCE:
            return f"layer {i}: probes differ by {rms:.3g} RMS (tolerance {SIGNATURE_TOLERANCE:.3g})"
    return None
