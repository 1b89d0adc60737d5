"""The artifact format shared by prepare (writer) and runtime (reader)."""

from pathlib import Path

from infinigen.artifacts.card import render_card
from infinigen.artifacts.format import (
    Artifact,
    check_compatible,
    check_tensors,
    load_artifact,
    read_manifest,
    save_artifact,
)
from infinigen.artifacts.hub import artifact_folder, push_artifact
from infinigen.artifacts.manifest import (
    FORMAT_VERSION,
    ArtifactError,
    BaseModelRecord,
    CalibrationRecord,
    CalibrationSource,
    EnergyRow,
    Manifest,
    SpecRecord,
    manifest_from_json,
)

__all__ = [
    "FORMAT_VERSION",
    "Artifact",
    "ArtifactError",
    "BaseModelRecord",
    "CalibrationRecord",
    "CalibrationSource",
    "EnergyRow",
    "Manifest",
    "SpecRecord",
    "artifact_folder",
    "check_compatible",
    "check_tensors",
    "load_artifact",
    "manifest_from_json",
    "open_artifact",
    "push_artifact",
    "read_artifact",
    "read_manifest",
    "render_card",
    "save_artifact",
]


def read_artifact(artifact: str | Path | None) -> Artifact | None:
    """An artifact (folder or Hub id) read before the model loads, so that a missing or corrupted one is
    refused without waiting for the weights; ``open_artifact`` checks it against the model. None: none."""
    return None if artifact is None else load_artifact(artifact_folder(artifact))


def open_artifact(artifact: Artifact | str | Path, model) -> Artifact:
    """An artifact (folder, Hub id, or read already by ``read_artifact``) checked to be made for ``model``."""
    from infinigen.architectures import fingerprint, model_spec, qk_signature

    loaded = artifact if isinstance(artifact, Artifact) else load_artifact(artifact_folder(artifact))
    base = loaded.manifest.base_model
    exact = fingerprint(model)
    # The signature reads every q/k weight once: only needed when the fingerprint differs (another dtype)
    signature = qk_signature(model) if exact != base.fingerprint and base.qk_signature is not None else None
    check_compatible(loaded.manifest, model_spec(model.config), exact, signature)
    return loaded
