"""The manifest reader: every corrupted field fails with one line naming it, never a traceback or a runaway."""

from __future__ import annotations

import json
import re
import shutil
import time

import pytest
from conftest import tiny_model
from typer.testing import CliRunner

from infinigen.architectures import SUPPORTED
from infinigen.artifacts import ArtifactError, load_artifact, read_manifest, render_card, save_artifact
from infinigen.artifacts.format import MANIFEST
from infinigen.cli import app
from infinigen.models import LoadedModel, ModelSource
from infinigen.prepare import prepare_artifact

DELETE = object()  # an edit that removes the key

MODEL_TYPES = ", ".join(SUPPORTED)  # as the schema names them


@pytest.fixture(scope="module")
def pristine(tokenizer, tmp_path_factory):
    """One valid artifact of the tiny Llama (3 layers, 2 KV heads, head_dim 16, ratio 0.5: 8 channels)."""
    loaded = LoadedModel(tiny_model("llama"), tokenizer, ModelSource("tiny-llama", None, "local"))
    artifact = prepare_artifact(loaded, tokens=64)
    return save_artifact(artifact, tmp_path_factory.mktemp("pristine") / "skewed", card=render_card(artifact.manifest))


@pytest.fixture
def folder(pristine, tmp_path):
    return shutil.copytree(pristine, tmp_path / "skewed")


def edit(folder, path: str, value) -> None:
    """Set (or, with DELETE, remove) the manifest entry at a dotted ``path``; list indices are numbers."""
    manifest = json.loads((folder / MANIFEST).read_text())
    *parents, last = path.split(".")
    node = manifest
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    key = int(last) if isinstance(node, list) else last
    if value is DELETE:
        del node[key]
    else:
        node[key] = value
    (folder / MANIFEST).write_text(json.dumps(manifest))  # NaN and Infinity as Python's json writes them


def refused(folder, message: str) -> str:
    """The one-line error of loading ``folder``, which must contain ``message``."""
    with pytest.raises(ArtifactError, match=re.escape(message)) as info:
        load_artifact(folder)
    text = str(info.value)
    assert "\n" not in text and text.startswith(str(folder / MANIFEST))
    return text


def test_pristine_loads(folder):
    assert load_artifact(folder).manifest.n_channels == 8


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("format_version", True, "format_version must be an integer, got true"),
        ("format_version", 1.0, "format_version must be an integer, got 1.0"),
        ("format_version", "1", "format_version must be an integer, got '1'"),
        ("spec", "llama", "spec must be an object, got 'llama'"),
        ("spec.n_layers", 3.0, "spec.n_layers must be an integer in [1, 65536], got 3.0"),
        ("spec.n_layers", "3", "spec.n_layers must be an integer in [1, 65536], got '3'"),
        ("spec.n_kv_heads", True, "spec.n_kv_heads must be an integer in [1, 65536], got true"),
        ("spec.head_dim", None, "spec.head_dim must be an integer in [1, 65536], got null"),
        ("spec.model_type", 7, f"spec.model_type must be one of {MODEL_TYPES}, got 7"),
        ("n_channels", 8.0, "n_channels must be an integer in [1, 16], got 8.0"),
        ("ratio", "0.5", "ratio must be a finite number, got '0.5'"),
        ("ratio", False, "ratio must be a finite number, got false"),
        ("base_model", [], "base_model must be an object, got an array"),
        ("base_model.model_id", 3, "base_model.model_id must be a non-empty, printable string, got 3"),
        ("base_model.revision", 1, "base_model.revision must be a non-empty, printable string or null, got 1"),
        ("base_model.qk_signature", "x", "base_model.qk_signature must be an array, got 'x'"),
        ("base_model.qk_signature.0", [], "base_model.qk_signature[0] must be an object, got an array"),
        ("base_model.qk_signature.2.probes.5", "1", "base_model.qk_signature[2].probes must hold finite numbers"),
        ("calibration.tokens", "64", "calibration.tokens must be an integer in [1, 1099511627776], got '64'"),
        ("calibration.sources", {}, "calibration.sources must be an array, got an object"),
        ("energy", {}, "energy must be an array, got an object"),
        ("energy.0", [0, 0.5, 0.6], "energy[0] must be an object, got an array"),
        ("energy.1.before", "0.5", "energy[1].before must be a finite number, got '0.5'"),
        ("versions", ["torch"], "versions must be an object, got an array"),
        ("versions.torch", 2, "versions.torch must be a non-empty, printable string, got 2"),
        ("created", None, "created must be a non-empty, printable string, got null"),
        ("tensors_sha256", 0, "tensors_sha256 must be a string matching [0-9a-f]{64}, got 0"),
        ("extra", [], "extra must be an object, got an array"),
        ("method", "svd", "method must be an object, got 'svd'"),
        ("method.skew", 1, "method.skew must be one of svd, identity, got 1"),
    ],
)
def test_wrong_types(folder, path, value, message):
    edit(folder, path, value)
    refused(folder, message)


