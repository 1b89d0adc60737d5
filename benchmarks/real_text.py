"""What the CPU benchmarks on real text share: SmolLM2-135M (the default model) with an artifact prepared here."""

from __future__ import annotations

from infinigen.models import load_model
from infinigen.prepare import prepare_artifact


def smollm2_with_artifact():
    """(model, tokenizer, artifact) of the default model on the CPU, the artifact from 1,024 calibration tokens."""
    loaded = load_model(None, device="cpu")
    return loaded.model, loaded.tokenizer, prepare_artifact(loaded, tokens=1024)
