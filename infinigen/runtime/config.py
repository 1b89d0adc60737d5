"""Run-time settings, checked once, frozen (like FlexGen's Policy)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from infinigen.errors import InfinigenError

EVICTIONS = ("counter", "fifo", "lru")
LOOKAHEAD_FROM = ("input", "attention")
PARTIAL_KEY_BITS = (4, 8, 16)
DEFAULT_ALPHA = {"opt": 4.0}  # the paper's settings: 4 for OPT, 5 for Llama-2 (used for every RoPE family)
ROPE_ALPHA = 5.0


@dataclass(frozen=True)
class RuntimeConfig:
    policy: str = "infinigen"  # a name in infinigen.runtime.policies.POLICIES
    budget: float = 0.2  # most tokens fetched per step and layer, as a fraction of the cached tokens
    alpha: float | None = None  # speculation threshold: tokens above (max - alpha), in logits; None: paper's
    # value for the family (OPT 4, Llama family 5)
    min_tokens: int = 8  # fewest tokens fetched per step and layer (when that many are cached)
    dense_layers: int = 2  # the first layers keep their whole KV on the GPU (as the paper)
    cpu_pool_gb: float | None = None  # limit of the CPU KV pool; None: no limit
    eviction: str = "counter"  # what a full pool overwrites: counter (paper) | fifo | lru
    block_tokens: int = 1024  # the CPU pool grows by blocks of this many tokens
    cuda_graphs: bool = True  # on CUDA, replay decode steps (or each layer's selection) from CUDA graphs
    # What a one-layer-ahead selection for layer i reads: "input", the residual stream entering layer
    # i-1 (the paper; its transfer overlaps all of layer i-1), or "attention", the residual after layer
    # i-1's attention (closer to layer i's input; the transfer overlaps only layer i-1's MLP).
    lookahead_from: str = "input"
    # The first this many offloaded layers read the residual after the previous layer's attention
    # whatever ``lookahead_from`` says: the residual stream changes fastest in the first layers (on
    # SmolLM2 the first offloaded layer alone decides the 8K needle; ACCURACY.md session 9), and one
    # layer's shorter overlap costs little.
    attention_lookahead_layers: int = 1
    # Bits per value of infinigen's partial key cache on the GPU: 4 (two codes a byte with a per-token
    # scale), 8 (int8 codes with a per-token scale) or 16 (the model's dtype, as the paper).
    partial_key_bits: int = 4
    # Keep each offloaded layer's fetched rows on the GPU between decode steps and move only the rows
    # its next selection adds (``runtime.reuse``): the same rows attended, fewer bytes moved, at the
    # GPU memory of one selection per layer. Budgeted policies with uncompressed rows, unlimited pool.
    reuse_rows: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.budget <= 1:
            raise InfinigenError(f"budget must be in (0, 1], got {self.budget}")
        if self.alpha is not None and self.alpha < 0:
            raise InfinigenError(f"alpha must be non-negative, got {self.alpha}")
        if self.dense_layers < 0 or self.attention_lookahead_layers < 0:
            raise InfinigenError("dense_layers and attention_lookahead_layers must be >= 0")
        if self.min_tokens < 1 or self.block_tokens < 1:
            raise InfinigenError("min_tokens and block_tokens must be >= 1")
        if self.eviction not in EVICTIONS:
            raise InfinigenError(f"eviction must be one of {', '.join(EVICTIONS)}, got {self.eviction!r}")
        if self.lookahead_from not in LOOKAHEAD_FROM:
            choices = ", ".join(LOOKAHEAD_FROM)
            raise InfinigenError(f"lookahead_from must be one of {choices}, got {self.lookahead_from!r}")
        if self.partial_key_bits not in PARTIAL_KEY_BITS:
            raise InfinigenError(f"partial_key_bits must be 4, 8 or 16, got {self.partial_key_bits!r}")
        if self.cpu_pool_gb is not None and self.cpu_pool_gb <= 0:
            raise InfinigenError(f"cpu_pool_gb must be positive, got {self.cpu_pool_gb}")
        if self.reuse_rows and self.cpu_pool_gb is not None:
            raise InfinigenError("reuse_rows needs an unlimited CPU pool (an evicted slot would leave a stale row)")

    def for_model(self, model_type: str) -> RuntimeConfig:
        """This config with ``alpha`` resolved for the model family."""
        if self.alpha is not None:
            return self
        return replace(self, alpha=DEFAULT_ALPHA.get(model_type, ROPE_ALPHA))
