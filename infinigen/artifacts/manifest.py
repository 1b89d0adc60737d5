"""The manifest, ``infinigen.json``: typed records, and the one place that turns its JSON into them.

Every field is checked before any record is built: exact types (an integer is a JSON integer, not
``true``, ``30.0`` or ``"30"``), ranges, required keys, one energy row per layer, and sizes bounded
so that no manifest can make a reader build millions of entries. A failure is one line naming the field.

The records also read like the dicts they replaced (``manifest.spec["n_layers"]`` is
``manifest.spec.n_layers``), and ``manifest.as_json()`` is the JSON on disk, unchanged.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from itertools import pairwise
from typing import Any

from infinigen.architectures import SIGNATURE_PROBES, SUPPORTED, LayerSignature, ModelSpec
from infinigen.errors import InfinigenError

# what save_artifact writes: 2 adds the attention statistics (``missed_mass``) that adaptive budgets
# read; an artifact without them (made before) is written, and read, as version 1
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # what this reader accepts: the one version check is check_version
MAX_FRACTIONS = 64  # points of the missed-mass grid
TENSORS = "skew.safetensors"

# Layers, heads, head_dim and hidden size of any real model are far below this; the bound keeps a
# corrupted manifest (n_layers = 10^9) from making a reader build an entry per layer.
MAX_SIZE = 2**16
MAX_COUNT = 2**40  # positions, calibration tokens
MAX_EXTRA_DEPTH = 16  # ``extra`` is free-form: deep nesting would overflow the stack of asdict / json.dumps

SKEWS = ("svd", "identity")  # identity: no skewing (an ablation)
CHANNEL_RULES = ("top", "random")  # random: kept channels drawn at random (an ablation)
DEFAULT_METHOD = {"skew": "svd", "channels": "top"}  # InfiniGen itself; manifests from before ablations lack it

_HEX16, _HEX64 = re.compile(r"[0-9a-f]{16}"), re.compile(r"[0-9a-f]{64}")
_CALIBRATION_SHA = re.compile(r"(?:[0-9a-f]{64})?")  # empty for generated (random-token) calibration


class ArtifactError(InfinigenError):
    """The artifact is missing, corrupted, of an unknown version, or made for another model."""


class Record:
    """Key access as well (``record["name"]``, ``get``, ``keys``, ``items``, ``in``): the manifest's
    records replaced plain dicts, and code written against those keeps working."""

    def keys(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self))  # every Record is a dataclass

    def __getitem__(self, key: str) -> Any:
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in self.keys() else default

    def items(self) -> tuple[tuple[str, Any], ...]:
        return tuple((key, getattr(self, key)) for key in self.keys())

    def __contains__(self, key: object) -> bool:
        return key in self.keys()


@dataclass(frozen=True)
class BaseModelRecord(Record):
    model_id: str  # Hub id, alias or local path
    revision: str | None
    kind: str  # hub, local, gguf, embedded, random
    hub_id: str | None
    fingerprint: str  # architectures.fingerprint: 16 hex digits
    # architectures.qk_signature, one per layer: the dtype-independent check. None in artifacts
    # written before it existed; those are matched on the fingerprint alone.
    qk_signature: tuple[LayerSignature, ...] | None = None


@dataclass(frozen=True)
class SpecRecord(Record, ModelSpec):
    """The model's ModelSpec as the manifest records it. A SpecRecord never equals a ModelSpec (they
    are different classes): compare through ``Manifest.model_spec``."""


@dataclass(frozen=True)
class CalibrationSource(Record):
    name: str
    sha256: str  # of the text; empty for generated tokens
    tokens: int


@dataclass(frozen=True)
class CalibrationRecord(Record):
    sources: tuple[CalibrationSource, ...]
    tokens: int  # the sources' sum


@dataclass(frozen=True)
class EnergyRow(Record):
    """Score energy carried by the kept channels in one layer, mean over KV heads (see prepare.skew)."""

    layer: int
    before: float
    after: float


@dataclass(frozen=True)
class Manifest:
    base_model: BaseModelRecord
    spec: SpecRecord
    ratio: float
    n_channels: int
    calibration: CalibrationRecord
    energy: tuple[EnergyRow, ...]  # one row per layer, in order
    versions: dict[str, str]
    created: str
    tensors_sha256: str = ""
    format_version: int = FORMAT_VERSION
    tensors_file: str = TENSORS
    extra: dict = field(default_factory=dict)
    method: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_METHOD))  # others: ablations
    # version 2: the fractions of the context at which ``layers.i.missed_mass`` is measured (ascending)
    missed_mass_fractions: tuple[float, ...] = ()

    def as_json(self) -> dict:
        """The manifest as written: a version-1 manifest has no ``missed_mass_fractions``."""
        raw = asdict(self)
        if not self.missed_mass_fractions:
            del raw["missed_mass_fractions"]
        return raw

    @property
    def written_version(self) -> int:
        """The format version this manifest is written as: 1 without attention statistics."""
        return FORMAT_VERSION if self.missed_mass_fractions else 1

    @property
    def model_spec(self) -> ModelSpec:
        return ModelSpec(**{f.name: getattr(self.spec, f.name) for f in fields(ModelSpec)})

    def mean_energy(self) -> tuple[float, float]:
        """(before, after), means over layers."""
        n = len(self.energy)
        return sum(e.before for e in self.energy) / n, sum(e.after for e in self.energy) / n


def channels_for_ratio(ratio: float, head_dim: int) -> int:
    """Kept channels for a share ``ratio`` of head_dim: how n_channels follows from the ratio."""
    return max(1, math.ceil(ratio * head_dim))


def manifest_from_json(raw: object, source: str) -> Manifest:
    """The manifest of parsed JSON ``raw``, every field checked; else ArtifactError naming ``source``."""
    try:
        return _manifest(raw)
    except _UnknownVersion as exc:
        raise ArtifactError(f"{source}: {exc}") from None
    except _Invalid as exc:
        raise ArtifactError(f"{source} is corrupted: {exc}") from None


class _Invalid(Exception):
    """A manifest field breaks the schema; the message names it."""


class _UnknownVersion(Exception):
    """A well-formed format version this reader does not read."""


_REQUIRED = object()


def _describe(value: object) -> str:
    """A JSON value in a few characters, on one line, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class _Fields:
    """One JSON object: each key is read once with its type checked, and keys left unread are refused."""

    def __init__(self, value: object, where: str) -> None:
        if not isinstance(value, dict):
            raise _Invalid(f"{where or 'the manifest'} must be an object, got {_describe(value)}")
        self.value, self.where, self.read = value, where, set()

    def name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def raw(self, key: str, default: object = _REQUIRED) -> object:
        self.read.add(key)
        if key in self.value:
            return self.value[key]
        if default is _REQUIRED:
            raise _Invalid(f"{self.name(key)} is missing")
        return default

    def integer(self, key: str, low: int, high: int) -> int:
        value = self.raw(key)
        if type(value) is not int or not low <= value <= high:  # type(): True and 30.0 are no integers here
            raise _Invalid(f"{self.name(key)} must be an integer in [{low}, {high}], got {_describe(value)}")
        return value

    def number(self, key: str) -> float:
        value = self.raw(key)
        if type(value) not in (int, float) or not math.isfinite(value):
            raise _Invalid(f"{self.name(key)} must be a finite number, got {_describe(value)}")
        return float(value)

    def text(self, key: str, *, pattern: re.Pattern | None = None, nullable: bool = False) -> str | None:
        value = self.raw(key)
        if value is None and nullable:
            return None
        # printable: no newline or control character can reach a one-line error message or the card
        valid = type(value) is str and value.isprintable() and (pattern.fullmatch(value) if pattern else value)
        if not valid:
            what = f"a string matching {pattern.pattern}" if pattern else "a non-empty, printable string"
            raise _Invalid(f"{self.name(key)} must be {what}{' or null' if nullable else ''}, got {_describe(value)}")
        return value

    def choice(self, key: str, options: tuple[str, ...]) -> str:
        value = self.raw(key)
        if type(value) is not str or value not in options:
            raise _Invalid(f"{self.name(key)} must be one of {', '.join(options)}, got {_describe(value)}")
        return value

    def fields(self, key: str) -> _Fields:
        return _Fields(self.raw(key), self.name(key))

    def array(self, key: str, length: int | None = None) -> list:
        value = self.raw(key)
        if not isinstance(value, list):
            raise _Invalid(f"{self.name(key)} must be an array, got {_describe(value)}")
        if length is not None and len(value) != length:
            raise _Invalid(f"{self.name(key)} must have {length} entries, has {len(value)}")
        return value

    def rows(self, key: str, length: int | None = None) -> Iterator[_Fields]:
        for i, row in enumerate(self.array(key, length)):
            yield _Fields(row, f"{self.name(key)}[{i}]")

    def done(self) -> None:
        unknown = sorted(set(self.value) - self.read)
        if unknown:
            raise _Invalid(f"unknown field {self.name(_describe(unknown[0]))}")


