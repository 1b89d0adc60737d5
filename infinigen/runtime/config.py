"""Run-time settings, checked once, frozen (like FlexGen's Policy).

Each field is defined once, here, with its help text: the command line builds every runtime option
of ``generate``, ``bench`` and ``eval`` from these fields (``infinigen.cli.options``). Importing this
module needs neither torch nor transformers.
"""

from __future__ import annotations

import itertools
import math
import types
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from infinigen.errors import InfinigenError

PolicyName = Literal["dense", "full", "infinigen", "h2o", "quest", "oracle", "int4", "int2"]
Eviction = Literal["counter", "fifo", "lru"]
LookaheadFrom = Literal["input", "attention"]
PartialKeyBits = Literal[4, 8, 16]
DEFAULT_ALPHA = {"opt": 4.0}  # the paper's settings: 4 for OPT, 5 for Llama-2 (used for every RoPE family)
ROPE_ALPHA = 5.0


def option(default: Any, help: str, *, applies_to: tuple[str, ...] = (), cli: bool = True) -> Any:
    """A config field with its command-line help. ``applies_to``: the ``Policy`` flags (``speculates``,
    ``budgeted``, ``offloads``, ``lookahead``) of the policies it changes, all of them set; a sweep
    varies it only for them. ``cli``: False for fields the command line leaves at their default."""
    return field(default=default, metadata={"help": help, "applies_to": applies_to, "cli": cli})


@dataclass(frozen=True)
class RuntimeConfig:
    policy: PolicyName = option(
        "infinigen",
        "Which tokens a decode step fetches: infinigen (speculated, the paper), full (all, FlexGen-style), "
        "dense (KV stays on the GPU), h2o, quest, oracle (exact top-k), int4 / int2 (quantized rows).",
    )
    budget: float = option(
        0.2, "Most of the cached tokens fetched per step and layer, as a fraction.", applies_to=("budgeted",)
    )
    alpha: float | None = option(
        None,
        "Speculation threshold: tokens within alpha logits of each head's best (default: the paper's, "
        "4 for OPT, 5 for the Llama family, and none at budget 1; inf: the budget alone).",
        applies_to=("speculates",),
    )
    min_tokens: int = option(8, "Fewest tokens fetched per step and layer (when that many are cached).", cli=False)
    dense_layers: int = option(2, "The first layers keep their whole KV on the GPU (as the paper).", cli=False)
    cpu_pool_gb: float | None = option(
        None,
        "Limit of the CPU KV pool in GB (10^9 bytes); a full pool evicts. Default: no limit.",
        applies_to=("offloads",),
    )
    eviction: Eviction = option(
        "counter", "What a full CPU pool overwrites: counter (the paper) | fifo | lru.", applies_to=("offloads",)
    )
    block_tokens: int = option(1024, "The CPU pool grows by blocks of this many tokens.", cli=False)
    cuda_graphs: bool = option(
        True, "On CUDA, replay decode steps (or each layer's selection) from CUDA graphs.", cli=False
    )
    # "input" reads the residual stream entering layer i-1 (the paper; its transfer overlaps all of
    # layer i-1); "attention" the residual after layer i-1's attention (closer to layer i's input;
    # the transfer overlaps only layer i-1's MLP).
    lookahead_from: LookaheadFrom = option(
        "input",
        "What one-layer-ahead selection reads: input (the residual entering the previous layer, as the "
        "paper) | attention (the residual after the previous layer's attention).",
        applies_to=("offloads", "lookahead"),
    )
    # The residual stream changes fastest in the first layers: on SmolLM2 the first offloaded layer
    # alone decides the 8K needle (ACCURACY.md, "Settings chosen by measurement"), and one layer's
    # shorter overlap costs little.
    attention_lookahead_layers: int = option(
        1,
        "The first this many offloaded layers select from the residual after the previous layer's "
        "attention, whatever --lookahead-from says.",
        applies_to=("offloads", "lookahead"),
    )
    partial_key_bits: PartialKeyBits = option(
        4,
        "infinigen's partial key cache on the GPU: 4 (two codes a byte + a scale per token) | 8 | 16.",
        applies_to=("speculates",),
    )
    reuse_rows: bool = option(
        False,
        "Keep each layer's fetched rows on the GPU between steps and move only new ones: fewer bytes, for "
        "the budget's share of the KV in GPU memory (budgeted policies, unlimited pool).",
        applies_to=("budgeted",),
    )
    # Tuning of the CUDA row gather (``runtime.transfer``): measured in BENCHMARKS.md, "Things tried that did not pay".
    gather_programs: int | None = option(
        None, "Programs of the persistent CUDA gather (default: half the GPU's SMs).", cli=False
    )
    gather_rows: int = option(16, "Rows a CUDA gather program moves per loop step (a power of two).", cli=False)

    def __post_init__(self) -> None:
        if self.policy not in get_args(PolicyName):
            raise InfinigenError(f"unknown policy {self.policy!r}: choose one of {', '.join(get_args(PolicyName))}")
        if not 0 < self.budget <= 1:  # also refuses NaN
            raise InfinigenError(f"budget must be in (0, 1], got {self.budget}")
        if self.alpha is not None and not self.alpha >= 0:
            raise InfinigenError(f"alpha must be non-negative (inf: the budget alone), got {self.alpha}")
        if self.dense_layers < 0 or self.attention_lookahead_layers < 0:
            raise InfinigenError("dense_layers and attention_lookahead_layers must be >= 0")
        if self.min_tokens < 1 or self.block_tokens < 1:
            raise InfinigenError("min_tokens and block_tokens must be >= 1")
        for name in ("eviction", "lookahead_from", "partial_key_bits"):
            choices = get_args(_FIELD_TYPES[name])
            if getattr(self, name) not in choices:
                shown = ", ".join(map(str, choices))
                raise InfinigenError(f"{name} must be one of {shown}, got {getattr(self, name)!r}")
        if self.gather_programs is not None and self.gather_programs < 1:
            raise InfinigenError(f"gather_programs must be >= 1 (None: half the SMs), got {self.gather_programs}")
        if self.gather_rows < 1 or self.gather_rows & (self.gather_rows - 1):
            raise InfinigenError(f"gather_rows must be a power of two, got {self.gather_rows}")
        if self.cpu_pool_gb is not None and not (0 < self.cpu_pool_gb < math.inf):
            raise InfinigenError(f"cpu_pool_gb must be positive, got {self.cpu_pool_gb}")
        if self.reuse_rows and self.cpu_pool_gb is not None:
            raise InfinigenError("reuse_rows needs an unlimited CPU pool (an evicted slot would leave a stale row)")

    def for_model(self, model_type: str) -> RuntimeConfig:
        """This config with ``alpha`` resolved: at budget 1.0 none (every cached token is fetched, so
        decoding is dense decoding), else the paper's for the model family."""
        if self.alpha is not None:
            return self
        return replace(self, alpha=math.inf if self.budget >= 1 else DEFAULT_ALPHA.get(model_type, ROPE_ALPHA))


