"""Run-time settings, checked once, frozen (like FlexGen's Policy).

Each field is defined once, here, with its help text: the command line builds every runtime option
of ``generate``, ``bench`` and ``eval`` from these fields (``infinigen.cli.options``). Importing this
module needs neither torch nor transformers.
"""

from __future__ import annotations

import functools
import math
import types
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from infinigen.errors import InfinigenError

PolicyName = Literal["dense", "full", "infinigen", "h2o", "quest", "oracle", "int4", "int2"]
Eviction = Literal["counter", "fifo", "lru"]
LookaheadFrom = Literal["input", "attention"]
PartialKeyBits = Literal[4, 8, 16]
KVBits = Literal[16, 8]
ReuseRows = Literal["auto", "on", "off"]
Allocation = Literal["adaptive", "uniform"]
DEFAULT_RESIDENT_EXTRA = 2.0  # RuntimeConfig.resident_extra where rows are reused and none is given
KEPT_CHUNK = 4096  # the prefill chunk where kept prompts are used and none is asked (``generate``'s default)
MOST_DRAFTS = 16  # adaptive drafting's ceiling (``draft_tokens`` 0)


def option(default: Any, help: str, *, applies_to: tuple[str, ...] = (), cli: bool = True) -> Any:
    """A config field with its command-line help. ``applies_to``: the ``Policy`` flags (``speculates``,
    ``budgeted``, ``offloads``, ``lookahead``, ``plain_rows``) of the policies it changes, all of them set; a sweep
    varies it only for them. ``cli``: False for fields the command line leaves at their default."""
    return field(default=default, metadata={"help": help, "applies_to": applies_to, "cli": cli})