def check_version(version: object) -> int:
    """The one format-version check of the readers: a JSON integer this infinigen reads."""
    if type(version) is not int:
        raise _Invalid(f"format_version must be an integer, got {_describe(version)}")
    if version not in READABLE_VERSIONS:
        readable = ", ".join(map(str, READABLE_VERSIONS))
        raise _UnknownVersion(f"unknown artifact format version {version} (this infinigen reads version {readable})")
    return version


def _manifest(raw: object) -> Manifest:
    top = _Fields(raw, "")
    version = check_version(top.raw("format_version"))  # first: another version may have other fields
    spec = _spec(top.fields("spec"))
    ratio = top.number("ratio")
    if not 0 < ratio <= 1:
        raise _Invalid(f"ratio must be in (0, 1], got {ratio}")
    n_channels = top.integer("n_channels", 1, spec.head_dim)
    if n_channels != channels_for_ratio(ratio, spec.head_dim):
        raise _Invalid(
            f"n_channels {n_channels} does not follow from ratio {ratio} of head_dim {spec.head_dim} "
            f"(ceil gives {channels_for_ratio(ratio, spec.head_dim)})"
        )
    manifest = Manifest(
        base_model=_base_model(top.fields("base_model"), spec.n_layers),
        spec=spec,
        ratio=ratio,
        n_channels=n_channels,
        calibration=_calibration(top.fields("calibration")),
        energy=_energy(top, spec.n_layers),
        versions=_versions(top.fields("versions")),
        created=top.text("created"),
        tensors_sha256=top.text("tensors_sha256", pattern=_HEX64),
        format_version=version,
        tensors_file=_tensors_file(top.raw("tensors_file", TENSORS)),
        extra=_extra(top.raw("extra", {})),
        method=_method(top.raw("method", DEFAULT_METHOD)),
        missed_mass_fractions=_fractions(top) if version >= 2 else (),
    )
    top.done()
    return manifest


