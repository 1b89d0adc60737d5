"""The server's engine: a loaded model, its artifact and runtime settings, decoding one request at a time.

Each request is planned before any work (``memory.plan``: its prompt, its new tokens, the GPU budget
measured as the engine started): one that cannot fit is refused (a 400 with the plan's line). One that fits
decodes through a fresh cache under that plan (``cache_for(..., plan=)``) with ``infinigen.decode``, its
tokens handed to the caller as they come. Requests wait their turn on a lock: a request's tokens are those
it would get alone. Its stop strings, and the caller's ``stopped()`` (a client gone), end it at the next
step; its cache, closed, frees its memory whatever happened.

Prompts are kept across requests in host memory (``PromptCache``, ``--prompt-cache-gb``): a request whose prompt
starts with a kept one (a document asked about again, a conversation's earlier turns) computes only the rest,
in the chunks a cold run has (the same tokens); its usage says how many came from the cache. Where the host
cannot hold a request's pool beside them, the least recently used go first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, StoppingCriteria, StoppingCriteriaList

from infinigen.artifacts import Artifact
from infinigen.errors import InfinigenError
from infinigen.runtime import cache_argument, cache_for, decode
from infinigen.runtime.cache.prompts import PromptCache
from infinigen.runtime.config import config_from
from infinigen.runtime.generation import KEPT_CHUNK
from infinigen.runtime.memory import plan as memory
from infinigen.runtime.text import left_padded, pad_token_id
from infinigen.serve.metrics import Metrics
from infinigen.serve.protocol import Ask, RequestError


@dataclass
class Answer:
    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt's, from a kept prompt


class Until(StoppingCriteria):
    """Ends decoding once ``done()`` says so (every row: one request a batch)."""

    def __init__(self, done: Callable[[], bool]) -> None:
        self.done = done

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.done(), dtype=torch.bool, device=input_ids.device)


class Tokens:
    """``infinigen.decode``'s streamer for one request: its new tokens, as text, to ``on_text`` (the part of the
    text no stop string can still claim), until a stop string or the end; what it ended on."""

    def __init__(self, tokenizer, stops: tuple[str, ...], on_text: Callable[[str], None], ends: set[int]) -> None:
        self.tokenizer, self.stops, self.on_text, self.ends = tokenizer, stops, on_text, ends
        self.ids: list[int] = []
        self.sent = 0  # characters of the text handed on
        self.prompt_seen = False
        self.finish_reason: str | None = None
        self.text = ""

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # the first call carries the prompt
            self.prompt_seen = True
            return
        if self.finish_reason is not None:
            return
        token = int(value.reshape(-1)[0])
        if token in self.ends:
            self.finish_reason = "stop"
            self._flush(self.text)
            return
        self.ids.append(token)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hits = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.finish_reason, self.text = "stop", self.text[: min(hits)]
            self._flush(self.text)
            return
        held = max((len(s) - 1 for s in self.stops), default=0)  # a stop string may be starting
        safe = self.text[: len(self.text) - held] if held else self.text
        if safe.endswith("\ufffd"):  # half of a multi-byte character
            safe = safe[:-1]
        self._flush(safe)

    def _flush(self, text: str) -> None:
        if len(text) > self.sent:
            self.on_text(text[self.sent :])
            self.sent = len(text)

    def end(self) -> None:
        if self.finish_reason is None:
            self._flush(self.text)


class Engine:
    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        artifact: Artifact | None,
        settings: dict,
        name: str,
        prefill_chunk: int = KEPT_CHUNK,
    ) -> None:
        """``prefill_chunk``: the prefill's chunk where prompts are kept (they serve whole chunks of it)."""
        self.model, self.tokenizer, self.artifact, self.name = model, tokenizer, artifact, name
        self.prefill_chunk = prefill_chunk
        self.config = config_from(settings)  # refused here if bad
        self.device = next(model.parameters()).device
        self.lock = threading.Lock()
        self.metrics = Metrics()
        self.draining = False  # shutting down: running requests finish, new ones are refused
        # the GPU budget every request is planned in, measured once with the weights loaded and nothing running:
        # requests run one at a time, each with the whole of it (measured while another runs, it would be less)
        self.budget = memory.budget_bytes(self.config.gpu_memory_gb, self.device)
        self.prompts = _prompt_cache(self.config.prompt_cache_gb)
        self.context = model.config.max_position_embeddings
        self.pad = pad_token_id(tokenizer)
        configured = getattr(model.generation_config, "eos_token_id", None)
        self.ends = set(configured if isinstance(configured, list) else [configured]) | {tokenizer.eos_token_id}
        self.ends.discard(None)

    def prompt_ids(self, ask: Ask) -> list[int]:
        if not ask.chat:
            return self.tokenizer(ask.prompt)["input_ids"]
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("this model's tokenizer has no chat template: use /v1/completions", "messages")
        text = self.tokenizer.apply_chat_template(list(ask.messages), tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def admit(self, ask: Ask) -> tuple[list[int], int, memory.MemoryPlan]:
        """The request's prompt, new tokens and plan, or ``RequestError`` before any work: a model other than
        this one, a prompt the context cannot hold, a run the memory plan cannot fit."""
        if ask.model != self.name:
            raise RequestError(f"model {ask.model!r} is not served here: {self.name!r} is", "model", 404)
        ids = self.prompt_ids(ask)
        if not ids:
            raise RequestError("the prompt has no tokens", "prompt")
        room = self.context - len(ids)
        new_tokens = ask.max_tokens if ask.max_tokens is not None else room
        if room < 1 or new_tokens > room:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({new_tokens}) exceeds the model's context of "
                f"{self.context} tokens",
                "max_tokens",
            )
        # with kept prompts in chunks of ``prefill_chunk`` (a kept prompt serves whole chunks), else the prompt in
        # one forward where it fits (the fastest); the plan's chunks where they must be smaller
        chunk = self.prefill_chunk if self.prompts is not None else None
        work = memory.Workload(1, len(ids), new_tokens, chunk, keeps=self.prompts is not None)
        found = memory.plan_for(self.model, self.config, work, self.budget)
        while self.prompts is not None and len(self.prompts) and not memory.fits_host(found):
            self.prompts.evict()  # the host's memory for this request's pool first
        if why := memory.why_not(found):
            raise RequestError(why, "messages" if ask.chat else "prompt")
        return ids, new_tokens, found

    def run(
        self, ask: Ask, admitted: tuple, on_text: Callable[[str], None], stopped: Callable[[], bool] = lambda: False
    ) -> Answer:
        """Decode ``ask`` (``admitted``: what ``admit`` said of it) in its turn, handing its text to ``on_text`` as
        it comes; ``stopped()``, asked at every step, ends it early (a client gone)."""
        ids, new_tokens, found = admitted
        with self.metrics.counting("queued"):
            self.lock.acquire()
        try:
            with self.metrics.counting("active"):
                if stopped():  # gone while it waited
                    return Answer("", "stop", len(ids), 0)
                return self._decode(ask, ids, new_tokens, found, on_text, stopped)
        finally:
            self.lock.release()

    def _decode(self, ask: Ask, ids, new_tokens: int, found, on_text, stopped) -> Answer:
        started = time.perf_counter()
        times: list[float] = []

        def timed(text: str) -> None:
            times.append(time.perf_counter())
            on_text(text)

        tokens = Tokens(self.tokenizer, ask.stop, timed, self.ends)
        inputs = left_padded([ids], self.pad, self.device)
        chunk = found.workload.prefill_chunk
        kwargs = {"prefill_chunk_size": chunk} if chunk else {}
        if ask.sampling.seed is not None:
            torch.manual_seed(ask.sampling.seed)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        until = Until(lambda: tokens.finish_reason is not None or stopped())
        try:
            with cache_for(self.model, self.artifact, plan=found, prompts=self.prompts) as cache, torch.no_grad():
                self.model.generate(
                    **inputs,
                    max_new_tokens=new_tokens,
                    **ask.sampling.generate_kwargs(),
                    custom_generate=decode,
                    decode_streamer=tokens,
                    stopping_criteria=StoppingCriteriaList([until]),
                    pad_token_id=self.pad,
                    **kwargs,
                    **{cache_argument(self.model): cache},
                )
                cached = cache.reused_tokens
        except InfinigenError as exc:
            raise RequestError(str(exc), status=400) from None
        tokens.end()
        finish = tokens.finish_reason or "length"
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        self.metrics.finished(started, times, len(ids), len(tokens.ids), found, peak, cached, self.prompts)
        return Answer(tokens.text, finish, len(ids), len(tokens.ids), cached)


def _prompt_cache(gb: float | None) -> PromptCache | None:
    """The server's kept prompts: ``gb`` GB of host memory, by default half of what the host has free now, none at 0."""
    if gb is None:
        available = memory.host_available_bytes()
        return PromptCache(None if available is None else available / 2 / 1e9)
    return PromptCache(gb) if gb > 0 else None
