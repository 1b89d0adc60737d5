"""Artifacts on the Hugging Face Hub: push a folder, resolve a Hub id to a local copy."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

from infinigen.artifacts.format import ArtifactError, load_artifact


def push_artifact(folder: str | Path, repo_id: str, *, private: bool = False, token: str | None = None) -> str:
    """Check the artifact, create the model repo if needed, upload the folder; returns the commit URL."""
    load_artifact(folder)  # never publish a broken artifact
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        commit = api.upload_folder(
            folder_path=str(folder),
            repo_id=repo_id,
            repo_type="model",
            commit_message="Upload InfiniGen skew artifact",
            allow_patterns=["*.json", "*.safetensors", "*.md"],
        )
    except HfHubHTTPError as exc:
        raise ArtifactError(f"push to {repo_id} failed: {str(exc).splitlines()[0]}") from exc
    return str(getattr(commit, "commit_url", commit))


def artifact_folder(artifact: str | Path) -> Path:
    """A local artifact folder as is; otherwise a Hub id, fetched through huggingface_hub's cache."""
    path = Path(artifact).expanduser()
    if path.exists():
        return path
    text = str(artifact)
    if text.count("/") != 1 or text.startswith((".", "/")):
        raise ArtifactError(f"artifact {text!r} not found: give an artifact folder or a Hub id (user/name)")
    try:
        return Path(snapshot_download(text, repo_type="model"))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        raise ArtifactError(f"artifact {text!r} not found locally or on the Hub: {str(exc).splitlines()[0]}") from exc
