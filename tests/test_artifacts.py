"""Artifact round trip, and every bad artifact fails with one clear error."""

from __future__ import annotations

import dataclasses
import json
import os
import stat

import pytest
import torch
from safetensors.torch import load_file, save_file

from infinigen.architectures import decoder_layers, fingerprint
from infinigen.artifacts import (
    ArtifactError,
    load_artifact,
    open_artifact,
    render_card,
    save_artifact,
)
from infinigen.artifacts.format import MANIFEST, TENSORS, _sha256
from infinigen.artifacts.manifest import DEFAULT_METHOD
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
    assert manifest["format_version"] == 2 and len(manifest["missed_mass_fractions"]) == 25
    assert set(manifest["base_model"]) == {"model_id", "revision", "kind", "hub_id", "fingerprint", "qk_signature"}
    assert len(manifest["base_model"]["qk_signature"]) == manifest["spec"]["n_layers"] == 3
    assert manifest["calibration"]["sources"][0]["tokens"] == manifest["calibration"]["tokens"] == 128
    assert {"infinigen", "torch", "transformers"} <= set(manifest["versions"])
    assert manifest["n_channels"] == 8  # ceil(0.5 * 16)


def test_opens_for_its_own_model(tiny, saved):
    assert open_artifact(saved, tiny("llama").model).manifest.spec["model_type"] == "llama"


def test_refuses_another_model_same_shape(tiny, saved):
    with pytest.raises(ArtifactError, match="another model .*q/k weights differ, layer 0"):
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


@pytest.fixture
def saved_for(tiny, tmp_path):
    """A saved float32 artifact of the tiny ``arch`` model (seed 0)."""

    def make(arch: str):
        artifact = prepare_artifact(tiny(arch), tokens=64)
        return save_artifact(artifact, tmp_path / f"skewed-{arch}", card=render_card(artifact.manifest))

    return make


def _nan_at_first(tensor):
    tensor.view(-1)[0] = float("nan")


def _swap_first_two(tensor):
    tensor[0, :2] = tensor[0, :2].flip(0).clone()


@pytest.mark.parametrize(
    ("arch", "name", "change", "message"),
    [
        ("llama", "layers.0.skew_matrix", _nan_at_first, "layers.0.skew_matrix holds NaN or infinite values"),
        ("llama", "layers.2.skew_matrix", lambda t: t.fill_(float("inf")), "layers.2.skew_matrix holds NaN"),
        ("llama", "layers.1.skew_matrix", lambda t: t.zero_(), "layers.1.skew_matrix is not orthogonal"),
        ("llama", "layers.1.skew_matrix", lambda t: t[1].mul_(1.01), "layers.1.skew_matrix is not orthogonal"),
        ("llama", "layers.0.channels", lambda t: t.fill_(99), "layers.0.channels holds channel indices outside"),
        ("llama", "layers.0.channels", lambda t: t[1].fill_(-1), "layers.0.channels holds channel indices outside"),
        ("llama", "layers.2.channels", _swap_first_two, "layers.2.channels is not strictly ascending"),
        ("llama", "layers.2.channels", lambda t: t[1, 1].copy_(t[1, 0]), "layers.2.channels is not strictly ascending"),
        ("opt", "layers.1.partial_query_weight", _nan_at_first, "layers.1.partial_query_weight holds NaN"),
        ("opt", "layers.2.skew_matrix", lambda t: t.mul_(-0.5), "layers.2.skew_matrix is not orthogonal"),
    ],
)
def test_corrupted_tensor_values(saved_for, arch, name, change, message):
    saved = saved_for(arch)
    _rewrite_tensors(saved, lambda tensors: change(tensors[name]))
    with pytest.raises(ArtifactError, match=message) as refused:
        load_artifact(saved)
    assert "\n" not in str(refused.value)


def test_a_rotation_by_minus_one_is_still_a_skew(saved):
    """Orthogonal is all the runtime needs (AᵀA = I): a sign flip of a column is fine."""
    _rewrite_tensors(saved, lambda t: t["layers.0.skew_matrix"][:, :, 0].neg_())
    load_artifact(saved)


@pytest.mark.parametrize(
    "tensors_file",
    ["ABSOLUTE", "../outside.safetensors", None, 3, "sub/skew.safetensors", "..\\outside.safetensors", "", ".."],
)
def test_tensors_file_stays_in_the_folder(saved, tensors_file):
    """A copy of the real tensors outside the folder passes the checksum: only the name check stops it."""
    outside = saved.parent / "outside.safetensors"
    outside.write_bytes((saved / TENSORS).read_bytes())
    manifest = json.loads((saved / MANIFEST).read_text())
    manifest["tensors_file"] = str(outside) if tensors_file == "ABSOLUTE" else tensors_file
    (saved / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="tensors_file must be a plain file name ending in .safetensors"):
        load_artifact(saved)


def test_tensors_file_may_be_another_plain_name(saved):
    (saved / TENSORS).rename(saved / "weights.safetensors")
    manifest = json.loads((saved / MANIFEST).read_text())
    manifest["tensors_file"] = "weights.safetensors"
    (saved / MANIFEST).write_text(json.dumps(manifest))
    assert load_artifact(saved).manifest.tensors_file == "weights.safetensors"


