"""The artifact format shared by prepare (writer) and runtime (reader)."""

from infinigen.artifacts.card import render_card
from infinigen.artifacts.format import (
    Artifact,
    ArtifactError,
    Manifest,
    check_compatible,
    load_artifact,
    read_manifest,
    save_artifact,
)
from infinigen.artifacts.hub import artifact_folder, push_artifact

__all__ = [
    "Artifact",
    "ArtifactError",
    "Manifest",
    "artifact_folder",
    "check_compatible",
    "load_artifact",
    "open_artifact",
    "push_artifact",
    "read_manifest",
    "render_card",
    "save_artifact",
]


def open_artifact(artifact, model) -> Artifact:
    """Load an artifact (folder or Hub id) and check that it was made for ``model``."""
    from infinigen.architectures import fingerprint, model_spec

    loaded = load_artifact(artifact_folder(artifact))
    check_compatible(loaded.manifest, model_spec(model.config), fingerprint(model))
    return loaded
