"""Adaptive budgets: the attention statistics prepare measures, the per-layer split of a budget, and
artifacts with (version 2) and without (version 1) the statistics."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from helpers import tiny_setup

from infinigen.artifacts import Artifact, load_artifact, render_card, save_artifact
from infinigen.artifacts.format import MANIFEST
from infinigen.prepare.attention_stats import FRACTIONS, missed_mass
from infinigen.runtime import cache_argument, cache_for
from infinigen.runtime.selection.allocation import FLOOR, layer_budgets, offloaded_budgets

GRID = torch.tensor(FRACTIONS)


def curves(*rates: float) -> torch.Tensor:
    """Missed mass falling as exp(-rate * 100 f): a larger rate, a more concentrated attention."""
    return torch.exp(-torch.tensor(rates)[:, None] * GRID[None, :] * 100)


@pytest.mark.parametrize("budget", [0.02, 0.05, 0.1, 0.2, 0.5, 0.9])
def test_budgets_average_to_the_budget_within_bounds(budget):
    shares = layer_budgets(curves(0.3, 1, 2, 5, 20, 80), GRID, budget)
    assert math.isclose(sum(shares) / len(shares), budget, rel_tol=1e-9)
    assert all(FLOOR * budget - 1e-12 <= share <= 1 for share in shares)


def test_spread_attention_gets_more_and_equal_curves_split_evenly():
    shares = layer_budgets(curves(0.5, 2, 8), GRID, 0.1)
    assert shares[0] > shares[1] > shares[2]
    assert layer_budgets(curves(2, 2, 2, 2), GRID, 0.1) == pytest.approx([0.1] * 4)
    assert layer_budgets(torch.zeros(3, len(FRACTIONS)), GRID, 0.1) == pytest.approx([0.1] * 3)
    assert layer_budgets(curves(0.5, 8), GRID, 1.0) == [1.0, 1.0]  # dense: every layer everything


def test_missed_mass_is_the_exact_top_k_tail():
    """Against a direct count: per KV head, the group's mean attention outside its best ceil(f * n)
    tokens (ranked by the group's best logit), averaged over the sampled queries."""
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(4, 64, 8, generator=generator), torch.randn(2, 64, 8, generator=generator)
    curve = missed_mass([(q, k)], scaling=0.5)
    assert curve.shape == (2, len(FRACTIONS))
    assert bool((curve[:, 1:] <= curve[:, :-1] + 1e-6).all()) and torch.allclose(curve[:, -1], torch.zeros(2))
    positions = torch.linspace(32, 63, 64).round().long().unique()
    f = FRACTIONS.index(0.125)
    expected = torch.zeros(2)
    for head in range(2):
        for t in positions.tolist():
            logits = 0.5 * q[2 * head : 2 * head + 2, t] @ k[head, : t + 1].T  # (group, t + 1)
            mass = logits.softmax(-1).mean(0)
            best = logits.amax(0).argsort(descending=True, stable=True)[: math.ceil(0.125 * (t + 1))]
            expected[head] += 1 - mass[best].sum()
    torch.testing.assert_close(curve[:, f], expected / len(positions), atol=1e-5, rtol=0)
    assert missed_mass([(q[:, :8], k[:, :8])], scaling=0.5) is None  # too short to say anything


def test_version_two_round_trip_and_adaptive_budgets(tokenizer, tmp_path):
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    saved = save_artifact(artifact, tmp_path / "v2", card=render_card(artifact.manifest))
    assert json.loads((saved / MANIFEST).read_text())["format_version"] == 2
    loaded = load_artifact(saved)
    assert loaded.manifest.missed_mass_fractions == FRACTIONS
    for i in range(3):
        assert torch.equal(loaded.missed_mass(i), artifact.missed_mass(i))
    with cache_for(model, loaded, budget=0.3, dense_layers=1) as cache:
        assert cache.allocation == "adaptive" and math.isclose(sum(cache.layer_budgets) / 2, 0.3)
        assert [layer.policy.config.budget for layer in cache.offloaded] == cache.layer_budgets
    with cache_for(model, loaded, budget=0.3, allocation="uniform", dense_layers=1) as cache:
        assert cache.layer_budgets == [0.3, 0.3]


def test_version_one_artifacts_load_and_run_uniform(tokenizer, tmp_path):
    """An artifact without attention statistics is written and read as version 1; adaptive
    allocation falls back to the uniform budget, and the summary says so. It runs under the default
    8-bit rows (their key factors come from the prompt, not the artifact)."""
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    manifest = dataclasses.replace(artifact.manifest, missed_mass_fractions=())
    tensors = {name: t for name, t in artifact.tensors.items() if not name.endswith(".missed_mass")}
    saved = save_artifact(Artifact(manifest, tensors), tmp_path / "v1", card=render_card(manifest))
    assert json.loads((saved / MANIFEST).read_text())["format_version"] == 1
    loaded = load_artifact(saved)
    assert loaded.missed_mass(2) is None
    assert offloaded_budgets(0.3, "adaptive", loaded, range(1, 3)) == ([0.3, 0.3], "uniform")
    with cache_for(model, loaded, budget=0.3) as cache:
        model(torch.randint(3, 512, (1, 24)), **{cache_argument(model): cache})
        model(torch.randint(3, 512, (1, 1)), **{cache_argument(model): cache})
        assert cache.summary()["allocation"] == "uniform" and cache.summary()["kv_bits"] == 8


def test_statistics_out_of_range_are_refused(tokenizer, tmp_path):
    from infinigen.artifacts import ArtifactError

    _, artifact = tiny_setup(tokenizer, "llama", "cpu")
    artifact.tensors["layers.1.missed_mass"] = artifact.tensors["layers.1.missed_mass"] + 2
    with pytest.raises(ArtifactError, match="layers.1.missed_mass holds attention mass outside"):
        save_artifact(artifact, tmp_path / "bad", card="")
