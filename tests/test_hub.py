"""Hub push and pull, with huggingface_hub's network calls replaced (tests cannot reach the Hub)."""

from __future__ import annotations

import shutil
import sys
from types import SimpleNamespace

import pytest
import requests
from huggingface_hub import HfApi, constants
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalTokenNotFoundError

import infinigen.artifacts.hub
from infinigen.artifacts import ArtifactError, artifact_folder, load_artifact, push_artifact, render_card, save_artifact
from infinigen.prepare import prepare_artifact


@pytest.fixture
def saved(tiny, tmp_path):
    artifact = prepare_artifact(tiny("qwen2"), tokens=64)
    return save_artifact(artifact, tmp_path / "skewed", card=render_card(artifact.manifest))


def test_push_creates_repo_and_uploads_folder(saved, monkeypatch):
    calls = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: calls.append(("create", repo_id, kw)))

    def upload_folder(self, **kw):
        calls.append(("upload", kw["repo_id"], kw))
        return SimpleNamespace(commit_url=f"https://huggingface.co/{kw['repo_id']}/commit/abc")

    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    url = push_artifact(saved, "me/tiny-infinigen", private=True)
    assert url == "https://huggingface.co/me/tiny-infinigen/commit/abc"
    (create, _, create_kw), (upload, _, upload_kw) = calls
    assert create == "create" and create_kw["private"] is True and create_kw["exist_ok"] is True
    assert upload == "upload" and upload_kw["folder_path"] == str(saved) and upload_kw["repo_type"] == "model"


def test_push_refuses_a_broken_artifact(saved, monkeypatch):
    monkeypatch.setattr(HfApi, "create_repo", lambda *a, **k: pytest.fail("must not reach the Hub"))
    (saved / "skew.safetensors").write_bytes(b"garbage")
    with pytest.raises(ArtifactError, match="corrupted"):
        push_artifact(saved, "me/broken")


def test_pull_from_local_hub_cache(saved, tmp_path, monkeypatch):
    """A Hub id resolves through huggingface_hub's cache (here: offline, pre-populated)."""
    cache = tmp_path / "hub"
    repo = cache / "models--me--tiny-infinigen"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(saved, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    folder = artifact_folder("me/tiny-infinigen")
    assert folder == repo / "snapshots" / commit
    assert load_artifact(folder).manifest.spec["model_type"] == "qwen2"


def test_pull_unknown_hub_id_offline(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ArtifactError, match="'me/nothing' not found locally or on the Hub"):
        artifact_folder("me/nothing")


def test_missing_local_folder_is_not_a_hub_id(tmp_path):
    with pytest.raises(ArtifactError, match="not found"):
        artifact_folder(str(tmp_path / "nope" / "skewed"))


def _client():
    """huggingface_hub's HTTP client module (httpx; httpx2 in some releases): its errors are no OSError."""
    return sys.modules[next(base.__module__ for base in HfHubHTTPError.__mro__ if base.__name__ == "HTTPError")]


def _http_403():
    client = _client()
    request = client.Request("POST", "https://huggingface.co/api/repos/create")
    return HfHubHTTPError(
        "403 Forbidden: you have no write access\nmore detail", response=client.Response(403, request=request)
    )


HUB_FAILURES = {  # what huggingface_hub raises without network, token or rights -> the first line we show
    "connection-refused": (lambda: _client().ConnectError("[Errno 111] Connection refused"), "Connection refused"),
    "timeout": (lambda: _client().ReadTimeout("The read operation timed out"), "timed out"),
    "empty-message": (lambda: _client().ConnectError(""), "ConnectError"),
    "requests": (
        lambda: requests.ConnectionError("HTTPSConnectionPool(host='huggingface.co'): Max retries\n(caused by ...)"),
        "Max retries",
    ),
    "no-token": (
        lambda: LocalTokenNotFoundError("Token is required (`token=True`), but no token found.\nRun `hf auth login`"),
        "no token found",
    ),
    "http-403": (_http_403, "403 Forbidden: you have no write access"),
    "bad-repo-id": (lambda: HFValidationError("Repo id must use alphanumeric chars"), "alphanumeric"),
}


@pytest.mark.parametrize("failure", HUB_FAILURES)
def test_push_failures_are_one_line(saved, monkeypatch, failure):
    make, shown = HUB_FAILURES[failure]

    def create_repo(self, repo_id, **kw):
        raise make()

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    with pytest.raises(ArtifactError, match="push to me/tiny-infinigen failed: ") as refused:
        push_artifact(saved, "me/tiny-infinigen")
    assert shown in str(refused.value) and "\n" not in str(refused.value)


def test_push_offline(saved, monkeypatch):
    """HF_HUB_OFFLINE=1 as huggingface_hub reads it: its request hook refuses before any connection."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ArtifactError, match="push to me/tiny-infinigen failed: .*offline mode is enabled") as refused:
        push_artifact(saved, "me/tiny-infinigen", token="hf_not_a_real_token")
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("failure", HUB_FAILURES)
def test_pull_failures_are_one_line(monkeypatch, failure):
    make, shown = HUB_FAILURES[failure]

    def snapshot_download(repo_id, **kw):
        raise make()

    monkeypatch.setattr(infinigen.artifacts.hub, "snapshot_download", snapshot_download)
    with pytest.raises(ArtifactError, match="artifact 'me/nothing' not found locally or on the Hub: ") as refused:
        artifact_folder("me/nothing")
    assert shown in str(refused.value) and "\n" not in str(refused.value)
