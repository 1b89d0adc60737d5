"""The attention mass a speculated selection misses when a layer's rows are split evenly over its KV
heads or by mass (``head_split``), with the true queries: one forward of a PG-19 passage, every
layer's q and k captured, and at the last 256 positions (every 16th) the budget's share chosen by

- oracle-even / oracle-mass: the exact logits, each head its top k / the layer's best by summed
  group probability (at most 1.5 k a head);
- spec-even: the artifact's 4-bit partial keys, each head its top k by group max logit (``even``);
- spec-sum-even: the same, ranked by the group's summed partial softmax;
- spec-mass: ranked and split by it (``mass``).

    python benchmarks/missed_mass_heads.py MODEL|default ARTIFACT BUDGET [TOKENS]
"""

from __future__ import annotations

import sys

import torch
from missed_mass_offline import captured_passage, rounded

CAP = 1.5


def split_by_mass(values: torch.Tensor, keep: int) -> list[torch.Tensor]:
    """values (heads, n) -> each head's slots: the layer's keep * heads largest, at most CAP * keep a head."""
    heads, n = values.shape
    limit = min(n, int(CAP * keep))
    top = values.topk(limit, dim=-1)
    taken = top.values.flatten().topk(keep * heads).indices
    counts = torch.bincount(taken // limit, minlength=heads)
    return [top.indices[h, : counts[h]] for h in range(heads)]


def main(model_name: str, artifact_path: str, budget: float, tokens: int = 3072) -> None:
    layers, artifact, captured = captured_passage(model_name, artifact_path, tokens)
    totals: dict[str, list[float]] = {}
    for i in range(2, len(layers)):  # the first two layers stay on the GPU
        ((q, k),) = captured[i]
        heads, length, _ = q.shape
        kv_heads = k.shape[0]
        group, skew, channels = heads // kv_heads, artifact.skew_matrix(i), artifact.channels(i)
        scaling = layers[i].self_attn.scaling
        row: dict[str, list[float]] = {}
        for t in range(length - 256, length, 16):
            n, keep = t + 1, max(8, int(budget * (t + 1)))
            probabilities, true_mass, logits_max, partial_max, partial_mass = [], [], [], [], []
            for h in range(kv_heads):
                queries = q[h * group : (h + 1) * group, t]  # (group, d)
                logits = (queries @ k[h, :n].T) * scaling
                probabilities.append(logits.softmax(-1))
                true_mass.append(probabilities[-1].sum(0))
                logits_max.append(logits.amax(0))
                kept = channels[h]
                partial = ((queries @ skew[h])[:, kept] @ rounded((k[h, :n] @ skew[h])[:, kept], 4).T) * scaling
                partial_max.append(partial.amax(0))
                partial_mass.append(partial.softmax(-1).sum(0))
            rules = {
                "oracle-even": [s.topk(keep).indices for s in logits_max],
                "oracle-mass": split_by_mass(torch.stack(true_mass), keep),
                "spec-even": [s.topk(keep).indices for s in partial_max],
                "spec-sum-even": [s.topk(keep).indices for s in partial_mass],
                "spec-mass": split_by_mass(torch.stack(partial_mass), keep),
            }
            for name, chosen in rules.items():
                caught = sum(float(probabilities[h][:, chosen[h]].sum()) for h in range(kv_heads))
                row.setdefault(name, []).append(1 - caught / heads)
        for name, values in row.items():
            totals.setdefault(name, []).append(sum(values) / len(values))
        print(i, " ".join(f"{name}={sum(v) / len(v):.3f}" for name, v in row.items()), flush=True)
    print("mean", " ".join(f"{name}={sum(v) / len(v):.4f}" for name, v in totals.items()))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), *(int(a) for a in sys.argv[4:5]))
