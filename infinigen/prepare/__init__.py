"""Offline preparation: calibration q/k -> per-layer skew matrices and kept channels -> artifact."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from infinigen import __version__
from infinigen.architectures import decoder_layers, fingerprint, model_spec, qk_signature
from infinigen.artifacts.format import Artifact
from infinigen.artifacts.manifest import (  # SKEWS, CHANNEL_RULES: the format names the methods
    CHANNEL_RULES,
    SKEWS,
    BaseModelRecord,
    CalibrationRecord,
    CalibrationSource,
    EnergyRow,
    Manifest,
    SpecRecord,
    channels_for_ratio,
)
from infinigen.errors import InfinigenError
from infinigen.models import LoadedModel
from infinigen.prepare.attention_stats import FRACTIONS, missed_mass
from infinigen.prepare.calibration import CalibrationSample, load_samples
from infinigen.prepare.capture import capture_qk
from infinigen.prepare.fold import partial_query_weight
from infinigen.prepare.skew import HeadSkew, group_queries, skew_head

Progress = Callable[[str, int, int], None]  # (stage, done, total)


# Share of head_dim kept as partial channels: 0.5 with the runtime's 4-bit partial keys meets the
# perplexity targets in less GPU memory than the paper's 0.3 at 16 bits (ACCURACY.md, "Settings chosen
# by measurement"; BENCHMARKS.md, "GPU memory").
DEFAULT_RATIO = 0.5


def n_channels_for(ratio: float, head_dim: int) -> int:
    if not 0 < ratio <= 1:  # also refuses NaN
        raise InfinigenError(f"--ratio must be in (0, 1], got {ratio}")
    return channels_for_ratio(ratio, head_dim)


@torch.no_grad()
def capture_samples(loaded: LoadedModel, samples: list[CalibrationSample], progress: Progress | None = None):
    """Per layer, per sample: (queries (heads, T, d), keys (kv_heads, T, d))."""
    model = loaded.model
    device = next(model.parameters()).device
    with capture_qk(model) as records:
        for done, sample in enumerate(samples):
            model(input_ids=sample.input_ids.to(device), use_cache=False)
            if progress:
                progress("calibration forward", done + 1, len(samples))
    return dict(records)


def capture_calibration(loaded: LoadedModel, samples: list[CalibrationSample], progress: Progress | None = None):
    """Per layer: (queries (heads, T_total, d), keys (kv_heads, T_total, d)), samples concatenated."""
    return {layer: _concatenated(pairs) for layer, pairs in capture_samples(loaded, samples, progress).items()}


def _concatenated(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([q for q, _ in pairs], dim=1), torch.cat([k for _, k in pairs], dim=1)


def skew_layer(queries: torch.Tensor, keys: torch.Tensor, n_kv_heads: int, n_channels: int, **method) -> list[HeadSkew]:
    """``method``: ``skew_head``'s skew, channel_rule and generator."""
    groups = group_queries(queries, n_kv_heads)
    return [skew_head(group_q, keys[h], n_channels, **method) for h, group_q in enumerate(groups)]


def prepare_artifact(
    loaded: LoadedModel,
    *,
    ratio: float = DEFAULT_RATIO,
    tokens: int = 2048,
    calibration: list[Path] | None = None,
    samples: list[CalibrationSample] | None = None,
    progress: Progress | None = None,
    skew: str = "svd",
    channel_rule: str = "top",
) -> Artifact:
    """Run calibration text through the model and build its skew artifact (not yet written).

    ``samples`` (already tokenized) replace the calibration texts, e.g. for random-weight models.
    ``skew="identity"`` / ``channel_rule="random"`` build the ablations (no skew; random channels).
    """
    if skew not in SKEWS or channel_rule not in CHANNEL_RULES:
        raise InfinigenError(
            f"skew must be one of {', '.join(SKEWS)} and channels one of {', '.join(CHANNEL_RULES)}, "
            f"got {skew!r} and {channel_rule!r}"
        )
    spec = model_spec(loaded.model.config)
    n_channels = n_channels_for(ratio, spec.head_dim)
    samples = samples or load_samples(loaded.tokenizer, calibration, tokens=tokens)
    captured = capture_samples(loaded, samples, progress)
    layers = decoder_layers(loaded.model)
    tensors: dict[str, torch.Tensor] = {}
    energy, missed = [], []
    generator = torch.Generator().manual_seed(0)
    for i in range(spec.n_layers):
        pairs = captured.pop(i)
        # OPT's captured queries carry the attention scaling already; RoPE models' do not
        missed.append(missed_mass(pairs, layers[i].self_attn.scaling if spec.rope else 1.0))
        method = {"skew": skew, "channel_rule": channel_rule, "generator": generator}
        heads = skew_layer(*_concatenated(pairs), spec.n_kv_heads, n_channels, **method)
        skew_matrices = torch.stack([h.skew_matrix for h in heads])
        channels = torch.stack([h.channels for h in heads])
        tensors[f"layers.{i}.skew_matrix"] = skew_matrices
        tensors[f"layers.{i}.channels"] = channels
        if not spec.rope:
            attn = layers[i].self_attn
            tensors[f"layers.{i}.partial_query_weight"] = partial_query_weight(
                attn.q_proj, attn.scaling, skew_matrices, channels
            )
        energy.append(
            EnergyRow(
                layer=i,
                before=round(sum(h.energy_before for h in heads) / len(heads), 6),
                after=round(sum(h.energy_after for h in heads) / len(heads), 6),
            )
        )
        if progress:
            progress("skew per layer", i + 1, spec.n_layers)
    measured = all(curve is not None for curve in missed)  # else no sample was long enough: version 1
    if measured:
        tensors.update({f"layers.{i}.missed_mass": curve for i, curve in enumerate(missed)})
    base_model = BaseModelRecord(
        **asdict(loaded.source), fingerprint=fingerprint(loaded.model), qk_signature=qk_signature(loaded.model)
    )
    manifest = Manifest(
        base_model=base_model,
        spec=SpecRecord(**asdict(spec)),
        ratio=float(ratio),
        n_channels=n_channels,
        calibration=CalibrationRecord(
            sources=tuple(CalibrationSource(s.name, s.sha256, s.tokens) for s in samples),
            tokens=sum(s.tokens for s in samples),
        ),
        energy=tuple(energy),
        method={"skew": skew, "channels": channel_rule},
        versions=_versions(),
        missed_mass_fractions=FRACTIONS if measured else (),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
    return Artifact(manifest, tensors)


def _versions() -> dict[str, str]:
    import transformers

    return {"infinigen": __version__, "torch": torch.__version__, "transformers": transformers.__version__}


def check_options(ratio: float, tokens: int, calibration: list[Path] | None, skew: str, channel_rule: str) -> None:
    """Refuse bad preparation options before the model loads (a large checkpoint takes minutes)."""
    n_channels_for(ratio, 1)
    if tokens < 16:
        raise InfinigenError(f"--tokens must be at least 16, got {tokens}")
    if skew not in SKEWS or channel_rule not in CHANNEL_RULES:
        raise InfinigenError(
            f"--skew takes {', '.join(SKEWS)} and --channels {', '.join(CHANNEL_RULES)}, "
            f"got {skew!r} and {channel_rule!r}"
        )
    for path in calibration or []:
        if not Path(path).is_file():
            raise InfinigenError(f"cannot read calibration file {path}: no such file")