def _spec(spec: _Fields) -> SpecRecord:
    model_type = spec.choice("model_type", SUPPORTED)
    sizes = {key: spec.integer(key, 1, MAX_SIZE) for key in ("n_layers", "n_heads", "n_kv_heads", "head_dim")}
    sizes["hidden_size"] = spec.integer("hidden_size", 1, MAX_SIZE)
    max_positions = spec.integer("max_positions", 1, MAX_COUNT)
    spec.done()
    if sizes["n_heads"] % sizes["n_kv_heads"]:
        raise _Invalid(f"spec.n_heads {sizes['n_heads']} is not a multiple of spec.n_kv_heads {sizes['n_kv_heads']}")
    return SpecRecord(model_type=model_type, **sizes, max_positions=max_positions)


def _base_model(base: _Fields, n_layers: int) -> BaseModelRecord:
    record = BaseModelRecord(
        model_id=base.text("model_id"),
        revision=base.text("revision", nullable=True),
        kind=base.text("kind"),
        hub_id=base.text("hub_id", nullable=True),
        fingerprint=base.text("fingerprint", pattern=_HEX16),
        qk_signature=_signature(base, n_layers),
    )
    base.done()
    return record


def _signature(base: _Fields, n_layers: int) -> tuple[LayerSignature, ...] | None:
    if base.raw("qk_signature", None) is None:
        return None
    layers = []
    for layer in base.rows("qk_signature", n_layers):
        q_norm, k_norm = layer.number("q_norm"), layer.number("k_norm")
        if q_norm < 0 or k_norm < 0:
            raise _Invalid(f"{layer.where}: norms must be >= 0, got {q_norm} and {k_norm}")
        probes = layer.array("probes", SIGNATURE_PROBES)
        if not all(type(p) in (int, float) and math.isfinite(p) for p in probes):
            raise _Invalid(f"{layer.name('probes')} must hold finite numbers")
        layer.done()
        layers.append(LayerSignature(q_norm, k_norm, tuple(float(p) for p in probes)))
    return tuple(layers)


