"""Per-KV-head skew matrices and outlier channels from calibration queries and keys.

For one KV head with calibration queries Q (rows: its query group's tokens, d columns) and
keys K: the SVD Q = U S Vᵀ gives the orthogonal skew A = V (columns ordered by singular value).
Then (QA)(KA)ᵀ = QKᵀ exactly, while QA = US piles the magnitude into a few columns. The kept
("partial") channels are the top r column sums of |QA| + |KA| (the group's queries stacked, so
queries weigh in once per query head, as in the paper's rule for one head).

The evidence that skewing works is the *score energy* the kept channels carry: the share of
‖Q K_cᵀ‖²_F that Q[:, S] K_c[:, S]ᵀ reproduces, where K_c are the keys centred over tokens
(a shift common to all keys of a query does not change its softmax).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import scipy.linalg
import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeadSkew:
    skew_matrix: torch.Tensor  # (d, d), orthogonal, float32
    channels: torch.Tensor  # (r,), int64, ascending
    energy_before: float  # score energy carried by the top-r channels of the unskewed q/k
    energy_after: float  # same, skewed
    unskewed: bool = False  # the SVD skew carried less than none: the head ships the identity


def right_singular_vectors(matrix: torch.Tensor) -> torch.Tensor:
    """V of matrix = U S Vᵀ, columns ordered by descending singular value.

    LAPACK's default divide-and-conquer driver can fail to converge on ill-conditioned
    inputs; then the slower but more robust QR-iteration driver (``gesvd``) is used.
    """
    try:
        _, _, vh = torch.linalg.svd(matrix, full_matrices=False)
    except torch.linalg.LinAlgError:
        log.warning("torch.linalg.svd did not converge; retrying with scipy's gesvd driver")
        _, _, vh_np = scipy.linalg.svd(matrix.numpy(), full_matrices=False, lapack_driver="gesvd")
        vh = torch.from_numpy(np.ascontiguousarray(vh_np))
    return vh.mT


def top_channels(queries: torch.Tensor, keys: torch.Tensor, n_channels: int) -> torch.Tensor:
    """The n_channels columns with the largest column sums of |Q| + |K|, ascending."""
    score = queries.abs().sum(dim=0) + keys.abs().sum(dim=0)
    return score.topk(n_channels).indices.sort().values


def score_energy(queries: torch.Tensor, keys: torch.Tensor, channels: torch.Tensor) -> float:
    """1 - ‖Q (I-P) K_cᵀ‖²_F / ‖Q K_cᵀ‖²_F, P the projector on ``channels``.

    Computed exactly from the d×d Gram matrices: ‖Q M K_cᵀ‖²_F = Σ_ij (QᵀQ)_ij (K_cᵀK_c)_ij over
    the channels i, j that M keeps.
    """
    centred = keys - keys.mean(dim=0)
    product = (queries.mT @ queries) * (centred.mT @ centred)  # (d, d)
    dropped = torch.ones(product.shape[0], dtype=torch.bool)
    dropped[channels] = False
    return float(1 - product[dropped][:, dropped].sum() / product.sum())


def skew_head(
    queries: torch.Tensor,
    keys: torch.Tensor,
    n_channels: int,
    *,
    skew: str = "svd",
    channel_rule: str = "top",
    generator: torch.Generator | None = None,
) -> HeadSkew:
    """Skew and outlier channels for one KV head.

    queries: (rows, d), all query heads of the group stacked; keys: (tokens, d).
    ``skew``/``channel_rule`` other than svd/top are ablations: no skew, random channels.
    """
    queries, keys = queries.double(), keys.double()
    head_dim = queries.shape[-1]
    skew_matrix = right_singular_vectors(queries) if skew == "svd" else torch.eye(head_dim, dtype=torch.float64)
    skewed_q, skewed_k = queries @ skew_matrix, keys @ skew_matrix
    if channel_rule == "top":
        channels = top_channels(skewed_q, skewed_k, n_channels)
    else:
        channels = torch.randperm(head_dim, generator=generator)[:n_channels].sort().values
    plain_channels = top_channels(queries, keys, n_channels)
    energy_before = score_energy(queries, keys, plain_channels)
    energy_after = score_energy(skewed_q, skewed_k, channels)
    if skew == "svd" and channel_rule == "top" and energy_after < energy_before:
        # Q's principal directions need not be where its scores with the (centred) keys live: a
        # skew that keeps less score energy than no skew is never shipped.
        identity = torch.eye(head_dim, dtype=torch.float32)
        return HeadSkew(identity, plain_channels, energy_before, energy_before, unskewed=True)
    return HeadSkew(skew_matrix.float(), channels, energy_before, energy_after)


def group_queries(queries: torch.Tensor, n_kv_heads: int) -> list[torch.Tensor]:
    """Split (heads, T, d) queries into one (group*T, d) matrix per KV head."""
    n_heads, _, head_dim = queries.shape
    group = n_heads // n_kv_heads
    return [queries[h * group : (h + 1) * group].reshape(-1, head_dim) for h in range(n_kv_heads)]