@pytest.mark.parametrize(
    ("path", "shown"),
    [
        ("format_version", "format_version"),
        ("spec", "spec"),
        ("spec.head_dim", "spec.head_dim"),
        ("ratio", "ratio"),
        ("n_channels", "n_channels"),
        ("base_model", "base_model"),
        ("base_model.model_id", "base_model.model_id"),
        ("base_model.fingerprint", "base_model.fingerprint"),
        ("base_model.hub_id", "base_model.hub_id"),
        ("base_model.qk_signature.1.k_norm", "base_model.qk_signature[1].k_norm"),
        ("calibration.tokens", "calibration.tokens"),
        ("calibration.sources.0.sha256", "calibration.sources[0].sha256"),
        ("energy", "energy"),
        ("energy.2.before", "energy[2].before"),
        ("energy.0.layer", "energy[0].layer"),
        ("versions", "versions"),
        ("created", "created"),
        ("tensors_sha256", "tensors_sha256"),
        ("missed_mass_fractions", "missed_mass_fractions"),  # version 2 has them
    ],
)
def test_missing_keys(folder, path, shown):
    edit(folder, path, DELETE)
    refused(folder, f"{shown} is missing")


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("format_version", 3, "unknown artifact format version 3 (this infinigen reads version 1, 2)"),
        ("missed_mass_fractions", [0.5], "missed_mass_fractions must hold 2 to 64 numbers, got 1"),
        ("missed_mass_fractions", "0.5,1", "missed_mass_fractions must be an array, got '0.5,1'"),
        ("missed_mass_fractions.0", 0.0, "missed_mass_fractions must be numbers in (0, 1]"),
        ("missed_mass_fractions.0", True, "missed_mass_fractions must be numbers in (0, 1]"),
        ("missed_mass_fractions.1", 0.001, "missed_mass_fractions must be strictly ascending"),
        ("format_version", 0, "unknown artifact format version 0"),
        ("spec.n_layers", 0, "spec.n_layers must be an integer in [1, 65536], got 0"),
        ("spec.hidden_size", -64, "spec.hidden_size must be an integer in [1, 65536], got -64"),
        ("spec.n_heads", 3, "spec.n_heads 3 is not a multiple of spec.n_kv_heads 2"),
        ("spec.model_type", "gpt2", f"spec.model_type must be one of {MODEL_TYPES}, got 'gpt2'"),
        ("n_channels", 0, "n_channels must be an integer in [1, 16], got 0"),
        ("n_channels", 17, "n_channels must be an integer in [1, 16], got 17"),
        ("n_channels", 7, "n_channels 7 does not follow from ratio 0.5 of head_dim 16 (ceil gives 8)"),
        ("ratio", 0, "ratio must be in (0, 1], got 0.0"),
        ("ratio", 1.5, "ratio must be in (0, 1], got 1.5"),
        ("ratio", float("nan"), "ratio must be a finite number, got nan"),
        ("ratio", float("inf"), "ratio must be a finite number, got inf"),
        ("energy", [], "energy must have 3 entries, has 0"),
        ("energy.0.after", float("nan"), "energy[0].after must be a finite number, got nan"),
        ("energy.2.before", float("-inf"), "energy[2].before must be a finite number, got -inf"),
        ("energy.1.layer", 5, "energy[1].layer must be an integer in [1, 1], got 5"),
        ("calibration.sources", [], "calibration.sources must name at least one source"),
        ("calibration.sources.0.tokens", 0, "calibration.sources[0].tokens must be an integer in [1, "),
        ("calibration.tokens", 65, "calibration.tokens 65 is not the sum of its sources' tokens"),
        ("base_model.fingerprint", "e3e7", "base_model.fingerprint must be a string matching [0-9a-f]{16}, got 'e3e7'"),
        ("base_model.model_id", "", "base_model.model_id must be a non-empty, printable string, got ''"),
        ("base_model.model_id", "two\nlines", "base_model.model_id must be a non-empty, printable string"),
        ("base_model.qk_signature", [], "base_model.qk_signature must have 3 entries, has 0"),
        ("base_model.qk_signature.0.q_norm", -1.0, "base_model.qk_signature[0]: norms must be >= 0"),
        ("base_model.qk_signature.1.probes", [0.0] * 3, "base_model.qk_signature[1].probes must have 64 entries"),
        ("base_model.qk_signature.1.probes.0", float("nan"), "base_model.qk_signature[1].probes must hold finite"),
        ("tensors_sha256", "abc", "tensors_sha256 must be a string matching [0-9a-f]{64}, got 'abc'"),
        ("method.skew", "pca", "method.skew must be one of svd, identity, got 'pca'"),
        ("method.seed", 1, "unknown field method.'seed'"),
        ("spec.rope", True, "unknown field spec.'rope'"),
        ("energy.0.mean", 0.5, "unknown field energy[0].'mean'"),
        ("stats", {}, "unknown field 'stats'"),
    ],
)
def test_out_of_range_or_inconsistent(folder, path, value, message):
    edit(folder, path, value)
    refused(folder, message)


