"""The artifact: a folder with ``infinigen.json`` (manifest), ``skew.safetensors`` and ``README.md``.

Tensors, per layer ``i`` (h = KV heads, d = head_dim, r = kept channels):
- ``layers.i.skew_matrix``  (h, d, d) float32: orthogonal A per KV head; skewed q = q @ A.
- ``layers.i.channels``     (h, r) int64: the kept columns of the skewed q/k, strictly ascending.
- OPT only: ``layers.i.partial_query_weight`` (heads, r, hidden + 1) float32: the kept rows of
  the skewed, 1/sqrt(d)-scaled W_q with its bias as the last column, so that the partial
  query is ``[x, 1] @ W.T`` without any other step.
- Version 2: ``layers.i.missed_mass`` (h, F) float32 in [0, 1]: the attention mass each KV head's
  exact top tokens miss at the manifest's ``missed_mass_fractions`` of the context, measured on
  the calibration text (``prepare.attention_stats``; adaptive budgets read it).

Writes are atomic (a hidden sibling folder, renamed into place) and leave ordinary files (modes
from the umask). Reads check everything (the manifest field by field, see ``manifest.py``; the
tensors' names, shapes and dtypes from the file's header before any data is read; then their
values) and fail with one-line ``ArtifactError`` messages.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from itertools import islice
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from infinigen.architectures import LayerSignature, ModelSpec, signature_mismatch
from infinigen.artifacts.manifest import (
    TENSORS,
    ArtifactError,
    Manifest,
    manifest_from_json,
)

MANIFEST = "infinigen.json"
CARD = "README.md"
MAX_MANIFEST_BYTES = 64 * 2**20  # a manifest is ~1 KB per layer; a bigger file is no manifest
# Float32 rounding moves each entry of AᵀA of an orthogonal A by at most ~2 * 2^-24 (Cauchy-Schwarz
# over a column pair); a skew computed in float32 throughout stays within ~head_dim * 2^-24. 1e-4
# passes both with margin and still catches any matrix that is not a rotation (NaN, zeros, scaling).
ORTHOGONALITY_TOLERANCE = 1e-4
_DTYPES = {torch.float32: "F32", torch.int64: "I64"}  # the artifact's dtypes, as safetensors names them
_NAME = re.compile(r"layers\.(0|[1-9][0-9]{0,5})\.(skew_matrix|channels|partial_query_weight|missed_mass)")


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

    def missed_mass(self, layer: int) -> torch.Tensor | None:
        """(kv_heads, F) at ``manifest.missed_mass_fractions``; None in a version-1 artifact."""
        return self.tensors.get(f"layers.{layer}.missed_mass")


def _kinds(spec: ModelSpec, manifest: Manifest) -> tuple[str, ...]:
    kinds = ("skew_matrix", "channels") if spec.rope else ("skew_matrix", "channels", "partial_query_weight")
    return kinds + ("missed_mass",) if manifest.missed_mass_fractions else kinds


def expected_tensor(name: str, manifest: Manifest) -> tuple[tuple[int, ...], str] | None:
    """(shape, safetensors dtype) of tensor ``name`` in an artifact with ``manifest``; None if it has no such tensor."""
    spec = manifest.model_spec
    match = _NAME.fullmatch(name)
    if match is None or int(match[1]) >= spec.n_layers or match[2] not in _kinds(spec, manifest):
        return None
    h, d, r = spec.n_kv_heads, spec.head_dim, manifest.n_channels
    return {
        "skew_matrix": ((h, d, d), "F32"),
        "channels": ((h, r), "I64"),
        "partial_query_weight": ((spec.n_heads, r, spec.hidden_size + 1), "F32"),
        "missed_mass": ((h, len(manifest.missed_mass_fractions)), "F32"),
    }[match[2]]


def expected_names(manifest: Manifest) -> Iterator[str]:
    """Every tensor name an artifact with ``manifest`` holds, lazily (layer by layer)."""
    spec = manifest.model_spec
    for i in range(spec.n_layers):
        for kind in _kinds(spec, manifest):
            yield f"layers.{i}.{kind}"


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
    with path.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _as_ordinary_files(folder: Path) -> None:
    """Give ``folder`` and everything in it the modes of a freshly created file or folder: safetensors
    (the tensors, a skewed checkpoint) and mkdtemp write theirs private (0600 / 0700)."""
    mask = _umask()
    for path in [folder, *folder.rglob("*")]:
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def save_artifact(
    artifact: Artifact,
    out: str | Path,
    *,
    card: str,
    force: bool = False,
    write_extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``artifact`` to the folder ``out`` atomically; refuse to replace it unless ``force``.

    The manifest and tensors pass the reader's checks first: what is written can be read back.
    ``write_extra(staging_folder)`` may add files (a skewed checkpoint) inside the same atomic write.
    """
    out = Path(out)
    if out.exists() and not force:
        raise ArtifactError(f"{out} already exists: pass --force to replace it")
    manifest = replace(artifact.manifest, format_version=artifact.manifest.written_version, tensors_file=TENSORS)
    check_tensors(artifact.tensors, _round_trip(replace(manifest, tensors_sha256="0" * 64)))
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tensors_path = staging / TENSORS
        save_file(
            {k: v.contiguous() for k, v in artifact.tensors.items()},
            str(tensors_path),
            metadata={"format": "infinigen", "format_version": str(manifest.format_version)},
        )
        with tensors_path.open("rb+") as f:
            os.fsync(f.fileno())
        manifest = replace(manifest, tensors_sha256=_sha256(tensors_path))
        _write_synced(staging / MANIFEST, json.dumps(manifest.as_json(), indent=2) + "\n")
        _write_synced(staging / CARD, card)
        if write_extra is not None:
            write_extra(staging)
        _as_ordinary_files(staging)
        _replace_folder(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _round_trip(manifest: Manifest) -> Manifest:
    """``manifest`` as a reader will see it: checked field by field through its JSON."""
    return manifest_from_json(json.loads(json.dumps(manifest.as_json())), "the manifest to write")


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
    """The folder's manifest, every field checked (``manifest.manifest_from_json``)."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{folder} is not an infinigen artifact: {MANIFEST} is missing")
    try:
        if path.stat().st_size > MAX_MANIFEST_BYTES:
            raise ArtifactError(f"{path} is corrupted: larger than {MAX_MANIFEST_BYTES >> 20} MB")
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ArtifactError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError:
        raise ArtifactError(f"{path} is corrupted: not valid JSON (not UTF-8)") from None
    try:
        raw = json.loads(text)
    # ValueError: JSONDecodeError, and integers too long to convert; RecursionError: deep nesting
    except (ValueError, RecursionError):
        raise ArtifactError(f"{path} is corrupted: not valid JSON") from None
    return manifest_from_json(raw, str(path))


def load_artifact(folder: str | Path) -> Artifact:
    """Read and check an artifact folder (integrity, names, shapes, dtypes, values); not yet its model."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    # A plain file name (checked with the manifest), so this stays inside the folder. Symlinks are
    # followed: huggingface_hub's snapshot folders link every file into the cache's blobs/.
    tensors_path = folder / manifest.tensors_file
    if not tensors_path.is_file():
        raise ArtifactError(f"{folder} is incomplete: {manifest.tensors_file} is missing")
    try:
        if _sha256(tensors_path) != manifest.tensors_sha256:
            raise ArtifactError(f"{tensors_path} is corrupted: its checksum does not match {MANIFEST}")
        with safe_open(str(tensors_path), framework="pt") as f:
            names = list(f.keys())
            _check_layout({name: _header_entry(f, name) for name in names}, manifest)
            tensors = {}
            for name in names:  # one at a time: a bad tensor stops the read before the rest is loaded
                tensors[name] = f.get_tensor(name)
                _check_values(name, tensors[name], manifest.spec.head_dim)
    except (SafetensorError, OSError) as exc:
        first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ArtifactError(f"{tensors_path} is corrupted: {first_line}") from exc
    return Artifact(manifest, tensors)


def _header_entry(f, name: str) -> tuple[tuple[int, ...], str]:
    tensor = f.get_slice(name)
    return tuple(tensor.get_shape()), tensor.get_dtype()


def check_tensors(tensors: Mapping[str, torch.Tensor], manifest: Manifest) -> None:
    """Fail unless ``tensors`` are exactly what an artifact with ``manifest`` holds, with sound values."""
    layout = {name: (tuple(t.shape), _DTYPES.get(t.dtype, str(t.dtype))) for name, t in tensors.items()}
    _check_layout(layout, manifest)
    for name, tensor in tensors.items():
        _check_values(name, tensor, manifest.spec.head_dim)


def _check_layout(layout: Mapping[str, tuple[tuple[int, ...], str]], manifest: Manifest) -> None:
    """Names, shapes and dtypes (safetensors' names), checked without building the expected set."""
    spec = manifest.model_spec
    expected = {name: expected_tensor(name, manifest) for name in layout}  # at most one per tensor given
    unexpected = sorted(name for name, entry in expected.items() if entry is None)
    if unexpected or len(layout) != spec.n_layers * len(_kinds(spec, manifest)):
        # every given name is expected and unique: with the right count, none is missing
        missing = list(islice((name for name in expected_names(manifest) if name not in layout), 3))
        raise ArtifactError(
            f"artifact tensors do not match its manifest: missing {missing}, unexpected {unexpected[:3]}"
        )
    for name, (shape, dtype) in layout.items():
        want_shape, want_dtype = expected[name]
        if shape != want_shape or dtype != want_dtype:
            raise ArtifactError(f"artifact tensor {name} is {shape} {dtype}, expected {want_shape} {want_dtype}")


def _check_values(name: str, tensor: torch.Tensor, head_dim: int) -> None:
    """The values the runtime relies on: finite rotations, ascending in-range channels, finite weights."""
    if name.endswith(".channels"):
        if tensor.numel() and (tensor.min() < 0 or tensor.max() >= head_dim):
            raise ArtifactError(f"artifact tensor {name} holds channel indices outside [0, head_dim)")
        if not bool((tensor[:, 1:] > tensor[:, :-1]).all()):
            raise ArtifactError(f"artifact tensor {name} is not strictly ascending per KV head")
        return
    if not bool(torch.isfinite(tensor).all()):
        raise ArtifactError(f"artifact tensor {name} holds NaN or infinite values")
    if name.endswith(".missed_mass") and tensor.numel() and (tensor.min() < 0 or tensor.max() > 1):
        raise ArtifactError(f"artifact tensor {name} holds attention mass outside [0, 1]")
    if name.endswith(".skew_matrix"):
        skew = tensor.double()
        eye = torch.eye(skew.shape[-1], dtype=torch.float64)
        error = float((skew.mT @ skew - eye).abs().amax()) if skew.numel() else 0.0
        if not error <= ORTHOGONALITY_TOLERANCE:
            raise ArtifactError(f"artifact tensor {name} is not orthogonal per KV head (|AᵀA - I| reaches {error:.2g})")


def check_compatible(
    manifest: Manifest,
    spec: ModelSpec,
    fingerprint: str,
    signature: tuple[LayerSignature, ...] | None = None,
) -> None:
    """Fail unless the artifact was made for this model: the same geometry, and the same q/k weights
    by ``fingerprint`` (exact) or, across dtypes, by ``signature`` (``architectures.qk_signature``)."""
    made_for = manifest.base_model.model_id
    if manifest.model_spec != spec:
        pairs = [(key, theirs, getattr(spec, key)) for key, theirs in manifest.spec.items()]
        diffs = [f"{key} {theirs} vs {ours}" for key, theirs, ours in pairs if theirs != ours]
        raise ArtifactError(f"artifact was made for another model ({made_for}): {', '.join(diffs)}")
    if manifest.base_model.fingerprint == fingerprint:
        return
    stored = manifest.base_model.qk_signature
    if stored is None:
        raise ArtifactError(
            f"artifact was made for another model ({made_for}): q/k weight fingerprint "
            f"{manifest.base_model.fingerprint} vs {fingerprint} for the loaded model; if it is the same "
            "model in another dtype, re-run `infinigen prepare` for an artifact that checks its weights across dtypes"
        )
    if signature is None:
        raise ArtifactError(f"artifact was made for another model ({made_for}): q/k weight fingerprint differs")
    problem = signature_mismatch(stored, signature)
    if problem is not None:
        raise ArtifactError(f"artifact was made for another model ({made_for}): q/k weights differ, {problem}")