_FIELD_TYPES = {"eviction": Eviction, "lookahead_from": LookaheadFrom, "partial_key_bits": PartialKeyBits}
RUNTIME_FIELDS = tuple(fields(RuntimeConfig))


def settings_grid(values: dict[str, list]) -> list[dict]:
    """Rows of settings, one per combination of ``values`` (field -> values; ``policy`` first): a
    field varies only for the policies it applies to (its ``applies_to`` flags) and is None for the
    others, which then run with its default. Names that are no policy (transformers' own caches,
    in a benchmark) get no runtime settings at all."""
    from infinigen.runtime.policies import POLICIES  # the registry needs torch; the config does not

    rows = []
    for name in values["policy"]:
        policy = POLICIES.get(name)
        axes = {}
        for f in RUNTIME_FIELDS:
            if f.name == "policy" or f.name not in values:
                continue
            applies = policy is not None and all(getattr(policy, flag) for flag in f.metadata["applies_to"])
            axes[f.name] = values[f.name] if applies else [None]
        for combination in itertools.product(*axes.values()):
            row = {"policy": name, **dict(zip(axes, combination, strict=True))}
            if row not in rows:
                rows.append(row)
    return rows


def config_from(row: dict) -> RuntimeConfig:
    """The ``RuntimeConfig`` of a ``settings_grid`` row (None: the field's default)."""
    return RuntimeConfig(**{key: value for key, value in row.items() if value is not None})


_SWITCHES = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}


def field_type(name: str) -> tuple[type, bool, tuple]:
    """A field's value type (str, int, float, bool), whether it may be None, and its choices (Literal)."""
    hint = get_type_hints(RuntimeConfig)[name]
    optional = get_origin(hint) in (Union, types.UnionType) and type(None) in get_args(hint)
    if optional:
        hint = next(arg for arg in get_args(hint) if arg is not type(None))
    if get_origin(hint) is Literal:
        choices = get_args(hint)
        return type(choices[0]), optional, choices
    return hint, optional, ()


def parse_value(name: str, text: str, option: str | None = None, more_choices: tuple = ()) -> Any:
    """One value of the field ``name`` from text (a command line, lm-eval's model args): ``none`` is None
    where the field allows it; ``more_choices``: values a command accepts beyond the field's own."""
    kind, optional, choices = field_type(name)
    choices = choices + more_choices if choices else ()
    option = option or "--" + name.replace("_", "-")
    text = text.strip()
    if optional and text.lower() in ("none", "default"):
        return None
    if kind is bool:
        if text.lower() not in _SWITCHES:
            raise InfinigenError(f"{option} takes off or on, got {text!r}")
        return _SWITCHES[text.lower()]
    try:
        value = kind(text)
    except ValueError:
        raise InfinigenError(f"{option} takes {kind.__name__} values, got {text!r}") from None
    if kind is float and math.isnan(value):
        raise InfinigenError(f"{option} takes a number, got {text!r}")
    if choices and value not in choices:
        raise InfinigenError(f"{option} takes {', '.join(map(str, choices))}, got {text!r}")
    return value
