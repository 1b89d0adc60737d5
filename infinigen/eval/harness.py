"""infinigen as an lm-evaluation-harness model: ``--model infinigen``.

    pip install -e '.[lm-eval]'
    python -m infinigen.eval.harness --model infinigen \\
        --model_args pretrained=smollm2-135m,artifact=ART,policy=infinigen,budget=0.1 --tasks hellaswag

Model args: ``pretrained`` (alias, folder, GGUF, Hub id; default the embedded SmolLM2), ``artifact``
(folder or Hub id), ``device``, ``dtype``, ``batch_size``, ``max_length`` and every ``RuntimeConfig``
field (``policy``, ``budget``, ``alpha``, ...), parsed as the command line parses them.

lm-eval (0.4) finds models only in its own registry: it loads no plugins or entry points. So this
module's ``__main__`` imports itself (which registers ``infinigen``) and then runs lm-eval's own
command line; from Python, ``import infinigen.eval.harness`` before ``lm_eval.simple_evaluate(model=
"infinigen", ...)``.

Every request goes through the runtime's decode path, one fresh cache per batch:

- log-likelihood: the context prefilled densely, each continuation token predicted by a decode step
  (``continuation_scores``); tokenized as lm-eval's HFLM does (the context's trailing spaces move to
  the continuation, an empty context is the BOS token, or EOS where there is none);
- rolling log-likelihood: disjoint windows of ``max_length`` tokens, the first conditioned on BOS,
  each later one on the previous window's last token (lm-eval's windows at context_len 1);
- generation: ``model.generate`` with ``infinigen.decode``, cut at the request's ``until`` strings.

``HarnessModel`` holds this logic and needs no lm-eval; ``InfinigenLM`` adapts it to lm-eval's API.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from infinigen.errors import InfinigenError
from infinigen.eval.decoding import continuation_scores, planned, scoring_plan
from infinigen.runtime import cache_argument, cache_for, decode, load
from infinigen.runtime.cache.prompts import PromptCache
from infinigen.runtime.config import KEPT_CHUNK, RUNTIME_FIELDS, config_from, parse_value
from infinigen.runtime.memory import plan as memory
from infinigen.runtime.text import pad_token_id

DEFAULT_BATCH = 8
DEFAULT_GEN_TOKENS = 256  # HFLM's max_gen_toks


def runtime_settings(args: dict[str, Any]) -> dict[str, Any]:
    """``RuntimeConfig`` settings from model args: each value, whatever type lm-eval's parser gave it,
    parsed again from its text as the command line parses it (``inf``, ``none``, ``on`` ...), then
    checked once by building the config."""
    names = {f.name for f in RUNTIME_FIELDS}
    unknown = sorted(set(args) - names)
    if unknown:
        known = ", ".join(sorted(names))
        raise InfinigenError(f"unknown model args {', '.join(unknown)}: runtime settings are {known}")
    settings = {name: parse_value(name, str(value), option=name) for name, value in args.items()}
    config_from(settings)  # a bad combination fails here, before any request
    return settings


def batch_size_of(value: Any) -> int:
    """lm-eval's ``batch_size`` (an int, or ``auto`` / ``auto:N``, which pick nothing here): an int."""
    if value is None or str(value).startswith("auto"):
        return DEFAULT_BATCH
    size = int(value)
    if size < 1:
        raise InfinigenError(f"batch_size must be at least 1, got {value}")
    return size


