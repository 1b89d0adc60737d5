"""Switches and probes of ``infinigen bench --breakdown`` and ``infinigen eval --recall``, held by each
``InfinigenCache`` as ``diagnostics``; the defaults change nothing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from infinigen.runtime.layers import OffloadedLayer


@dataclass
class Diagnostics:
    """Switches and probes of ``infinigen bench --breakdown`` and ``infinigen eval --recall``; the
    defaults change nothing.

    - ``move_rows`` False: skip the row moves (a step's compute alone);
    - ``select_rows`` False: each layer refetches its previous selection instead of selecting anew
      (what selecting costs, by difference);
    - ``kept_gathers`` a list: each gather's arguments are appended, to replay them alone (transfer only);
    - ``decode_probe``: called as probe(layer, query (B, H, 1, d)) at each decode attention of an
      offloaded layer.
    """

    move_rows: bool = True
    select_rows: bool = True
    kept_gathers: list[tuple] | None = None
    decode_probe: Callable[[OffloadedLayer, torch.Tensor], None] | None = None
