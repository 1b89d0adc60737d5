"""The one interface every KV selection policy implements.

A policy instance serves one offloaded layer and keeps that layer's selection state (partial keys,
page summaries, attention scores). The runtime calls, per layer:

- ``stored`` whenever keys land in the cache (prefill, decode append, eviction overwrite);
- ``select`` once per decode step, one layer ahead (``lookahead``) or at the layer itself (slots
  past ``layer.used`` up to ``layer.capacity`` are never valid);
- ``attended`` after each attention, with the attention mass per slot (only if ``observes_attention``).

A policy with a ``codec`` stores and moves its rows compressed; the runtime decodes them on the
compute device after the transfer. A policy reads its layer through ``LayerView`` only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from infinigen.runtime.config import PolicyName, RuntimeConfig

if TYPE_CHECKING:
    from torch import nn

    from infinigen.architectures import ModelSpec
    from infinigen.runtime.selection.speculation import LayerSpeculator


def rows_bound(budget: float, n: int, min_tokens: int) -> int:
    """The most slots of ``n`` a budgeted selection keeps in any row: the budget's share, at least
    ``min_tokens``, at most ``n`` (a static bound: the shapes of a captured selection)."""
    return min(n, max(min_tokens, math.ceil(budget * n)))


@dataclass(frozen=True)
class Selection:
    """Which cached slots one offloaded layer fetches for the next decode step.

    indices: (B, kv_heads, K) slots, ascending within each row; None means every slot (bulk fetch).
    count: (B,) int32 on the compute device: per batch row, only the first ``count`` rows of each head
        are fetched (a data-dependent number that never goes to the host); None means all K.
    valid: (B, kv_heads, K) bool: selected slots to leave out of attention (e.g. past the last token
        of a page); None means all are attended.
    """

    indices: torch.Tensor | None = None
    count: torch.Tensor | None = None
    valid: torch.Tensor | None = None


class LayerView(Protocol):
    """What a policy may read about the offloaded layer it serves (``OffloadedLayer`` is one)."""

    @property
    def capacity(self) -> int:
        """Slots the layer's buffers have room for: every per-slot buffer is sized by it."""
        ...

    @property
    def used(self) -> int:
        """Slots in use: 0 .. used-1 (fewer than the tokens seen once a full pool evicts)."""
        ...

    @property
    def valid(self) -> torch.Tensor:
        """(B, kv_heads, capacity) bool: the slot holds a cached token (not padding, not unused)."""
        ...

    @property
    def speculator(self) -> LayerSpeculator | None:
        """The layer's partial query and key projections (policies that speculate)."""
        ...

    @property
    def attention(self) -> nn.Module:
        """The layer's attention module (its q projection gives the exact query)."""
        ...

    @property
    def spec(self) -> ModelSpec:
        """The model's attention geometry."""
        ...

    def device_used(self) -> torch.Tensor:
        """``used`` as a (1,) tensor on the device, as a captured selection must read it."""
        ...

    def all_slots(self, n: int) -> torch.Tensor:
        """arange(n) on the device, shared by the cache's layers."""
        ...

    def every_slot(self) -> Selection:
        """A fetch of every cached slot."""
        ...


class RowCodec(Protocol):
    """How a policy stores K/V rows in the CPU pool: rows of ``head_dim`` values become rows of
    ``stored_dim`` elements of the same dtype (bytes reinterpreted), decoded on the compute device."""

    bits_per_value: float  # stored bits per K or V value, overheads included

    def stored_dim(self, head_dim: int, dtype: torch.dtype) -> int: ...

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """(..., head_dim) -> (..., stored_dim), same dtype."""
        ...

    def decode(self, stored: torch.Tensor, out: torch.Tensor) -> None:
        """out (..., head_dim) <- stored (..., stored_dim)."""
        ...


class Policy:
    """Decides where KV lives and, per decode step and offloaded layer, which cached tokens to fetch."""

    name: ClassVar[PolicyName]
    offloads: ClassVar[bool] = True  # False: every layer keeps its whole KV on the compute device
    speculates: ClassVar[bool] = False  # True: needs the artifact and partial keys
    lookahead: ClassVar[bool] = True  # select one layer ahead (from the previous layer); False: at the layer
    observes_attention: ClassVar[bool] = False  # True: ``attended`` receives the attention mass per slot
    budgeted: ClassVar[bool] = False  # True: fetches the ``budget`` share of the cached tokens
    paged: ClassVar[bool] = False  # True: keeps state per fixed group of slots, which a row's padding shifts
    # Every policy's ``select`` and ``stored`` (of a decode token) are pure functions of the layer's
    # state whose shapes depend only on the layer's ``capacity`` (no host syncs, no Python state that
    # changes per step): CUDA graphs capture and replay them.
    codec: RowCodec | None = None
    plain_rows: ClassVar[bool] = True  # no codec: the pool stores rows as computed, in ``kv_bits`` (set below)

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.plain_rows = cls.codec is None  # a flag, for the options that apply only to plain rows

    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config

    @classmethod
    def slot_bytes(cls, config: RuntimeConfig, head_dim: int, itemsize: int, channels: int) -> float:
        """GPU bytes of the state ``stored`` keeps per cached slot of one (batch row, KV head) of an offloaded
        layer (``channels``: the artifact's partial channels, padded): what the memory plan counts."""
        return 0.0

    def select(
        self, layer: LayerView, attention_input: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> Selection:
        """attention_input (B, hidden): with ``lookahead``, the previous layer's residual stream under
        this layer's attention norm (an approximation): the stream entering the previous layer, or
        after its attention (``lookahead_from="attention"`` and the first ``attention_lookahead_layers``
        offloaded layers: ``hooks._reads_input``); otherwise this layer's exact input.
        By default: every cached slot."""
        return layer.every_slot()

    def stored(self, layer: LayerView, slots: slice | torch.Tensor, keys: torch.Tensor) -> None:
        """keys (B, kv_heads, T, d) now cached at ``slots``: a slice of new slots, or (B, kv_heads)
        overwritten slots (T = 1)."""

    def attended(self, layer: LayerView, slots: torch.Tensor | None, mass: torch.Tensor) -> None:
        """mass (B, kv_heads, S): attention probability each attended slot received, summed over the
        step's queries and each KV head's query group; slots (B, kv_heads, S), or None for 0 .. S-1."""
