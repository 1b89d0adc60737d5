"""Adaptive budgets: the same fetched tokens, spent on the layers whose attention needs them.

``prepare`` measures, per layer and KV head, the attention mass that the exact top tokens miss at
a grid of fractions of the context (the artifact's ``missed_mass``). For a budget b,
``layer_budgets`` gives each offloaded layer a fraction f_l, their mean b, minimising the summed
missed mass: every curve is replaced by its lower convex hull, and the hull segments that save the
most mass per token are taken first (exact for piecewise-linear convex curves).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import numpy as np
import torch

# No layer gets less than this share of the budget: the statistics come from a few thousand tokens
# of calibration text, and a layer that looked concentrated there may not be on other text.
FLOOR = 0.25


def _hull(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The lower convex hull of (fraction, missed) points sorted by fraction (Andrew's monotone chain)."""
    hull: list[tuple[float, float]] = []
    for x, y in points:
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (x2 - x1) * (y - y1) - (y2 - y1) * (x - x1) > 0:  # the middle point lies on or below: keep it
                break
            hull.pop()
        hull.append((x, y))
    return hull


def layer_budgets(missed: torch.Tensor, fractions: torch.Tensor, budget: float) -> list[float]:
    """missed (units, F): each unit's (layer's) missed attention mass at ``fractions`` (F,) ascending
    -> one fraction per unit in [FLOOR * budget, 1], their mean ``budget``."""
    units = missed.shape[0]
    if budget >= 1:
        return [1.0] * units
    floor = FLOOR * budget
    grid, curves = fractions.tolist(), missed.double().tolist()
    segments = []  # (saved mass per fraction (negative slope), unit, width)
    for unit, curve in enumerate(curves):
        # linear between grid points, constant outside the grid
        points = [(floor, float(np.interp(floor, grid, curve)))]
        points += [(x, y) for x, y in zip(grid, curve, strict=True) if floor < x < 1]
        points.append((1.0, float(np.interp(1.0, grid, curve))))
        hull = _hull(points)
        segments += [((y2 - y1) / (x2 - x1), unit, x2 - x1) for (x1, y1), (x2, y2) in pairwise(hull)]
    share = [floor] * units
    left = units * (budget - floor)
    segments.sort(key=lambda segment: segment[0])
    start = 0
    while start < len(segments) and left > 0:
        # segments of equal slope share what is left in proportion to their widths (an even split of
        # equal curves, never the first unit first)
        end = start
        while end < len(segments) and segments[end][0] == segments[start][0]:
            end += 1
        width = sum(segment[2] for segment in segments[start:end])
        taken = min(1.0, left / width)
        for _, unit, segment_width in segments[start:end]:
            share[unit] += taken * segment_width
        left -= taken * width
        start = end
    return [min(1.0, value) for value in share]


def offloaded_budgets(budget: float, allocation: str, artifact, layers: Sequence[int]) -> tuple[list[float], str]:
    """Each offloaded layer's budget (``layers``: their indices), and the allocation that gave them:
    "adaptive" needs an artifact with attention statistics (version 2); without one it is uniform."""
    if allocation == "uniform" or artifact is None or not layers or artifact.missed_mass(layers[0]) is None:
        return [budget] * len(layers), "uniform"
    missed = torch.stack([artifact.missed_mass(i).mean(dim=0) for i in layers])  # (layers, F): heads averaged
    fractions = torch.tensor(artifact.manifest.missed_mass_fractions)
    return layer_budgets(missed, fractions, budget), "adaptive"
