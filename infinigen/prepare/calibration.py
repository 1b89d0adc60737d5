"""Calibration text: a bundled public-domain PG-19 excerpt (as the paper used) or user files."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from infinigen.errors import InfinigenError

BUNDLED_NAME = "bundled:pg19-excerpt"


@dataclass(frozen=True)
class CalibrationSample:
    name: str
    sha256: str  # of the text
    input_ids: torch.Tensor  # (1, tokens)

    @property
    def tokens(self) -> int:
        return self.input_ids.shape[1]


def bundled_text() -> str:
    return files("infinigen.prepare").joinpath("calibration.txt").read_text(encoding="utf-8")


def load_samples(
    tokenizer: PreTrainedTokenizerBase, paths: list[Path] | None = None, *, tokens: int = 2048
) -> list[CalibrationSample]:
    """One sample per text (the bundled excerpt when ``paths`` is empty), cut to ``tokens`` tokens."""
    if tokens < 16:
        raise InfinigenError(f"--tokens must be at least 16, got {tokens}")
    texts = [(BUNDLED_NAME, bundled_text())] if not paths else [(str(p), _read(p)) for p in paths]
    samples = []
    for name, text in texts:
        ids = tokenizer(text, return_tensors="pt").input_ids[:, :tokens]
        if ids.shape[1] < 16:
            raise InfinigenError(f"calibration text {name} is too short ({ids.shape[1]} tokens)")
        samples.append(CalibrationSample(name, hashlib.sha256(text.encode()).hexdigest(), ids))
    return samples


def _read(path: Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InfinigenError(f"cannot read calibration file {path}: {exc}") from exc
