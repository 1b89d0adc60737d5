"""One layer's row placement (``ResidentRows.place``; ``resident_extra`` 0, and 1: rows of earlier steps
kept; 10% of the context selected; 8 KV heads: the Llama-3-8B shape, 4: a TP = 2 rank of the 70B
shape), replayed from a CUDA graph as the runtime does: one program per (batch row, head) against the
split placement (``placement_splits`` programs per pair), in one process, after checking that both
give the same placement over 8 consecutive steps. Needs CUDA.
(BENCHMARKS.md, "Row reuse".)

    python benchmarks/placement_profile.py
"""

from __future__ import annotations

import itertools

import torch

from infinigen.bench.micro import device_ms
from infinigen.runtime import placement, reuse

SIZES = ((8, 8, 16384), (1, 8, 32768), (1, 8, 131072), (1, 4, 131072))  # (batch, KV heads, context)
STEPS = 8


def selections(batch: int, heads: int, context: int, k: int, generator: torch.Generator) -> list[torch.Tensor]:
    """``STEPS`` top-k selections (B, H, k) of slowly drifting scores: consecutive steps overlap as
    real ones do."""
    scores = torch.rand(batch * heads, context, device="cuda", generator=generator)
    out = []
    for _ in range(STEPS):
        scores += 0.3 * torch.rand(batch * heads, context, device="cuda", generator=generator)
        out.append(scores.topk(k).indices.view(batch, heads, k).contiguous())
    return out


def placed(splits: int, extra: float, batch: int, heads: int, context: int, chosen: list[torch.Tensor]):
    """Fresh resident rows after placing every selection of ``chosen`` with ``splits`` programs per
    pair, and each step's placement."""
    placement.SPLITS = splits
    k = chosen[0].shape[-1]
    rows = reuse.ResidentRows(batch, heads, 128, torch.bfloat16, torch.device("cuda"))
    rows.grow(reuse.resident_positions(k, extra), context)
    everything = torch.ones(batch, heads, k, dtype=torch.bool, device="cuda")
    return rows, [rows.place(indices, everything, extra > 0) for indices in chosen], everything


def same(a: reuse.Placement, b: reuse.Placement) -> bool:
    moved = torch.arange(a.missing.shape[-1], device="cuda") < a.count[..., None]
    return (
        torch.equal(a.count, b.count)
        and torch.equal(a.attend, b.attend)
        and torch.equal(a.missing[moved], b.missing[moved])
        and torch.equal(a.destination[moved], b.destination[moved])
    )


def place_us(rows: reuse.ResidentRows, splits: int, extra: float, chosen: list[torch.Tensor], everything) -> float:
    """Microseconds of one placement with ``splits`` programs per pair, the selections in turn."""
    placement.SPLITS = splits
    step = iter(range(1 << 30))
    return 1e3 * device_ms(lambda: rows.place(chosen[next(step) % STEPS], everything, extra > 0), rows.slots.device)


def main() -> None:
    print(f"{torch.cuda.get_device_name()}; one layer, 10% selected; us per placement")
    columns = ("heads", 5), ("extra", 5), ("positions", 9), ("1 program", 10), ("split", 8), ("programs", 8)
    print(f"{'batch x context':>16}", *(f"{name:>{width}}" for name, width in columns), "same")
    for (batch, heads, context), extra in itertools.product(SIZES, (0.0, 1.0)):
        chosen = selections(batch, heads, context, context // 10, torch.Generator(device="cuda").manual_seed(0))
        positions = reuse.resident_positions(context // 10, extra)
        placement.SPLITS = None
        auto = placement.placement_splits(batch * heads, positions)
        one, one_steps, everything = placed(1, extra, batch, heads, context, chosen)
        row = f"{batch:>5} x {context:<8} {heads:>5} {extra:>5g} {positions:>9}"
        if auto == 1:
            print(f"{row} {place_us(one, 1, extra, chosen, everything):>10.1f}")
            continue
        split, split_steps, _ = placed(auto, extra, batch, heads, context, chosen)
        agree = all(torch.equal(getattr(one, f), getattr(split, f)) for f in ("slots", "position_of", "age"))
        agree &= all(same(a, b) for a, b in zip(one_steps, split_steps, strict=True))
        us_one, us_split = (place_us(r, n, extra, chosen, everything) for r, n in ((one, 1), (split, auto)))
        print(f"{row} {us_one:>10.1f} {us_split:>8.1f} {auto:>8} {agree}")
    placement.SPLITS = None


if __name__ == "__main__":
    main()
