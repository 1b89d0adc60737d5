"""The one interface every KV selection policy implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from infinigen.runtime.config import RuntimeConfig

if TYPE_CHECKING:
    from infinigen.runtime.layers import OffloadedLayer


@dataclass(frozen=True)
class Selection:
    """Which cached slots one offloaded layer fetches for the next decode step.

    indices: (B, kv_heads, K) slots, ascending within each row; None means every slot (bulk fetch).
    count: (B,) int32 on the compute device: per batch row, only the first ``count`` rows of each head
        are fetched (a data-dependent number that never goes to the host); None means all K.
    """

    indices: torch.Tensor | None = None
    count: torch.Tensor | None = None


class Policy:
    """Decides where KV lives and, per decode step and offloaded layer, which cached tokens to fetch."""

    name: ClassVar[str]
    offloads: ClassVar[bool] = True  # False: every layer keeps its whole KV on the compute device
    speculates: ClassVar[bool] = False  # True: needs the artifact and partial keys
    lookahead: ClassVar[bool] = True  # select one layer ahead (from the previous layer); False: at the layer

    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config

    def select(
        self, layer: OffloadedLayer, attention_input: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> Selection:
        """attention_input (B, hidden): with ``lookahead``, the residual stream entering the previous layer
        under this layer's attention norm (an approximation); otherwise this layer's exact input."""
        return Selection()
