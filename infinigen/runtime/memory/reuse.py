"""Row reuse: an offloaded layer keeps its fetched rows on the GPU from one decode step to the next,
and a step moves only the rows its selection adds (consecutive steps select mostly the same rows:
BENCHMARKS.md, "Row reuse"). ``ResidentRows.place`` keeps every row selected again where it is and
gives the new rows the positions the dropped ones free, so nothing but the new rows moves.

On CUDA the placement runs as Triton kernels (``placement``); elsewhere the same result comes from
PyTorch indexing. Device work only, fixed shapes: it runs inside captured selections. With
``keep_recent`` (``RuntimeConfig.resident_extra``) the positions hold more than the selection: rows
of earlier steps stay until new rows need their places, free places first, then those of the rows
selected least recently (ages saturate at ``AGE_CAP`` steps; ties go in position order, so the
kernels and PyTorch agree exactly).

Whether a cache reuses rows (``decide``, for ``reuse_rows="auto"``) is host arithmetic: what the
resident buffers need at a pool capacity (``resident_bytes``) against the room the memory plan leaves
them at that capacity (``plan.resident_room``, ``room_from``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from infinigen.runtime.kernels import placement
from infinigen.runtime.kernels.buffers import grown_to
from infinigen.runtime.kernels.triton_support import on_triton
from infinigen.runtime.selection.policies import row_bits
from infinigen.runtime.selection.policies.base import rows_bound

PAGE_SLACK = 16  # quest selects whole 16-token pages: up to 15 slots past the budget's share
AGE_CAP = 255  # steps since a row was last selected, saturating: the kernel counts keys in 512 bins


@dataclass(frozen=True)
class Decision:
    on: bool
    reason: str

    def __str__(self) -> str:
        return f"{'on' if self.on else 'off'} ({self.reason})"


def resident_positions(selection: int, extra: float) -> int:
    """Positions of a layer's resident rows for selections of up to ``selection`` slots: the selection,
    and ``extra`` of it again for rows of earlier steps (``RuntimeConfig.resident_extra``)."""
    return selection + math.ceil(extra * selection)


def fallback_extras(extra: float) -> tuple[float, ...]:
    """The ``resident_extra`` values auto reuse tries, most first, where memory is short: the one
    asked, then 1 and 0 where below it (each layer keeps the same share of its selection)."""
    return (extra, *(fewer for fewer in (1.0, 0.0) if fewer < extra))


def resident_bytes(
    batch: int,
    kv_heads: int,
    head_dim: int,
    itemsize: int,
    capacity: int,
    budgets: Sequence[float],
    min_tokens: int,
    extra: float = 0.0,
    kept_bits: int = 16,
) -> int:
    """GPU bytes of every offloaded layer's ``ResidentRows`` at a pool ``capacity`` (slots per
    (batch row, KV head)): each holds a layer's selection, at most its budget's share of the capacity
    (``budgets``: each layer's), and ``extra`` of it again, as K and V rows plus the token's own, with
    a slot and an age per position and a position per slot. One layer's buffers more for the copy
    while one grows. Rows kept 8-bit (``kept_bits``) stay codes, with a float32 scale per row and plane, and
    one buffer of the largest layer's rows in ``itemsize`` bytes takes them dequantised for attention."""
    total, largest, widest = 0, 0, 0
    for budget, layers in Counter(budgets).items():  # layers of one budget hold the same
        positions = resident_positions(rows_bound(budget, capacity, min_tokens) + PAGE_SLACK, extra)
        held = 2 * (positions + 1) * (head_dim + 4 if kept_bits == 8 else head_dim * itemsize)
        layer = batch * kv_heads * (held + 12 * positions + 4 * (capacity + 1))
        total, largest = total + layers * layer, max(largest, layer)
        widest = max(widest, batch * kv_heads * 2 * (positions + 1) * head_dim * itemsize)
    return total + largest + (widest if kept_bits == 8 else 0)


def room_from(planned: int, cap_gb: float | None) -> tuple[int, str]:
    """What auto reuse may take, and how it was chosen: the bytes the memory plan leaves for resident rows
    (``plan.resident_room``), at most ``cap_gb``."""
    described = f"the {planned / 1e9:.2f} GB the memory plan leaves"
    if cap_gb is None or cap_gb * 1e9 > planned:
        return planned, described + ("" if cap_gb is None else f", under the cap of {cap_gb:g} GB")
    return int(cap_gb * 1e9), f"the cap of {cap_gb:g} GB"


def decide(need: int, room: tuple[int, str] | None, extra: float = 0.0) -> Decision:
    """Auto reuse at one capacity: on where the resident rows (``need`` bytes) fit in ``room``. On
    the CPU (no room): on only to attend rows of earlier steps (``extra`` > 0)."""
    if room is None:
        if extra:
            return Decision(True, "auto: CPU, to attend rows of earlier steps as on a GPU")
        return Decision(False, "auto: CPU, no transfers to save")
    limit, described = room
    fits = need <= limit
    return Decision(fits, f"auto: {need / 1e9:.2f} GB {'fits in' if fits else 'exceeds'} {described}")


def initial(config, policy) -> tuple[Decision | None, bool, float, int]:
    """A cache's row reuse before its first decode step (None: a policy without a budget): as asked, off for
    a limited CPU pool (an evicted slot would leave a stale resident row), else auto, decided at the first
    decode fetch; with whether it is auto, the rows of earlier steps it keeps (0 without reuse) and the bits
    it keeps rows in (``RuntimeConfig.resident_bits``; 16 until auto decides)."""
    bits = config.resident_bits or 16
    if not policy.budgeted:
        return None, False, 0.0, bits
    if config.reuse_rows != "auto":
        on = config.reuse_rows == "on"
        return Decision(on, "asked"), False, config.resident_extra_or_default if on else 0.0, bits
    if config.cpu_pool_gb is not None:
        return Decision(False, "auto: limited CPU pool"), False, 0.0, bits
    return Decision(False, "auto: no decode step yet"), True, 0.0, bits


def fallback_settings(extra: float, kv_bits: int, resident_bits: int | None) -> list[tuple[float, int]]:
    """The (``resident_extra``, bits of the rows kept) pairs auto reuse tries, most first: each extra of
    ``fallback_extras``, with 8-bit rows (``kv_bits`` 8) and no ``resident_bits`` asked first kept 16-bit
    (the faster step), then 8-bit (half the memory: where it keeps more rows of earlier steps, fewer move)."""
    bits = (resident_bits,) if resident_bits else (16, 8) if kv_bits == 8 else (16,)
    return [(fewer, b) for fewer in fallback_extras(extra) for b in bits]


def decide_extra(
    need: Callable[[float, int], int], room: tuple[int, str] | None, config
) -> tuple[Decision, float, int]:
    """Auto reuse at one capacity, with as many rows of earlier steps as ``config`` asks and fit
    (``fallback_settings``; ``need``: the resident bytes with that many, kept in those bits), else without
    them, else off: the decision, the extra it keeps and the bits it keeps them in."""
    asked, bits = config.resident_extra_or_default, config.resident_bits
    for extra, kept_bits in fallback_settings(asked, row_bits(config), bits):
        decision = decide(need(extra, kept_bits), room)
        if decision.on:
            break
    notes = []
    if decision.on and extra < asked:
        notes.append(f"with resident_extra {extra:g}" if extra else "without rows of earlier steps")
    if decision.on and kept_bits == 8 and not bits:
        notes.append("kept 8-bit")
    decision = Decision(decision.on, ", ".join([decision.reason, *notes]))
    return decision, extra if decision.on else 0.0, kept_bits


@dataclass(frozen=True)
class Placement:
    missing: torch.Tensor  # (B, H, K) int64: the slots to move, the first ``count`` of each head
    count: torch.Tensor  # (B, H) int32
    destination: torch.Tensor  # (B, H, K) int32: the position each moved row goes to (first ``count``)
    attend: torch.Tensor  # (B, H, P + 1) bool: positions holding a selected row; the last (the token's) False
    held: torch.Tensor  # (B, H) int32: how many (the rows attended), counted as they are placed


class ResidentRows:
    """One offloaded layer's rows on the GPU: ``rows`` (B, H, 2, P + 1, d), the last position for
    the step's own token (8-bit rows: their codes, and ``scales`` (B, H, 2, P + 1)); ``slots`` (B, H, P)
    int64, the slot each position holds (-1: none);
    ``position_of`` (B, H, capacity + 1) int32, each slot's position (-1: not resident; the last
    column takes the writes of no slot), so a placement looks a slot up instead of searching;
    ``age`` (B, H, P) int32, steps since each position's row was last selected (``keep_recent``)."""

    def __init__(
        self, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, int8: bool = False
    ) -> None:
        # 8-bit rows stay as moved: codes here, their float32 scales (B, H, 2, P + 1) in ``scales``
        self.rows = torch.zeros(batch, heads, 2, 1, head_dim, dtype=torch.int8 if int8 else dtype, device=device)
        self.scales = torch.zeros(batch, heads, 2, 1, device=device) if int8 else None
        self.slots = torch.full((batch, heads, 0), -1, dtype=torch.int64, device=device)
        self.position_of = torch.full((batch, heads, 1), -1, dtype=torch.int32, device=device)
        self.age = torch.zeros(batch, heads, 0, dtype=torch.int32, device=device)

    def grow(self, positions: int, capacity: int) -> None:
        """Room for at least ``positions`` rows and ``capacity`` slots (what is held stays)."""
        self.rows = grown_to(self.rows, positions + 1, 3)  # the old token position: a free one (slot -1)
        if self.scales is not None:
            self.scales = grown_to(self.scales, positions + 1, 3)
        self.slots = grown_to(self.slots, positions, 2, fill=-1)
        self.age = grown_to(self.age, positions, 2)
        self.position_of = grown_to(self.position_of, capacity + 1, 2, fill=-1)

    def place(self, indices: torch.Tensor, selected: torch.Tensor, keep_recent: bool = False) -> Placement:
        """The new selection: slots ``indices`` (B, H, K), K <= P, of which ``selected`` (B, H, K)
        are attended (distinct slots). Updates ``slots`` and ``position_of`` so that the valid
        positions hold the selected slots once the missing rows have moved: exactly those, or with
        ``keep_recent`` also the rows of earlier steps that no new row needed the place of."""
        age = self.age if keep_recent else None
        if on_triton(indices.device):
            return _launch_place(self.slots, self.position_of, indices, selected, age)
        if keep_recent:
            return _place_recent(self.slots, self.position_of, self.age, indices, selected)
        return _place(self.slots, self.position_of, indices, selected)


def _place(slots: torch.Tensor, position_of: torch.Tensor, indices: torch.Tensor, selected: torch.Tensor) -> Placement:
    """The placement in PyTorch (the CPU path, and the reference of the kernel's tests)."""
    batch, heads, positions = slots.shape
    k = indices.shape[-1]
    kept, count, missing = _kept_and_missing(slots, position_of, indices, selected)
    order = torch.arange(positions, device=slots.device).expand(batch, heads, positions)
    destination = _compacted(order, ~kept)[..., :k].to(torch.int32)  # free positions, in order
    b, h, p = ((slots >= 0) & ~kept).nonzero(as_tuple=True)  # dropped rows
    position_of[b, h, slots[b, h, p]] = -1
    slots.masked_fill_(~kept, -1)
    b, h, j = (torch.arange(k, device=slots.device) < count[..., None]).nonzero(as_tuple=True)  # moved rows
    slots[b, h, destination[b, h, j].long()] = missing[b, h, j]
    position_of[b, h, missing[b, h, j]] = destination[b, h, j]
    return Placement(missing, count, destination, *_attended(slots))


def _place_recent(
    slots: torch.Tensor, position_of: torch.Tensor, age: torch.Tensor, indices: torch.Tensor, selected: torch.Tensor
) -> Placement:
    """The placement that keeps rows of earlier steps, in PyTorch (the CPU path, and the reference of
    the kernel's tests): the new rows take free positions first, then those of the least recently
    selected rows, in position order; every held row is attended."""
    batch, heads, positions = slots.shape
    k = indices.shape[-1]
    kept, count, missing = _kept_and_missing(slots, position_of, indices, selected)
    age.add_(1).clamp_(max=AGE_CAP).masked_fill_(kept, 0)
    order = torch.arange(positions, device=slots.device).expand(batch, heads, positions)
    # the places new rows take: the ``count`` largest keys (free, then oldest; ties by position)
    key = torch.where(slots < 0, AGE_CAP + 1, age).masked_fill(kept, -1)
    by_key = key.argsort(dim=-1, descending=True, stable=True)
    taken = torch.zeros_like(kept).scatter_(-1, by_key, order < count[..., None])
    destination = _compacted(order, taken)[..., :k]  # (B, H, K): taken positions, in order
    moved = torch.arange(k, device=slots.device) < count[..., None]
    target = torch.where(moved, destination, positions)  # position P: a column that is dropped
    held = torch.cat([slots, slots.new_full((batch, heads, 1), -1)], dim=-1)
    slots.copy_(held.scatter_(-1, target, torch.where(moved, missing, -1))[..., :positions])
    age.masked_fill_(taken, 0)
    capacity = position_of.shape[-1] - 1
    position_of.fill_(-1).scatter_(-1, torch.where(slots >= 0, slots, capacity), order.to(torch.int32))
    position_of[..., capacity] = -1
    return Placement(missing, count, destination.to(torch.int32), *_attended(slots))


def _attended(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both placements' ``attend`` (the held positions, then the token's, False) and ``held``."""
    held = slots >= 0
    return torch.cat([held, held.new_zeros(*held.shape[:2], 1)], dim=-1), held.sum(dim=-1, dtype=torch.int32)


def _kept_and_missing(
    slots: torch.Tensor, position_of: torch.Tensor, indices: torch.Tensor, selected: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What both placements start from: ``kept`` (B, H, P) bool, the positions holding a row selected
    again; ``count`` (B, H) int32, the selected rows not resident; ``missing`` (B, H, K), those slots first."""
    batch, heads, positions = slots.shape
    at = position_of.gather(-1, indices)  # (B, H, K): where each slot is now, -1: not resident
    moving = selected & (at < 0)
    kept = torch.zeros(batch, heads, positions + 1, dtype=torch.bool, device=slots.device)
    kept.scatter_(-1, torch.where(selected & (at >= 0), at, positions).long(), True)
    return kept[..., :positions], moving.sum(dim=-1, dtype=torch.int32), _compacted(indices, moving)


def _compacted(values: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """(B, H, N) values where ``chosen``, moved to the front in order; the rest unspecified."""
    n = values.shape[-1]
    rank = torch.where(chosen, chosen.cumsum(dim=-1) - 1, n)
    out = values.new_zeros(*values.shape[:-1], n + 1)
    return out.scatter_(-1, rank, values)[..., :n]


def _launch_place(
    slots: torch.Tensor,
    position_of: torch.Tensor,
    indices: torch.Tensor,
    selected: torch.Tensor,
    age: torch.Tensor | None = None,
) -> Placement:
    """``_place`` on CUDA, or with ``age`` given ``_place_recent``: the kernels of ``placement``."""
    return Placement(*placement.launch(slots, position_of, indices, selected, age, AGE_CAP))
