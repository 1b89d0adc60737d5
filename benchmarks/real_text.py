"""What the CPU benchmarks on real text share: a model (SmolLM2-135M, the default) with an artifact prepared here."""

from __future__ import annotations

from infinigen.models import load_model
from infinigen.prepare import prepare_artifact


def with_artifact(model: str | None = None):
    """(model, tokenizer, artifact) of ``model`` (None: the default) on the CPU, the artifact from 1,024
    calibration tokens."""
    loaded = load_model(model, device="cpu")
    return loaded.model, loaded.tokenizer, prepare_artifact(loaded, tokens=1024)
