"""Artifact round trip, and every bad artifact fails with one clear error."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from infinigen.artifacts import (
    ArtifactError,
    load_artifact,
    open_artifact,
    render_card,
    save_artifact,
)
from infinigen.artifacts.format import MANIFEST, TENSORS, _sha256
from infinigen.prepare import prepare_artifact


@pytest.fixture
def artifact(tiny):
    return prepare_artifact(tiny("llama"), tokens=128)


@pytest.fixture
def saved(artifact, tmp_path):
    return save_artifact(artifact, tmp_path / "skewed", card=render_card(artifact.manifest))


def test_round_trip(artifact, saved):
    loaded = load_artifact(saved)
    assert loaded.manifest.spec == artifact.manifest.spec
    assert loaded.manifest.energy == artifact.manifest.energy
    assert loaded.manifest.tensors_sha256 == _sha256(saved / TENSORS)
    assert loaded.tensors.keys() == artifact.tensors.keys()
    for name, tensor in artifact.tensors.items():
        assert torch.equal(loaded.tensors[name], tensor), name
    card = (saved / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: infinigen\n") and "| 2 |" in card


def test_manifest_records_provenance(saved):
    manifest = json.loads((saved / MANIFEST).read_text())
    assert manifest["format_version"] == 1
    assert set(manifest["base_model"]) == {"model_id", "revision", "kind", "hub_id", "fingerprint"}
    assert manifest["calibration"]["sources"][0]["tokens"] == manifest["calibration"]["tokens"] == 128
    assert {"infinigen", "torch", "transformers"} <= set(manifest["versions"])
    assert manifest["n_channels"] == 8  # ceil(0.5 * 16)


def test_opens_for_its_own_model(tiny, saved):
    assert open_artifact(saved, tiny("llama").model).manifest.spec["model_type"] == "llama"


def test_refuses_another_model_same_shape(tiny, saved):
    with pytest.raises(ArtifactError, match="another model .*fingerprint"):
        open_artifact(saved, tiny("llama", seed=1).model)


def test_refuses_another_architecture(tiny, saved):
    with pytest.raises(ArtifactError, match="another model .*model_type llama vs opt"):
        open_artifact(saved, tiny("opt").model)


def test_refuses_to_overwrite_without_force(artifact, saved):
    with pytest.raises(ArtifactError, match="already exists"):
        save_artifact(artifact, saved, card="")
    save_artifact(artifact, saved, card="replaced", force=True)
    assert (saved / "README.md").read_text() == "replaced"
    assert [p.name for p in saved.parent.iterdir()] == ["skewed"]


def test_crash_during_write_leaves_nothing(artifact, tmp_path):
    def crash(staging):
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        save_artifact(artifact, tmp_path / "skewed", card="", write_extra=crash)
    assert list(tmp_path.iterdir()) == []


def test_crash_during_forced_replace_keeps_old(artifact, saved):
    def crash(staging):
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        save_artifact(artifact, saved, card="new", force=True, write_extra=crash)
    assert load_artifact(saved).manifest.spec == artifact.manifest.spec
    assert [p.name for p in saved.parent.iterdir()] == ["skewed"]


def test_truncated_tensors(saved):
    data = (saved / TENSORS).read_bytes()
    (saved / TENSORS).write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError, match="corrupted: its checksum"):
        load_artifact(saved)


def _rewrite_tensors(folder, change):
    """Re-save the tensors with ``change`` applied and a matching checksum: only the checks can catch it."""
    tensors = load_file(str(folder / TENSORS))
    change(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / TENSORS))
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["tensors_sha256"] = _sha256(folder / TENSORS)
    (folder / MANIFEST).write_text(json.dumps(manifest))


def test_flipped_shape(saved):
    _rewrite_tensors(saved, lambda t: t.update({"layers.1.skew_matrix": t["layers.1.skew_matrix"][:1]}))
    with pytest.raises(ArtifactError, match=r"layers.1.skew_matrix is \(1, 16, 16\)"):
        load_artifact(saved)


def test_missing_tensor(saved):
    _rewrite_tensors(saved, lambda t: t.pop("layers.2.channels"))
    with pytest.raises(ArtifactError, match="missing \\['layers.2.channels'\\]"):
        load_artifact(saved)


def test_channel_out_of_range(saved):
    _rewrite_tensors(saved, lambda t: t["layers.0.channels"].fill_(99))
    with pytest.raises(ArtifactError, match="outside"):
        load_artifact(saved)


def test_unknown_version(saved):
    manifest = json.loads((saved / MANIFEST).read_text())
    manifest["format_version"] = 99
    (saved / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="unknown artifact format version 99"):
        load_artifact(saved)


def test_corrupted_manifest(saved):
    (saved / MANIFEST).write_text('{"format_version": 1, "spec": ')
    with pytest.raises(ArtifactError, match="not valid JSON"):
        load_artifact(saved)


def test_not_an_artifact(tmp_path):
    with pytest.raises(ArtifactError, match="not an infinigen artifact"):
        load_artifact(tmp_path)