@pytest.mark.parametrize(("umask", "file_mode", "folder_mode"), [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)])
def test_files_follow_the_umask(artifact, tmp_path, umask, file_mode, folder_mode):
    """Like any file the user writes: safetensors and mkdtemp would leave them private (0600 / 0700)."""

    def skewed_checkpoint(staging):
        (staging / "skewed-model").mkdir()
        save_file({"w": torch.zeros(2)}, str(staging / "skewed-model" / "model.safetensors"))

    previous = os.umask(umask)
    try:
        out = save_artifact(artifact, tmp_path / "skewed", card="", write_extra=skewed_checkpoint)
    finally:
        os.umask(previous)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in [out, *out.rglob("*")]}
    assert modes == {
        "skewed": folder_mode,
        MANIFEST: file_mode,
        TENSORS: file_mode,
        "README.md": file_mode,
        "skewed-model": folder_mode,
        "model.safetensors": file_mode,
    }


def test_save_refuses_what_no_reader_would_load(artifact, tmp_path):
    """An energy table without rows (the CLI's summary divides by its length) never reaches the disk."""
    empty = dataclasses.replace(artifact, manifest=dataclasses.replace(artifact.manifest, energy=()))
    with pytest.raises(ArtifactError, match=r"the manifest to write is corrupted: energy must have 3 entries, has 0"):
        save_artifact(empty, tmp_path / "skewed", card="")
    broken = dict(artifact.tensors, **{"layers.0.skew_matrix": torch.zeros(2, 16, 16)})
    with pytest.raises(ArtifactError, match="layers.0.skew_matrix is not orthogonal"):
        save_artifact(dataclasses.replace(artifact, tensors=broken), tmp_path / "skewed", card="")
    assert list(tmp_path.iterdir()) == []


def test_records_read_like_the_dicts_they_replaced(saved):
    manifest = load_artifact(saved).manifest
    assert manifest.spec["n_layers"] == manifest.spec.n_layers == 3
    assert manifest.base_model["fingerprint"] == manifest.base_model.fingerprint
    assert manifest.base_model.get("hub_id") is None and manifest.base_model.get("nothing", 7) == 7
    assert manifest.calibration["sources"][0]["tokens"] == manifest.calibration["tokens"] == 128
    assert [e["layer"] for e in manifest.energy] == [0, 1, 2] and "before" in manifest.energy[0]
    assert dict(manifest.spec) == dataclasses.asdict(manifest.model_spec)
    with pytest.raises(KeyError):
        manifest.spec["rope"]  # a property, not a recorded field
    on_disk = json.loads((saved / MANIFEST).read_text())
    assert json.loads(json.dumps(dataclasses.asdict(manifest))) == on_disk  # `inspect --json` prints the file


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_opens_for_its_own_model_in_any_dtype(tiny, saved_for, arch):
    saved = saved_for(arch)
    stored = load_artifact(saved).manifest.base_model.fingerprint
    half = tiny(arch, dtype=torch.float16).model
    assert fingerprint(half) != stored  # the exact hash cannot match: the signature must decide
    for model in (half, tiny(arch, dtype=torch.bfloat16).model, tiny(arch).model):
        assert open_artifact(saved, model).manifest.spec.model_type == arch


def _perturb_qk(model, share: float):
    """Add Gaussian noise of ``share`` times each q/k weight's RMS (seeded)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in decoder_layers(model):
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                weight = proj.weight
                noise = torch.randn(weight.shape, generator=generator) * weight.float().square().mean().sqrt()
                weight.add_((share * noise).to(weight.dtype))
    return model


@pytest.mark.parametrize("arch", ["llama", "opt"])
@pytest.mark.parametrize(
    "other",
    [
        lambda tiny, arch: _perturb_qk(tiny(arch).model, 0.01),
        lambda tiny, arch: _perturb_qk(tiny(arch, dtype=torch.bfloat16).model, 0.01),
        lambda tiny, arch: tiny(arch, seed=1, dtype=torch.float16).model,
    ],
    ids=["1%-noise", "1%-noise-bf16", "other-seed-fp16"],
)
def test_refuses_other_weights_in_any_dtype(tiny, saved_for, arch, other):
    saved = saved_for(arch)
    with pytest.raises(
        ArtifactError, match=r"made for another model \(tiny-.*\): q/k weights differ, layer 0"
    ) as refused:
        open_artifact(saved, other(tiny, arch))
    assert "\n" not in str(refused.value)


def _old_layout(folder):
    """The artifact as infinigen wrote it before the q/k signature (and, earlier, the method field):
    version 1, without attention statistics."""
    manifest = json.loads((folder / MANIFEST).read_text())
    del manifest["base_model"]["qk_signature"], manifest["method"], manifest["missed_mass_fractions"]
    tensors = {name: t for name, t in load_file(folder / TENSORS).items() if not name.endswith(".missed_mass")}
    save_file(tensors, folder / TENSORS)
    manifest.update(format_version=1, tensors_sha256=_sha256(folder / TENSORS))
    (folder / MANIFEST).write_text(json.dumps(manifest))


def test_reads_artifacts_written_before_the_signature(tiny, saved):
    _old_layout(saved)
    manifest = load_artifact(saved).manifest
    assert manifest.base_model.qk_signature is None and manifest.method == DEFAULT_METHOD
    assert open_artifact(saved, tiny("llama").model).manifest.format_version == 1
    assert open_artifact(saved, tiny("llama", dtype=torch.bfloat16).model)  # bfloat16 rounding: the same hash
    with pytest.raises(
        ArtifactError,
        match=r"fingerprint [0-9a-f]+ vs [0-9a-f]+ .*; if it is the same model in another dtype, re-run `infinigen",
    ):
        open_artifact(saved, tiny("llama", dtype=torch.float16).model)