def test_extra_nested_too_deeply(folder):
    nested: list = []
    for _ in range(500):  # valid JSON, but asdict / json.dumps would recurse through it
        nested = [nested]
    edit(folder, "extra", {"deep": nested})
    refused(folder, "extra is nested deeper than 16 levels")


@pytest.mark.parametrize(
    "content",
    [
        b"[" * 100_000,  # json's decoder recurses: RecursionError
        b'{"format_version": 1, "spec": ',
        b"\xff\xfe\x00{",
        b'{"format_version": ' + b"1" * 5000 + b"}",  # an integer too long to convert: ValueError
        b"",
    ],
    ids=["deep-array", "truncated", "not-utf8", "huge-integer", "empty"],
)
def test_not_json(folder, content):
    (folder / MANIFEST).write_bytes(content)
    refused(folder, "is corrupted: not valid JSON")


def test_not_an_object(folder):
    (folder / MANIFEST).write_text("[1, 2]")
    refused(folder, "is corrupted: the manifest must be an object, got an array")


@pytest.mark.parametrize("n_layers", [10**9, 2**63])
def test_huge_layer_count_fails_fast(folder, n_layers):
    """Before the bound, the reader built one expected tensor per layer: gigabytes, then minutes."""
    edit(folder, "spec.n_layers", n_layers)
    start = time.perf_counter()
    refused(folder, f"spec.n_layers must be an integer in [1, 65536], got {n_layers}")
    assert time.perf_counter() - start < 1


def test_read_manifest_checks_without_tensors(folder):
    (folder / "skew.safetensors").unlink()
    assert read_manifest(folder).spec.n_layers == 3
    edit(folder, "energy", [])
    with pytest.raises(ArtifactError, match="energy must have 3 entries"):
        read_manifest(folder)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("energy", []),
        ("spec.n_layers", 10**9),
        ("tensors_file", "/etc/passwd"),
        ("format_version", True),
        ("base_model.fingerprint", None),
    ],
)
def test_inspect_prints_one_error_line(folder, path, value):
    edit(folder, path, value)
    result = CliRunner().invoke(app, ["inspect", str(folder)], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output


def test_inspect_deeply_nested_manifest(folder):
    (folder / MANIFEST).write_text("[" * 100_000)
    result = CliRunner().invoke(app, ["inspect", str(folder)], catch_exceptions=False)
    assert result.exit_code == 2 and result.output.strip().splitlines() == [
        f"error: {folder / MANIFEST} is corrupted: not valid JSON"
    ]


def test_inspect_json_prints_the_manifest_file(folder):
    edit(folder, "base_model.model_id", "ünïcode model ✓")  # odd but valid
    result = CliRunner().invoke(app, ["inspect", str(folder), "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == json.loads((folder / MANIFEST).read_text())
    table = CliRunner().invoke(app, ["inspect", str(folder)], catch_exceptions=False)
    assert table.exit_code == 0 and "ünïcode model ✓" in table.output
