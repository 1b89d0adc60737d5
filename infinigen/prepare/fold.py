"""OPT only: fold the skew (and 1/sqrt(d), and the bias) into the projection weights.

Without rotary embeddings q = s(W_q x + b_q) and k = W_k x + b_k, so per head the skewed
q @ A equals [x, 1] @ (s Aᵀ [W_q | b_q]).T: the partial query of the runtime is a row subset of
that matrix, and a skewed checkpoint (W_q <- AᵀW_q per head, same for W_k) is an ordinary OPT
checkpoint whose outputs are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from infinigen.architectures import decoder_layers
from infinigen.errors import InfinigenError


def _augmented(proj: nn.Linear) -> torch.Tensor:
    """[W | b] in float64: (out, in + 1)."""
    weight = proj.weight.detach().double().cpu()
    bias = proj.bias.detach().double().cpu() if proj.bias is not None else torch.zeros(weight.shape[0])
    return torch.cat([weight, bias.double()[:, None]], dim=1)


def partial_query_weight(q_proj: nn.Linear, scaling: float, skew: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """(heads, r, hidden + 1) float32. skew: (heads, d, d); channels: (heads, r)."""
    n_heads, head_dim, _ = skew.shape
    per_head = (_augmented(q_proj) * scaling).view(n_heads, head_dim, -1)  # (heads, d, hidden + 1)
    skewed = skew.double().mT @ per_head  # rows: skewed query channels
    return torch.stack([skewed[h, channels[h]] for h in range(n_heads)]).float()


def _skew_projection(proj: nn.Linear, skew: torch.Tensor) -> None:
    n_heads, head_dim, _ = skew.shape
    augmented = _augmented(proj).view(n_heads, head_dim, -1)
    skewed = (skew.double().mT @ augmented).reshape(n_heads * head_dim, -1)
    proj.weight.data.copy_(skewed[:, :-1].to(proj.weight.dtype))
    if proj.bias is not None:
        proj.bias.data.copy_(skewed[:, -1].to(proj.bias.dtype))


def skew_model_in_place(model: nn.Module, skews: list[torch.Tensor]) -> None:
    """Skew every layer's W_q and W_k of an OPT model (in place: no second copy of a large model).

    The model's outputs stay the same, up to rounding in its dtype.
    """
    if model.config.model_type != "opt":
        raise InfinigenError("only OPT checkpoints can carry the skew in their weights (RoPE models cannot)")
    for layer, skew in zip(decoder_layers(model), skews, strict=True):
        _skew_projection(layer.self_attn.q_proj, skew)
        _skew_projection(layer.self_attn.k_proj, skew)