@dataclass
class HarnessModel:
    """Scores and generates text for lm-eval's requests through ``cache_for(model, artifact, **settings)``."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    artifact: Any = None  # an opened Artifact, a folder or Hub id, or None (the model's own, if any)
    settings: dict[str, Any] | None = None
    batch_size: int = DEFAULT_BATCH
    max_length: int | None = None  # default: the model's positions

    @classmethod
    def load(
        cls,
        pretrained: str | None = None,
        artifact: str | Path | None = None,
        device: str | None = None,
        dtype: str | None = None,
        batch_size: Any = None,
        max_length: int | None = None,
        **runtime: Any,
    ) -> HarnessModel:
        settings = runtime_settings(runtime)
        model, tokenizer = load(pretrained, artifact=artifact, device=device, dtype=None if dtype == "auto" else dtype)
        harness = cls(model, tokenizer, None, settings, batch_size_of(batch_size), max_length)
        cache_for(model, None, **settings).close()  # a policy without its artifact fails now, not at the first request
        return harness

    def __post_init__(self) -> None:
        self.settings = dict(self.settings or {})
        self.max_length = int(self.max_length or self.model.config.max_position_embeddings)
        tokenizer = self.tokenizer
        self.pad = pad_token_id(tokenizer)
        # a request scored or generated alone starts from the longest kept prompt it shares (a few-shot preamble,
        # a haystack before its needle): batched ones are computed whole
        self.prompts = PromptCache.of(config_from(self.settings))

    @property
    def prefix_token_id(self) -> int:
        """What an empty context stands for (HFLM's choice): BOS, else EOS."""
        tokenizer = self.tokenizer
        token = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        if token is None:
            raise InfinigenError("the tokenizer has neither a BOS nor an EOS token to stand for an empty context")
        return token

    # ---- tokenization (HFLM's) ----

    def encode(self, text: str, special: bool | None = None) -> list[int]:
        """Token ids of ``text``: with the tokenizer's usual special tokens unless ``special`` is False,
        and none where the text already starts with the BOS token."""
        bos = self.tokenizer.bos_token
        if special is None:
            special = not (bos and text.startswith(bos))
        return self.tokenizer(text, add_special_tokens=special).input_ids

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids), split where the whole text's tokens pass the context's:
        a word is tokenized as it is in running text."""
        if not context:
            return [self.prefix_token_id], self.encode(continuation, special=False)
        spaces = len(context) - len(context.rstrip())
        if spaces:  # " word" tokenizes as one token in most vocabularies, "word" after " " does not
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, head = self.encode(context + continuation), self.encode(context)
        return head, whole[len(head) :]

    # ---- requests ----

    def score_tokens(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log-likelihood, is greedy) of each (context ids, continuation ids), in batches of
        ``batch_size`` longest first (less padding), one-token contexts batched apart (their
        prefill is that token), each batch through a fresh cache."""
        pairs = [self._fit(context, continuation) for context, continuation in pairs]
        order = sorted(range(len(pairs)), key=lambda i: (len(pairs[i][0]) > 1, sum(map(len, pairs[i]))), reverse=True)
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        for group in (
            [i for i in order if len(pairs[i][0]) > 1],
            [i for i in order if len(pairs[i][0]) == 1],
        ):
            for start in range(0, len(group), self.batch_size):
                batch = [pairs[i] for i in group[start : start + self.batch_size]]
                kept = self._kept(len(batch))
                found = scoring_plan(self.model, self.settings, batch, keeps=kept is not None)
                with cache_for(self.model, self.artifact, plan=found, prompts=kept) as cache:
                    scores = continuation_scores(self.model, cache, batch, self.pad, found.workload.chunk)
                for i, score in zip(group[start : start + self.batch_size], scores, strict=True):
                    results[i] = score
        return results  # type: ignore[return-value]

    def _kept(self, rows: int) -> PromptCache | None:
        """The kept prompts a batch of ``rows`` starts from and adds to: one row's only."""
        return self.prompts if rows == 1 else None

    def _fit(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """The pair within ``max_length + 1`` tokens (the last is only predicted, never fed): the
        context loses its oldest tokens, as in HFLM; a continuation longer than that, its first."""
        if not continuation:
            raise InfinigenError("an empty continuation has no log-likelihood")
        continuation = continuation[-self.max_length :]
        keep = self.max_length + 1 - len(continuation)
        return context[-keep:], continuation

    def loglikelihood(self, requests: Iterable[tuple[str, str]]) -> list[tuple[float, bool]]:
        return self.score_tokens([self.encode_pair(context, continuation) for context, continuation in requests])

    def rolling_windows(self, text: str) -> list[tuple[list[int], list[int]]]:
        """Disjoint windows covering ``text``'s tokens: (context, continuation) pairs of lm-eval's
        ``get_rolling_token_windows`` at context_len 1 made disjoint."""
        ids = self.encode(text, special=False)  # the prefix token plays BOS
        windows, previous = [], self.prefix_token_id
        for start in range(0, len(ids), self.max_length):
            chunk = ids[start : start + self.max_length]
            windows.append(([previous], chunk))
            previous = chunk[-1]
        return windows

    def loglikelihood_rolling(self, texts: Iterable[str]) -> list[float]:
        per_text = [self.rolling_windows(text) for text in texts]
        scores = iter(self.score_tokens([window for windows in per_text for window in windows]))
        return [sum(next(scores)[0] for _ in windows) for windows in per_text]

    def generate_until(self, requests: Iterable[tuple[str, dict]]) -> list[str]:
        """Each context's continuation, greedy unless its ``gen_kwargs`` sample, cut before the first
        of its ``until`` strings; requests with the same kwargs decode together."""
        requests = list(requests)
        groups: dict[str, list[int]] = {}
        for i, (_, kwargs) in enumerate(requests):
            groups.setdefault(repr(sorted((kwargs or {}).items())), []).append(i)
        outputs: list[str] = [""] * len(requests)
        for indices in groups.values():
            kwargs = dict(requests[indices[0]][1] or {})
            for start in range(0, len(indices), self.batch_size):
                batch = indices[start : start + self.batch_size]
                texts = self._generate([requests[i][0] for i in batch], dict(kwargs))
                for i, text in zip(batch, texts, strict=True):
                    outputs[i] = text
        return outputs

    @torch.no_grad()
    def _generate(self, contexts: list[str], kwargs: dict) -> list[str]:
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        new_tokens = int(kwargs.pop("max_gen_toks", DEFAULT_GEN_TOKENS))
        if new_tokens >= self.max_length:
            raise InfinigenError(f"max_gen_toks ({new_tokens}) must be below the model's length ({self.max_length})")
        temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
        sampling = bool(kwargs.pop("do_sample", False)) and temperature > 0
        options = {"do_sample": sampling} | ({"temperature": temperature} if sampling else {})
        for name in ("top_p", "top_k"):
            if sampling and kwargs.get(name) is not None:
                options[name] = kwargs[name]
        room = self.max_length - new_tokens  # the context loses its oldest tokens beyond this
        prompts = [self.encode(context)[-room:] for context in contexts]
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=self.model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.model.device)
        kept = self._kept(len(prompts))
        chunk = KEPT_CHUNK if kept is not None else None  # a served prompt's rest ends its chunks where a cold one's
        keeps = kept is not None
        found = planned(self.model, self.settings, len(prompts), width, new_tokens, chunk=chunk, keeps=keeps)
        if why := memory.why_not(found):
            raise InfinigenError(why)
        chunk = found.workload.prefill_chunk
        with cache_for(self.model, self.artifact, plan=found, prompts=kept) as cache:
            output = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                **({"prefill_chunk_size": chunk} if chunk is not None and chunk < width else {}),
                custom_generate=decode,
                pad_token_id=self.pad,
                **options,
                **{cache_argument(self.model): cache},
            )
        texts = self.tokenizer.batch_decode(output[:, width:], skip_special_tokens=True)
        return [cut(text, until) for text in texts]


