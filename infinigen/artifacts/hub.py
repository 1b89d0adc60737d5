"""Artifacts on the Hugging Face Hub: push a folder, resolve a Hub id to a local copy."""

from __future__ import annotations

import sys
from pathlib import Path

from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import HFValidationError

from infinigen.artifacts.format import load_artifact
from infinigen.artifacts.manifest import ArtifactError


def _hub_errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises when the Hub is unreachable or refuses. OSError covers offline mode
    (OfflineModeIsEnabled), HfHubHTTPError, a missing token (LocalTokenNotFoundError), cache misses
    and requests' errors; HFValidationError a malformed repo id. The httpx errors of huggingface_hub
    >= 1.0 (a connection refused, a timeout) are no OSError: those of the client it imported."""
    errors: list[type[BaseException]] = [OSError, HFValidationError]
    for client in ("httpx", "httpx2"):
        error = getattr(sys.modules.get(client), "HTTPError", None)
        if isinstance(error, type) and issubclass(error, BaseException):
            errors.append(error)
    return tuple(errors)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def push_artifact(folder: str | Path, repo_id: str, *, private: bool = False, token: str | None = None) -> str:
    """Check the artifact, create the model repo if needed, upload the folder; returns the commit URL."""
    load_artifact(folder)  # never publish a broken artifact
    try:
        api = HfApi(token=token)
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        commit = api.upload_folder(
            folder_path=str(folder),
            repo_id=repo_id,
            repo_type="model",
            commit_message="Upload InfiniGen skew artifact",
            allow_patterns=["*.json", "*.safetensors", "*.md"],
        )
    except _hub_errors() as exc:
        raise ArtifactError(f"push to {repo_id} failed: {_first_line(exc)}") from exc
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
    except _hub_errors() as exc:
        raise ArtifactError(f"artifact {text!r} not found locally or on the Hub: {_first_line(exc)}") from exc
