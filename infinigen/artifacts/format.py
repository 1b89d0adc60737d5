"""The artifact: a folder with ``infinigen.json`` (manifest), ``skew.safetensors`` and ``README.md``.

Tensors, per layer ``i`` (h = KV heads, d = head_dim, r = kept channels):
- ``layers.i.skew_matrix``  (h, d, d) float32: orthogonal A per KV head; skewed q = q @ A.
- ``layers.i.channels``     (h, r) int64: the kept columns of the skewed q/k, ascending.
- OPT only: ``layers.i.partial_query_weight`` (heads, r, hidden + 1) float32: the kept rows of
  the skewed, 1/sqrt(d)-scaled W_q with its bias as the last column, so that the partial
  query is ``[x, 1] @ W.T`` without any other step.

Writes are atomic (a hidden sibling folder, renamed into place); reads check everything and
fail with one-line ``ArtifactError`` messages.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from infinigen.architectures import ModelSpec
from infinigen.errors import InfinigenError

FORMAT_VERSION = 1
MANIFEST = "infinigen.json"
TENSORS = "skew.safetensors"
CARD = "README.md"


class ArtifactError(InfinigenError):
    """The artifact is missing, corrupted, of an unknown version, or made for another model."""


@dataclass(frozen=True)
class Manifest:
    base_model: dict  # {"model_id", "revision", "kind", "hub_id", "fingerprint"}
    spec: dict  # ModelSpec fields
    ratio: float
    n_channels: int
    calibration: dict  # {"sources": [{"name", "sha256", "tokens"}], "tokens": int}
    energy: list[dict]  # per layer: {"layer", "before", "after"} (means over KV heads)
    versions: dict
    created: str
    tensors_sha256: str = ""
    format_version: int = FORMAT_VERSION
    tensors_file: str = TENSORS
    extra: dict = field(default_factory=dict)
    method: dict = field(default_factory=lambda: {"skew": "svd", "channels": "top"})  # others: ablations

    @property
    def model_spec(self) -> ModelSpec:
        return ModelSpec(**self.spec)


@dataclass(frozen=True)
class Artifact:
    manifest: Manifest
    tensors: dict[str, torch.Tensor]

    def skew_matrix(self, layer: int) -> torch.Tensor:
        return self.tensors[f"layers.{layer}.skew_matrix"]

    def channels(self, layer: int) -> torch.Tensor:
        return self.tensors[f"layers.{layer}.channels"]

    def partial_query_weight(self, layer: int) -> torch.Tensor | None:
        return self.tensors.get(f"layers.{layer}.partial_query_weight")


def expected_tensors(spec: ModelSpec, n_channels: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor an artifact for ``spec`` must hold."""
    h, d, r = spec.n_kv_heads, spec.head_dim, n_channels
    expected = {}
    for i in range(spec.n_layers):
        expected[f"layers.{i}.skew_matrix"] = ((h, d, d), torch.float32)
        expected[f"layers.{i}.channels"] = ((h, r), torch.int64)
        if not spec.rope:
            expected[f"layers.{i}.partial_query_weight"] = ((spec.n_heads, r, spec.hidden_size + 1), torch.float32)
    return expected


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def save_artifact(
    artifact: Artifact,
    out: str | Path,
    *,
    card: str,
    force: bool = False,
    write_extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``artifact`` to the folder ``out`` atomically; refuse to replace it unless ``force``.

    ``write_extra(staging_folder)`` may add files (a skewed checkpoint) inside the same atomic write.
    """
    out = Path(out)
    if out.exists() and not force:
        raise ArtifactError(f"{out} already exists: pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    staging.chmod(0o777 & ~_umask())  # mkdtemp makes it private; the artifact is an ordinary folder
    try:
        tensors_path = staging / TENSORS
        save_file(
            {k: v.contiguous() for k, v in artifact.tensors.items()},
            str(tensors_path),
            metadata={"format": "infinigen", "format_version": str(FORMAT_VERSION)},
        )
        with tensors_path.open("rb+") as f:
            os.fsync(f.fileno())
        manifest = Manifest(**{**asdict(artifact.manifest), "tensors_sha256": _sha256(tensors_path)})
        _write_synced(staging / MANIFEST, json.dumps(asdict(manifest), indent=2) + "\n")
        _write_synced(staging / CARD, card)
        if write_extra is not None:
            write_extra(staging)
        _replace_folder(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _replace_folder(new: Path, target: Path) -> None:
    """Rename ``new`` to ``target``; an existing target is moved aside first and removed last."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        target.rename(old)
    try:
        new.rename(target)
    except BaseException:
        if old is not None:
            old.rename(target)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def read_manifest(folder: str | Path) -> Manifest:
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{folder} is not an infinigen artifact: {MANIFEST} is missing")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path} is corrupted: not valid JSON") from exc
    if not isinstance(raw, dict):
        raise ArtifactError(f"{path} is corrupted: expected a JSON object")
    version = raw.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(
            f"{path}: unknown artifact format version {version!r} (this infinigen reads version {FORMAT_VERSION})"
        )
    try:
        manifest = Manifest(**raw)
        manifest.model_spec  # noqa: B018 - validates the spec fields
    except TypeError as exc:
        raise ArtifactError(f"{path} is corrupted: {exc}") from exc
    return manifest


def load_artifact(folder: str | Path) -> Artifact:
    """Read and check an artifact folder (integrity, names, shapes, dtypes); not yet its model."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    tensors_path = folder / manifest.tensors_file
    if not tensors_path.is_file():
        raise ArtifactError(f"{folder} is incomplete: {manifest.tensors_file} is missing")
    if _sha256(tensors_path) != manifest.tensors_sha256:
        raise ArtifactError(f"{tensors_path} is corrupted: its checksum does not match {MANIFEST}")
    try:
        tensors = load_file(str(tensors_path))
    except (SafetensorError, OSError) as exc:
        raise ArtifactError(f"{tensors_path} is corrupted: {exc}") from exc
    check_tensors(tensors, manifest)
    return Artifact(manifest, tensors)


def check_tensors(tensors: dict[str, torch.Tensor], manifest: Manifest) -> None:
    expected = expected_tensors(manifest.model_spec, manifest.n_channels)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ArtifactError(
            f"artifact tensors do not match its manifest: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    for name, (shape, dtype) in expected.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ArtifactError(
                f"artifact tensor {name} is {tuple(tensor.shape)} {tensor.dtype}, expected {shape} {dtype}"
            )
        if name.endswith(".channels") and (tensor.min() < 0 or tensor.max() >= manifest.model_spec.head_dim):
            raise ArtifactError(f"artifact tensor {name} holds channel indices outside [0, head_dim)")


def check_compatible(manifest: Manifest, spec: ModelSpec, fingerprint: str) -> None:
    """Fail unless the artifact was made for this model (same geometry and q/k weights)."""
    made_for = manifest.base_model.get("model_id")
    if manifest.model_spec != spec:
        diffs = [
            f"{key} {theirs} vs {ours}"
            for key, theirs in manifest.spec.items()
            if theirs != (ours := getattr(spec, key))
        ]
        raise ArtifactError(f"artifact was made for another model ({made_for}): {', '.join(diffs)}")
    if manifest.base_model.get("fingerprint") != fingerprint:
        raise ArtifactError(
            f"artifact was made for another model ({made_for}): q/k weight fingerprint "
            f"{manifest.base_model.get('fingerprint')} vs {fingerprint} for the loaded model"
        )