def cut(text: str, until: list[str]) -> str:
    """``text`` up to the first occurrence of any of ``until``."""
    for stop in until:
        if stop:
            text = text.split(stop, 1)[0]
    return text


def harness_settings(model_args: dict, lm_eval_args: dict | None) -> dict:
    """The model's arguments: the model args, then lm-eval's own ``--batch_size`` / ``--device`` where the
    model args do not set them. lm-eval names a CUDA device unless told otherwise; on a machine without
    one that default falls back to the CPU, as transformers' own lm-eval model does (a device given in
    the model args is kept: asking for CUDA where there is none is then one clear error)."""
    extra = {key: value for key, value in (lm_eval_args or {}).items() if value is not None}
    if "device" not in model_args and str(extra.get("device", "")).startswith("cuda") and not torch.cuda.is_available():
        print(f"no CUDA device: running on the CPU instead of lm-eval's {extra['device']}", file=sys.stderr)
        extra["device"] = "cpu"
    return {**extra, **model_args}


try:  # lm-eval is an optional extra: without it the scoring above still serves Python callers
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError:  # pragma: no cover - exercised where lm-eval is absent
    LM = None

if LM is not None:

    @register_model("infinigen")
    class InfinigenLM(LM):
        """lm-eval's view of ``HarnessModel``: requests' ``args`` in, lm-eval's result tuples out."""

        def __init__(
            self,
            pretrained: str | None = None,
            artifact: str | None = None,
            device: str | None = None,
            dtype: str | None = None,
            batch_size: Any = None,
            max_batch_size: Any = None,  # lm-eval passes it for its "auto" batch sizes; unused
            max_length: int | None = None,
            **runtime: Any,
        ) -> None:
            super().__init__()
            self.harness = HarnessModel.load(pretrained, artifact, device, dtype, batch_size, max_length, **runtime)

        @classmethod
        def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> InfinigenLM:
            """lm-eval's constructor from the model args, with its own ``--batch_size`` / ``--device``
            (``additional_config``) where the model args do not set them: the model args win."""
            return cls(**harness_settings(arg_dict, additional_config))

        @classmethod
        def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> InfinigenLM:
            from lm_eval.utils import simple_parse_args_string

            return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

        @classmethod
        def of(cls, harness: HarnessModel) -> InfinigenLM:
            """Wrap an already loaded ``HarnessModel`` (a model in memory, tests)."""
            lm = cls.__new__(cls)
            LM.__init__(lm)
            lm.harness = harness
            return lm

        @property
        def device(self):
            return self.harness.model.device

        def loglikelihood(self, requests) -> list[tuple[float, bool]]:
            return self.harness.loglikelihood([request.args for request in requests])

        def loglikelihood_rolling(self, requests) -> list[float]:
            return self.harness.loglikelihood_rolling([request.args[0] for request in requests])

        def generate_until(self, requests) -> list[str]:
            return self.harness.generate_until([request.args for request in requests])


def main() -> None:
    """lm-eval's command line with ``infinigen`` registered; an error the user can fix (ours) is one line
    and exit code 2, as in ``infinigen``'s own commands."""
    if LM is None:
        print("error: lm-eval is not installed: pip install 'infinigen[lm-eval]'", file=sys.stderr)
        raise SystemExit(2)
    from lm_eval.__main__ import cli_evaluate

    try:
        cli_evaluate()
    except InfinigenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
