"""What a cache's CPU pools take, from the model's config and the runtime settings alone: which
layers offload, how many tokens a limited pool holds, and the host memory a prompt's pools take
(``host_pool_size``, what ``reserve_host_memory`` should pin before the weights are loaded, so that
the first prefill does not wait for its blocks: ``infinigen generate`` does this)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

import torch

from infinigen.architectures import decoder_layers, model_spec, sliding_windows
from infinigen.runtime.config import config_from
from infinigen.runtime.memory.host_memory import WORKERS
from infinigen.runtime.memory.pool import row_bytes
from infinigen.runtime.selection.policies import policy_class, row_bits


def offloaded_layer_indices(windows: tuple[int | None, ...], dense_layers: int, offloads: bool) -> list[int]:
    """The layers whose KV goes to a CPU pool, of a model of these ``sliding_windows``. Sliding-window layers
    keep their window on the device whatever the policy (``SlidingLayer``); of the others, layers
    0 .. dense_layers-1 keep their KV there too (every layer where the policy does not offload).
    ``dense_layers`` counts layers, not full-attention ones: what it guards against, speculating from a
    residual stream that is still changing fast, depends on the depth alone."""
    dense = len(windows) if not offloads else dense_layers
    return [i for i, window in enumerate(windows) if window is None and i >= dense]


POOL_ALIGN = 64  # slots: a pool block sized to a short run is a multiple of this


def pool_block_tokens(asked: int, tokens: int) -> int:
    """A pool's block for a run of ``tokens`` per row: ``asked``, or a run's whole length where it is
    shorter (in multiples of ``POOL_ALIGN``): a large batch of short prompts would otherwise hold a mostly
    empty block per row and head, in host memory and in the GPU's per-slot state (the memory plan sets it)."""
    return min(asked, -(-tokens // POOL_ALIGN) * POOL_ALIGN)


def pool_limit(
    cpu_pool_gb: float | None, n_offloaded: int, batch: int, kv_heads: int, row_bytes: int, block_tokens: int
) -> int | None:
    """Tokens per (batch row, KV head) each offloaded layer's pool may hold within ``cpu_pool_gb``
    (whole blocks where it holds one), or None: no limit."""
    if cpu_pool_gb is None or n_offloaded == 0:
        return None
    tokens = int(cpu_pool_gb * 1e9 // (n_offloaded * batch * kv_heads * row_bytes))  # GB: 10^9 bytes, as every *_gb
    return tokens - tokens % block_tokens if tokens >= block_tokens else tokens


def blocks_ahead(
    layers: list[tuple[int, int]], new: int, row_bytes: int, block_tokens: int, limit: int | None
) -> list[int]:
    """The sizes of the pool blocks a multi-token step of ``new`` tokens will add, layer by layer, to
    offloaded layers of (slots used, blocks made) each, rows of ``row_bytes`` for every (batch row, KV
    head): the offloaded layers' keys have layer 0's shape (a layer whose differ makes its own blocks
    when it reaches them). ``limit``: the tokens a limited pool holds."""
    sizes = []
    for used, made in layers:
        tokens = used + new if limit is None else min(used + new, limit)
        sizes += [row_bytes * block_tokens] * max(0, -(-tokens // block_tokens) - made)
    return sizes


@dataclass(frozen=True)
class PoolSize:
    blocks: int  # pool blocks, over every offloaded layer
    block_bytes: int  # each: ``block_tokens`` rows of every (batch row, KV head)

    @property
    def nbytes(self) -> int:
        return self.blocks * self.block_bytes

    def reservation_bytes(self, regions: int = WORKERS) -> int:
        """What ``reserve_host_memory`` needs to hold these blocks in ``regions`` regions: each region
        holds whole blocks, so up to a block's slack each."""
        return self.nbytes + regions * self.block_bytes if self.blocks else 0


def host_pool_size(model_config, batch: int, tokens: int, dtype: torch.dtype, ranks: int = 1, **settings) -> PoolSize:
    """The pool blocks a cache with ``settings`` (``RuntimeConfig``'s fields) holds once ``batch`` rows
    of up to ``tokens`` tokens each (prompt and new tokens) are cached in ``dtype``, on one of
    ``ranks`` tensor-parallel ranks (None in ``settings``: the field's default). A limited pool
    (``cpu_pool_gb``) holds at most its limit."""
    config = config_from(settings)
    offloaded = offloaded_layer_indices(
        sliding_windows(model_config), config.dense_layers, policy_class(config.policy).offloads
    )
    return pool_size(model_spec(model_config), len(offloaded), batch, tokens, dtype, ranks, config)


def pool_size(spec, n_offloaded: int, batch: int, tokens: int, dtype: torch.dtype, ranks: int, config) -> PoolSize:
    """``host_pool_size`` for a model's ``model_spec`` with ``n_offloaded`` offloaded layers and a ``RuntimeConfig``
    (the memory plan's thousands of candidates, each of which would otherwise read the config again)."""
    policy = policy_class(config.policy)
    kv_heads = spec.n_kv_heads // ranks
    rows = row_bytes(spec.head_dim, dtype, policy.codec, row_bits(config))
    pool_gb = None if config.cpu_pool_gb is None else config.cpu_pool_gb / ranks
    limit = pool_limit(pool_gb, n_offloaded, batch, kv_heads, rows, config.block_tokens)
    tokens = tokens if limit is None else min(tokens, limit)
    per_layer = -(-tokens // config.block_tokens)
    return PoolSize(n_offloaded * per_layer, batch * kv_heads * config.block_tokens * rows)


WEIGHT_ALIGN = 256  # bytes: each parameter's view in a weight slot starts where any dtype's kernels accept it


def slot_bytes(sizes: Iterable[int]) -> int:
    """Tensors of these byte sizes in one streamed-weight slot (``runtime.weights``), each aligned."""
    return sum(-(-nbytes // WEIGHT_ALIGN) * WEIGHT_ALIGN for nbytes in sizes)


def weights_ahead(policy: str) -> int:
    """Streamed layers kept in their slots beyond the running one: 1 where a decode step's selection reads
    the next layer's query projection during this one (policies that select one layer ahead), else 0."""
    kind = policy_class(policy)
    return 1 if kind.offloads and kind.lookahead else 0


def weight_slots(policy: str, streamed: int) -> int:
    """The device slots of ``streamed`` streamed layers (``runtime.weights``): the running layer, those kept
    ahead and the one being copied, never more than there are."""
    return min(weights_ahead(policy) + 2, streamed)


def streamed_count(config, layers: int) -> int:
    """How many decoder layers ``config`` streams (``streamed_layers``) of a model of ``layers``."""
    return min(config.streamed_layers or 0, layers)


def streamed_layer_indices(config, layers: int) -> list[int]:
    """The decoder layers ``config`` streams of a model of ``layers``: spread evenly through the stack, the
    last among them, so that the resident layers between two streamed ones compute while the next one's
    weights cross the bus. (The last ones, streamed together, left the link idle through every resident
    layer: the 8B shape at 12 GB stepped 1.35x its bound, H200, 2026-11-30.)"""
    count = streamed_count(config, layers)
    return [i for i in range(layers) if (i + 1) * count // layers > i * count // layers]


@dataclass(frozen=True)
class Model:
    """What the plan reads of a model: its config's geometry and its weights' size, no weights."""

    config: object  # transformers' config
    weight_bytes: int  # the parameters in the plan's dtype
    layer_bytes: int = 0  # the largest decoder layer's parameters, in a streaming slot (0: none streams)

    # read once: a throughput search plans thousands of candidates, and each read of transformers' config is slow
    @cached_property
    def spec(self):
        return model_spec(self.config)

    @cached_property
    def windows(self) -> tuple[int | None, ...]:
        return sliding_windows(self.config)

    @cached_property
    def hidden(self) -> int:
        return self.config.hidden_size

    @cached_property
    def intermediate(self) -> int:
        return getattr(self.config, "intermediate_size", None) or self.config.ffn_dim  # OPT: ffn_dim

    @cached_property
    def vocab(self) -> int:
        return self.config.vocab_size


def model_of(config, dtype: torch.dtype) -> Model:
    """``Model`` from a config: the parameters counted on the meta device (nothing allocated; tied
    weights once)."""
    key = config.to_json_string(use_diff=False)
    if key not in _COUNTS:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        layers = [[p.numel() for p in layer.parameters()] for layer in decoder_layers(model)]
        _COUNTS[key] = sum(p.numel() for p in model.parameters()), max(layers, key=sum)
    count, layer = _COUNTS[key]
    return Model(config, count * dtype.itemsize, slot_bytes(n * dtype.itemsize for n in layer))


_COUNTS: dict[str, tuple[int, list[int]]] = {}  # parameters, the largest layer's: a sweep plans a model often


def largest(fits, low: int, high: int) -> int:
    """The largest n in [low, high] with ``fits(n)`` (monotone: fits up to some n), or low - 1 if none."""
    if not fits(low):
        return low - 1
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def gb(nbytes: float) -> float:
    """GB (10^9 bytes) to four significant digits."""
    return float(f"{nbytes / 1e9:.4g}")
