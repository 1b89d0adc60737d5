"""Switches and probes of ``infinigen bench --breakdown`` and ``infinigen eval --recall``, held by each
``InfinigenCache`` as ``diagnostics``; the defaults change nothing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from infinigen.runtime.cache.layers import OffloadedLayer


@dataclass
class Diagnostics:
    move_rows: bool = True  # False: skip the row moves (a step's compute alone)
    # False: each layer refetches its previous selection instead of selecting anew (its cost, by difference)
    select_rows: bool = True
    kept_gathers: list[tuple] | None = None  # a list: every gather's arguments, to replay them alone (transfer only)
    # called as probe(layer, query (B, H, 1, d)) at each decode attention of an offloaded layer
    decode_probe: Callable[[OffloadedLayer, torch.Tensor], None] | None = None