def _calibration(calibration: _Fields) -> CalibrationRecord:
    sources = []
    for source in calibration.rows("sources"):
        name, sha = source.text("name"), source.text("sha256", pattern=_CALIBRATION_SHA)
        sources.append(CalibrationSource(name, sha, source.integer("tokens", 1, MAX_COUNT)))
        source.done()
    if not sources:
        raise _Invalid("calibration.sources must name at least one source")
    tokens = calibration.integer("tokens", 1, MAX_COUNT)
    calibration.done()
    if tokens != sum(s.tokens for s in sources):
        raise _Invalid(f"calibration.tokens {tokens} is not the sum of its sources' tokens")
    return CalibrationRecord(tuple(sources), tokens)


def _energy(top: _Fields, n_layers: int) -> tuple[EnergyRow, ...]:
    rows = []
    for i, row in enumerate(top.rows("energy", n_layers)):  # the length is checked before any row is read
        layer = row.integer("layer", i, i)
        rows.append(EnergyRow(layer, row.number("before"), row.number("after")))
        row.done()
    return tuple(rows)


def _fractions(top: _Fields) -> tuple[float, ...]:
    values = top.array("missed_mass_fractions")
    if not 2 <= len(values) <= MAX_FRACTIONS:
        raise _Invalid(f"missed_mass_fractions must hold 2 to {MAX_FRACTIONS} numbers, got {len(values)}")
    if any(type(value) not in (int, float) or not 0 < value <= 1 for value in values):
        raise _Invalid("missed_mass_fractions must be numbers in (0, 1]")
    if any(b <= a for a, b in pairwise(values)):
        raise _Invalid("missed_mass_fractions must be strictly ascending")
    return tuple(float(value) for value in values)


def _versions(versions: _Fields) -> dict[str, str]:
    for key in versions.value:
        if not key.isprintable():
            raise _Invalid(f"versions has a key that is no printable string: {_describe(key)}")
    return {key: versions.text(key) for key in list(versions.value)}


def _tensors_file(value: object) -> str:
    """A plain file name: the tensors are read from inside the artifact folder, never elsewhere."""
    plain = (
        type(value) is str
        and value.isprintable()
        and value.endswith(".safetensors")
        and not any(c in value for c in "/\\:")
        and value not in (".", "..")
    )
    if not plain:
        raise _Invalid(f"tensors_file must be a plain file name ending in .safetensors, got {_describe(value)}")
    return value


def _extra(value: object) -> dict:
    if not isinstance(value, dict):
        raise _Invalid(f"extra must be an object, got {_describe(value)}")
    stack = [(value, 1)]
    while stack:  # iterative: the check itself must not recurse
        item, depth = stack.pop()
        if depth > MAX_EXTRA_DEPTH:
            raise _Invalid(f"extra is nested deeper than {MAX_EXTRA_DEPTH} levels")
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return value


def _method(value: object) -> dict[str, str]:
    method = _Fields(value, "method")
    chosen = {"skew": method.choice("skew", SKEWS), "channels": method.choice("channels", CHANNEL_RULES)}
    method.done()
    return chosen
