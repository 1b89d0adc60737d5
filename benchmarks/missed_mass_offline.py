"""How much attention mass infinigen's selection misses, per selection rule, with the true queries
(no one-layer-ahead speculation): one forward of a PG-19 passage, every layer's post-RoPE q and k
captured, and at the last 256 positions (every 8th) the budget's share of the tokens chosen by

- oracle: the exact group max of the logits (what ``oracle`` fetches);
- art16 / art4: the artifact's skew and kept channels, partial keys at 16 bits / the runtime's 4-bit codes;
- cent16 / cent4: the kept channels chosen on this passage by centred score energy (an upper bound
  for a better channel rule);
- artc4: the artifact's channels, 4-bit codes of the keys minus the passage's first-half mean.

Printed per offloaded layer and on average; lower is better.

    python benchmarks/missed_mass_offline.py MODEL|default ARTIFACT BUDGET [TOKENS]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from infinigen.artifacts.format import load_artifact
from infinigen.models import load_model
from infinigen.prepare.capture import capture_qk
from infinigen.runtime.scoring import code_values, quantize_rows

RULES = ("oracle", "art16", "art4", "cent16", "cent4", "artc4")


def rounded(keys: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 16:
        return keys
    codes, scale = quantize_rows(keys, bits)
    return code_values(codes).float() * scale[..., None]


def missed(probabilities: torch.Tensor, scores: torch.Tensor, k: int) -> float:
    """probabilities (G, n): each query head's attention; scores (n,): the KV head's selection scores."""
    return float(1 - probabilities[:, scores.topk(k).indices].sum(-1).mean())


def layer_missed(q, k, skew, channels, scaling: float, budget: float, positions) -> dict[str, float]:
    """q (heads, T, d), k (kv_heads, T, d) of one layer -> mean missed mass per rule."""
    heads, tokens, d = q.shape
    group = heads // k.shape[0]
    row = {rule: [] for rule in RULES}
    for h in range(k.shape[0]):
        queries = q[h * group : (h + 1) * group]
        skewed_q, skewed_k = queries @ skew[h], k[h] @ skew[h]
        centred = skewed_k - skewed_k.mean(0)
        energy = skewed_q.reshape(-1, d).pow(2).sum(0) * centred.pow(2).sum(0)
        centred_channels = energy.topk(len(channels[h])).indices.sort().values
        shift = skewed_k[: tokens // 2].mean(0)
        for t in positions:
            n = t + 1
            keep = max(8, int(budget * n))
            logits = (queries[:, t] @ k[h, :n].T) * scaling  # (G, n)
            probabilities = logits.softmax(-1)
            row["oracle"].append(missed(probabilities, logits.amax(0), keep))
            for name, kept, offset in (
                ("art", channels[h], None),
                ("cent", centred_channels, None),
                ("artc", channels[h], shift),
            ):
                keys = skewed_k[:n, kept] if offset is None else (skewed_k[:n] - offset)[:, kept]
                for bits in (16, 4):
                    if f"{name}{bits}" in row:
                        scores = (skewed_q[:, t, kept] @ rounded(keys, bits).T).amax(0)
                        row[f"{name}{bits}"].append(missed(probabilities, scores, keep))
    return {rule: sum(values) / len(values) for rule, values in row.items()}


def captured_passage(model_name: str, artifact_path: str, tokens: int):
    """The model's decoder layers, the artifact, and every layer's post-RoPE (q, k) over ``tokens``
    tokens of PG-19 book 10321 (one forward, CPU, float32)."""
    loaded = load_model(None if model_name == "default" else model_name, device="cpu", dtype="float32")
    text = Path("../shared/data/pg19/10321.txt").read_text(encoding="utf-8")
    ids = loaded.tokenizer(text[30000:], return_tensors="pt").input_ids[:, :tokens]
    with torch.no_grad(), capture_qk(loaded.model) as records:
        loaded.model(input_ids=ids, use_cache=False)
        captured = dict(records)
    return loaded.model.model.layers, load_artifact(artifact_path), captured


def main(model_name: str, artifact_path: str, budget: float, tokens: int = 3072) -> None:
    layers, artifact, captured = captured_passage(model_name, artifact_path, tokens)
    totals = {rule: [] for rule in RULES}
    for i in range(2, len(layers)):  # the first two layers stay on the GPU
        ((q, k),) = captured[i]
        row = layer_missed(
            q,
            k,
            artifact.skew_matrix(i),
            artifact.channels(i),
            layers[i].self_attn.scaling,
            budget,
            range(tokens - 256, tokens, 8),
        )
        for rule in RULES:
            totals[rule].append(row[rule])
        print(i, " ".join(f"{rule}={row[rule]:.3f}" for rule in RULES), flush=True)
    print("mean", " ".join(f"{rule}={sum(v) / len(v):.3f}" for rule, v in totals.items()))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), *(int(a) for a in sys.argv[4:5]))
