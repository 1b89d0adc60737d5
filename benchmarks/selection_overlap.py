"""How much of each offloaded layer's selection at a decode step was already selected at the step
before: the rows a fetch that kept the previous step's rows on the GPU would not move again.
Greedy decoding of a real model through the runtime (CPU is enough), every offloaded layer's
fetched-and-attended slots compared with its previous step's.

    python benchmarks/selection_overlap.py ARTIFACT BOOK.txt 8000 64     # artifact, text, context, steps
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import torch

import infinigen
from infinigen.runtime import cache_argument, cache_for
from infinigen.runtime.layers import OffloadedLayer

SETTINGS = {
    "alpha (the paper's), budget 0.2": dict(budget=0.2),
    "fixed 10%": dict(budget=0.1, alpha=float("inf")),
    "fixed 20%": dict(budget=0.2, alpha=float("inf")),
}


class KeptRows:
    """A decode probe: per layer, the selected rows that were selected at the step before."""

    def __init__(self) -> None:
        self.previous: dict[int, torch.Tensor] = {}
        self.kept: dict[int, float] = defaultdict(float)
        self.selected: dict[int, float] = defaultdict(float)

    def __call__(self, layer: OffloadedLayer, query: torch.Tensor) -> None:
        fetched = layer.decoding
        chosen = fetched.valid[:, :, :-1]  # (B, kv_heads, K), the last entry is the current token
        hits = torch.zeros(*chosen.shape[:2], layer.capacity + 1, dtype=torch.int32, device=chosen.device)
        current = hits.scatter_add_(-1, fetched.indices, chosen.int()) > 0  # (B, kv_heads, slots)
        previous = self.previous.get(layer.index)
        if previous is not None:
            n = min(previous.shape[-1], current.shape[-1])
            self.kept[layer.index] += float((current[..., :n] & previous[..., :n]).sum())
            self.selected[layer.index] += float(current.sum())
        self.previous[layer.index] = current


def main(artifact: str, text: str, context: int, steps: int) -> None:
    model, tokenizer = infinigen.load(None, artifact=artifact, device="cpu", dtype="float32")
    passage = Path(text).read_text()
    ids = tokenizer(passage, return_tensors="pt").input_ids[:, 2000 : 2000 + context]  # past a book's front matter
    for label, settings in SETTINGS.items():
        cache = cache_for(model, **settings)
        cache.diagnostics.decode_probe = probe = KeptRows()
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                max_new_tokens=steps,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
                **{cache_argument(model): cache},
            )
        layers = sorted(probe.selected)
        share = {i: probe.kept[i] / probe.selected[i] for i in layers}
        overall = sum(probe.kept.values()) / sum(probe.selected.values())
        print(f"{label}: fetched {cache.summary()['fraction_fetched']}, kept from the step before {overall:.3f}")
        spread = f"{min(share.values()):.3f}-{max(share.values()):.3f}"
        print(f"  first offloaded layer {share[layers[0]]:.3f}, every layer {spread}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