@dataclass(frozen=True)
class RuntimeConfig:
    policy: PolicyName = option(
        "infinigen",
        "Which tokens a decode step fetches: infinigen (speculated, the paper), full (all, FlexGen-style), "
        "dense (KV stays on the GPU), h2o, quest, oracle (exact top-k), int4 / int2 (quantized rows).",
    )
    # 0.1 with adaptive allocation: within 2% of dense perplexity on PG-19 books at 8K with SmolLM2
    # (ACCURACY.md, "Long context")
    budget: float = option(
        0.1,
        "The fraction of the cached tokens fetched per decode step (averaged over the offloaded layers); "
        "1.0 fetches every token: dense decoding.",
        applies_to=("budgeted",),
    )
    # The paper's count rule fetches only the tokens within alpha of each head's best, at most the
    # budget: on SmolLM2 at 8K its alpha of 5 fetched 4.4% at budget 0.2 and lost 10% perplexity
    # (ACCURACY.md, "Settings chosen by measurement"), so by default the budget alone decides.
    alpha: float = option(
        math.inf,
        "The paper's count rule: fetch only the tokens within alpha logits of each head's best, at most "
        "the budget (the paper: 4 for OPT, 5 for Llama). inf: the budget alone.",
        applies_to=("speculates",),
    )
    allocation: Allocation = option(
        "adaptive",
        "How the budget is split over the offloaded layers: adaptive (more where the artifact's attention "
        "statistics show attention spread over more tokens; the same total) | uniform (the budget each).",
        applies_to=("budgeted",),
    )
    sink_tokens: int = option(
        0,
        "infinigen always fetches each sequence's first this many cached tokens (attention sinks), within the budget.",
        applies_to=("speculates",),
    )
    # 64: on PG-19 at 10%, SmolLM2 8K +1.78% -> +1.52% of dense's perplexity, Qwen2.5-Coder-0.5B 16K
    # +16.96% -> +5.21% (ACCURACY.md, "Long context")
    recent_tokens: int = option(
        64,
        "infinigen always fetches the last this many cached tokens (a recent window), within the budget "
        "and at most half of it.",
        applies_to=("speculates",),
    )
    min_tokens: int = option(8, "Fewest tokens fetched per step and layer (when that many are cached).", cli=False)
    dense_layers: int = option(
        2,
        "The first this many layers keep their whole KV on the GPU (as the paper); with 0, speculating "
        "policies select layer 0's rows from its own input. A GPU budget lowers it only as a last resort.",
    )
    cpu_pool_gb: float | None = option(
        None,
        "Limit of the CPU KV pool in GB (10^9 bytes); a full pool evicts. Default: no limit.",
        applies_to=("offloads",),
    )
    eviction: Eviction = option(
        "counter", "What a full CPU pool overwrites: counter (the paper) | fifo | lru.", applies_to=("offloads",)
    )
    block_tokens: int = option(1024, "The CPU pool grows by blocks of this many tokens.", cli=False)
    # A later prefill chunk reads the earlier chunks' KV this many tokens at a time (two such blocks staged
    # on the GPU per layer, and one block's keys repeated for each query head of a group): the prefill's
    # attention workspace, whatever the context.
    prefill_block_tokens: int = option(
        4096, "A later prefill chunk attends to the earlier chunks' KV this many tokens at a time.", cli=False
    )
    # the next offloaded layer's earlier blocks, all of them, queued as soon as this layer's are: held on the
    # GPU through the layer between (the plan keeps them only where its budget has room left)
    prefill_fetch_ahead: bool = option(
        True,
        "A later prefill chunk fetches the next layer's earlier KV while this layer computes, where it fits.",
        applies_to=("offloads",),
    )
    cuda_graphs: bool = option(
        True, "On CUDA, replay decode steps (or each layer's selection) from CUDA graphs.", cli=False
    )
    # Drafted by the policy, verified by a forward that attends every cached row (as a prefill chunk does): the
    # tokens are dense decoding's, at the cost of one such forward per cycle instead of one per token (``full``)
    exact: bool = option(
        False,
        "Give the model's own greedy tokens: the policy drafts --draft-tokens tokens, one forward over them that "
        "attends every cached row verifies them, and the cache is cut back past the first one it corrects "
        "(16-bit rows; greedy decoding).",
        applies_to=("offloads",),
    )
    draft_tokens: int = option(
        4,
        "With --exact: tokens drafted before each verification; 0: adaptive, each cycle the count of the most "
        f"tokens a second the run's acceptance and timings so far promise (at most {MOST_DRAFTS}).",
        applies_to=("offloads",),
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
    # int8 codes with a float32 scale per (token, KV head, K/V), keys smoothed per channel: within 0.11% of
    # 16-bit rows' perplexity on SmolLM2, Qwen2.5-Coder-0.5B (16K, 32K) and Gemma-3-270m, the same needles, for
    # half the bytes a step moves (ACCURACY.md, "8-bit rows"); FP8 e4m3 lost more
    kv_bits: KVBits | None = option(
        None,
        "Bits per K/V value in the CPU pool and over the bus: 8 (int8, keys smoothed per channel first; a scale "
        "per token, KV head and K/V kept on the GPU; dequantised as rows are fetched: half the bytes) | 16 (the "
        "model's dtype: exactly its KV). Default: 8 for policies that offload plain rows.",
        applies_to=("offloads", "plain_rows"),
    )
    # auto: on where it pays and fits (memory.reuse.decide): on a GPU, for budgeted policies with an
    # unlimited pool, while the resident rows fit in what the memory plan leaves them (and reuse_gpu_gb);
    # on the CPU only for resident_extra, so that CPU and GPU attend the same rows
    reuse_rows: ReuseRows = option(
        "auto",
        "Keep each layer's fetched rows on the GPU between steps and move only new ones: fewer bytes, for "
        "the budget's share of the KV in GPU memory (budgeted policies, unlimited pool). auto: on where those "
        "rows fit in what the memory plan leaves them (and --reuse-gpu-gb), on the CPU only for --resident-extra, "
        "off with a CPU pool limit | on | off.",
        applies_to=("budgeted",),
    )
    reuse_gpu_gb: float | None = option(
        None,
        "Most GPU memory in GB (10^9 bytes) that auto row reuse may take (also at most what the memory plan "
        "leaves it). Default: what the memory plan leaves it.",
        applies_to=("budgeted",),
    )
    # Consecutive steps select mostly the same rows, and those a step drops still carry attention: kept
    # on the GPU, they are attended for no bytes moved. 2 where rows are reused: at 10% against 1 it took
    # Qwen2.5-Coder-0.5B at 16K from +2.28% to +1.33% of dense perplexity (0 rows kept: +5.19%), Gemma-3-270m
    # 1.8-3.7 points closer, and moves fewer rows a step (ACCURACY.md, "resident_extra"; BENCHMARKS.md,
    # "Row reuse"), for 30% of the offloaded KV on the GPU instead of 20%. Where auto reuse finds no room
    # for them, it keeps fewer (``reuse.fallback_extras``), then the selection alone.
    resident_extra: float | None = option(
        None,
        "With row reuse: room on the GPU for this share of a layer's selection again (of its width: the budget's "
        "share of the pool's capacity), for rows that recent steps selected; they are attended with the "
        "selection until new rows need their places (the least "
        f"recently selected go first). 0: the selection only. Default: {DEFAULT_RESIDENT_EXTRA:g} where rows "
        "are reused (auto keeps fewer, then none, where memory is short).",
        applies_to=("budgeted",),
    )
    # Kept 16-bit, the rows fetched as 8-bit codes are dequantised once, as they arrive; kept 8-bit, every
    # resident row is dequantised at every step for attention (1.45x dense against 1.26x at 8 x 16K on an H200,
    # BENCHMARKS.md "Targets"), for half the GPU memory: where that lets more rows of earlier steps stay, fewer move.
    resident_bits: KVBits | None = option(
        None,
        "With --kv-bits 8 and row reuse: bits of the rows kept on the GPU: 16 (dequantised as they arrive: the "
        "fastest step) | 8 (as moved; half the GPU memory, dequantised for attention at every step). Default: "
        "16 where they fit with the rows of earlier steps asked, else 8 where more of those fit.",
        applies_to=("budgeted", "plain_rows"),
    )
    # What the memory plan (``memory.plan``) fits a run into: its automatic choices (row reuse, rows of
    # earlier steps, dense layers, the prefill chunk) come from it, and a run it cannot fit is refused
    # before the weights load.
    # last resort of the memory plan: a streamed layer's weights cross the bus at every forward
    streamed_layers: int | None = option(
        None,
        "Decoder layers (spread evenly through the stack) whose weights live in host memory and reach the GPU "
        "one layer ahead of their use: for models larger than the card. Default: as few as the GPU budget "
        "needs, none where the weights fit.",
    )
    gpu_memory_gb: float | None = option(
        None,
        "GPU memory in GB (10^9 bytes) the run may use, weights included; the memory plan fits the run into it "
        "or refuses it. Default: the device's free memory at start.",
    )
    # kept prompts (``cache.prompts``): a prompt's KV stays in host memory after its run, and a later prompt that
    # starts with it computes only the rest
    prompt_cache_gb: float | None = option(
        None,
        "Host memory in GB (10^9 bytes) for prompts kept across the requests of a server (a later prompt that "
        "starts with a kept one computes only the rest), the least recently used evicted first (and for a request's "
        "pool); a batch job keeps the prefix its requests share, eval needle and lm-eval requests run one at a time "
        "the prompt before. Default: half the host memory available at start (more than it is refused); 0: none "
        "(none beside --cpu-pool-gb).",
    )
    # Tuning of the CUDA row gather (``kernels.transfer``): measured in BENCHMARKS.md, "Micro-benchmarks".
    gather_programs: int | None = option(
        None, "Programs of the persistent CUDA gather (default: half the GPU's SMs).", cli=False
    )
    gather_rows: int | None = option(
        None,
        "Rows a CUDA gather program moves per loop step, a power of two (default: 16).",
        cli=False,
    )

    def __post_init__(self) -> None:
        reuse = self.reuse_rows  # True / False and on / off spellings (yes, 1, ...) as before: on / off
        if isinstance(reuse, bool) or (isinstance(reuse, str) and reuse.lower() in _SWITCHES):
            object.__setattr__(self, "reuse_rows", "on" if _SWITCHES[str(reuse).lower()] else "off")
        for f in fields(self):  # every Literal field, the policy first, from its annotation
            _, optional, choices = field_type(f.name)
            value = getattr(self, f.name)
            if choices and value not in choices and not (optional and value is None):
                shown = ", ".join(map(str, choices))
                if f.name == "policy":
                    raise InfinigenError(f"unknown policy {value!r}: choose one of {shown}")
                raise InfinigenError(f"{f.name} must be one of {shown}, got {value!r}")
        if not 0 < self.budget <= 1:  # also refuses NaN
            raise InfinigenError(f"budget must be in (0, 1], got {self.budget}")
        if not self.alpha >= 0:
            raise InfinigenError(f"alpha must be non-negative (inf: the budget alone), got {self.alpha}")
        if self.dense_layers < 0 or self.attention_lookahead_layers < 0:
            raise InfinigenError("dense_layers and attention_lookahead_layers must be >= 0")
        if self.sink_tokens < 0 or self.recent_tokens < 0:
            raise InfinigenError("sink_tokens and recent_tokens must be >= 0")
        if self.min_tokens < 1 or self.block_tokens < 1 or self.prefill_block_tokens < 1:
            raise InfinigenError("min_tokens, block_tokens and prefill_block_tokens must be >= 1")
        if self.gather_programs is not None and self.gather_programs < 1:
            raise InfinigenError(f"gather_programs must be >= 1 (None: half the SMs), got {self.gather_programs}")
        if self.gather_rows is not None and (self.gather_rows < 1 or self.gather_rows & (self.gather_rows - 1)):
            raise InfinigenError(f"gather_rows must be a power of two, got {self.gather_rows}")
        if self.cpu_pool_gb is not None and not (0 < self.cpu_pool_gb < math.inf):
            raise InfinigenError(f"cpu_pool_gb must be positive, got {self.cpu_pool_gb}")
        if self.reuse_gpu_gb is not None and not (0 <= self.reuse_gpu_gb < math.inf):
            raise InfinigenError(f"reuse_gpu_gb must be >= 0 (None: no cap), got {self.reuse_gpu_gb}")
        if self.streamed_layers is not None and self.streamed_layers < 0:
            raise InfinigenError(f"streamed_layers must be 0 or more, got {self.streamed_layers}")
        if self.prompt_cache_gb is not None and not (0 <= self.prompt_cache_gb < math.inf):
            raise InfinigenError(f"prompt_cache_gb must be >= 0, got {self.prompt_cache_gb}")
        if self.gpu_memory_gb is not None and not (0 < self.gpu_memory_gb < math.inf):
            raise InfinigenError(f"gpu_memory_gb must be positive, got {self.gpu_memory_gb}")
        if self.resident_extra is not None and not 0 <= self.resident_extra <= 8:
            raise InfinigenError(f"resident_extra must be in [0, 8], got {self.resident_extra}")
        if self.resident_extra and self.reuse_rows == "off":
            raise InfinigenError("resident_extra keeps rows of earlier steps: it needs row reuse (auto or on)")
        if self.draft_tokens < 0:
            raise InfinigenError(f"draft_tokens must be at least 0 (0: adaptive), got {self.draft_tokens}")
        if self.exact and self.kv_bits == 8:
            raise InfinigenError("exact decoding verifies against the model's own KV: it needs kv_bits 16, not 8")
        if self.prompt_cache_gb and self.cpu_pool_gb is not None:
            raise InfinigenError(
                "kept prompts need an unlimited CPU pool (a limited one rewrites its slots): leave cpu_pool_gb out, "
                "or give prompt_cache_gb 0"
            )
        if self.reuse_rows == "on" and self.cpu_pool_gb is not None:
            raise InfinigenError("reuse_rows needs an unlimited CPU pool (an evicted slot would leave a stale row)")

    @property
    def resident_extra_or_default(self) -> float:
        """``resident_extra`` where rows are reused: as given, else the default."""
        return DEFAULT_RESIDENT_EXTRA if self.resident_extra is None else self.resident_extra


RUNTIME_FIELDS = tuple(fields(RuntimeConfig))


def config_from(row: dict) -> RuntimeConfig:
    """The ``RuntimeConfig`` of a ``settings_grid`` row (None: the field's default)."""
    return RuntimeConfig(**{key: value for key, value in row.items() if value is not None})


_SWITCHES = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}


@functools.cache
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
    if kind is str and {"on", "off"} <= set(choices) and text.lower() in _SWITCHES:  # true, yes, 0 ...
        return "on" if _SWITCHES[text.lower()] else "off"
    if choices and value not in choices:
        raise InfinigenError(f"{option} takes {', '.join(map(str, choices))}, got {text!r}")
    return value
