"""The server's engine: a loaded model, its artifact and runtime settings, and the requests waiting and running.

Each request is planned alone before any work (``memory.plan``: its prompt, its new tokens, the GPU budget measured
as the engine started): one that cannot fit is refused (a 400 with the plan's line). Admitted ones wait in arrival
order; a worker thread takes them a batch at a time, the first waiting and those after it that decode alike (the
same sampling, no seed) while the memory plan admits one more row, up to ``max_batch``, and decodes the batch
through one cache under that plan (``cache_for(..., plan=)``) with ``infinigen.decode``, each row's tokens handed to
its caller as they come. A new request waits for the next batch (running ones never wait for it). A row's greedy
tokens are those it gets alone where the numerics let them be: where prompts are kept, a batch prefills a row at a
time (``generation.rows_alone``), so each row's prompt state and first token are its alone ones and only the decode
steps' batched products differ; where they are not, padding moves a shorter row's chunk boundaries (BENCHMARKS.md,
"Serving"). A row's stop strings, its own ``max_tokens`` and its caller's ``stopped()`` (a client gone) end it at
the next step; the batch's cache, closed, frees its memory whatever happened. A batch that fails runs its rows again
alone where none had text yet, so only the request at fault gets the error.

Prompts are kept across requests in host memory (``PromptCache``, ``--prompt-cache-gb``): a request whose prompt
starts with a kept one (a document asked about again, a conversation's earlier turns) computes only the rest
(``KeptPrompt.usable``: a cold run's state, to rounding where the cut falls inside a chunk); its usage says how many
came from the cache. Each row of a batch is served and kept as it would be alone; where a policy's or a layer's
state depends on where a row starts (Quest's pages, sliding windows), a request over one prefill chunk runs alone
instead, and shorter ones batch unkept. Where the host cannot hold a request's pool beside the kept prompts, the
least recently used go first.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, StoppingCriteria, StoppingCriteriaList

from infinigen.artifacts import Artifact
from infinigen.errors import InfinigenError
from infinigen.runtime import cache_argument, cache_for, decode
from infinigen.runtime.cache.kept import restorable_rows
from infinigen.runtime.cache.prompt_file import PromptFileError, load_prompt, read_manifest, save_prompt
from infinigen.runtime.cache.prompts import PromptCache, model_fingerprint, prompt_name
from infinigen.runtime.config import KEPT_CHUNK, config_from
from infinigen.runtime.memory import plan as memory
from infinigen.runtime.selection.policies import policy_class
from infinigen.runtime.text import left_padded, pad_token_id
from infinigen.serve import MAX_BATCH
from infinigen.serve.metrics import Metrics
from infinigen.serve.protocol import Ask, RequestError


@dataclass
class Answer:
    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt's, from a kept prompt


class Tokens:
    """One row's new tokens, as text, to ``on_text`` (the part of the text no stop string can still claim),
    until an end token, a stop string or ``limit`` tokens; what it ended on. Detokenised incrementally (as
    vLLM and TGI do): each token decodes a few tokens, not the whole answer again."""

    def __init__(self, tokenizer, stops: tuple[str, ...], on_text: Callable[[str], None], ends: set[int], limit: int):
        self.tokenizer, self.stops, self.on_text, self.ends, self.limit = tokenizer, stops, on_text, ends, limit
        self.ids: list[int] = []
        self.sent = 0  # characters of the text handed on
        self.finish_reason: str | None = None
        self.text = ""
        self.prefix = self.read = 0  # ids[prefix:read] decoded last time, before the text's end
        self.held = max((len(s) - 1 for s in stops), default=0)  # a stop string may be starting in these

    def put(self, token: int) -> None:
        if self.finish_reason is not None:
            return
        if token in self.ends:
            self._end("stop")
            return
        self.ids.append(token)
        searched = max(0, len(self.text) - self.held)  # a stop string ending in the new text starts after this
        self.text += self._decoded()
        hits = [i for i in (self.text.find(s, searched) for s in self.stops) if i >= 0]
        if hits:
            self.finish_reason, self.text = "stop", self.text[: min(hits)]
            self._flush(self.text)
        elif len(self.ids) >= self.limit:
            self._end("length")
        else:
            self._flush(self.text[: len(self.text) - self.held])

    def _decoded(self, final: bool = False) -> str:
        """The text the tokens since ``read`` add: ids[prefix:] decoded less ids[prefix:read] decoded (so that a
        word's leading space comes out as in a whole decode); none while they end inside a multi-byte character,
        unless ``final``."""
        before = self.tokenizer.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self.prefix :], skip_special_tokens=True)
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]

    def _end(self, reason: str | None) -> None:
        self.text += self._decoded(final=True)
        self.finish_reason = reason
        self._flush(self.text)

    def _flush(self, text: str) -> None:
        if len(text) > self.sent:
            self.on_text(text[self.sent :])
            self.sent = len(text)

    def end(self) -> None:
        if self.finish_reason is None:
            self._end(None)


class Rows(StoppingCriteria):
    """``infinigen.decode``'s streamer and stopping criterion for a batch: row b's tokens to ``tokens[b]``,
    and row b done once it has ended or ``stopped[b]()`` says so (a client gone)."""

    def __init__(self, tokens: list[Tokens], stopped: list[Callable[[], bool]]) -> None:
        self.tokens, self.stopped = tokens, stopped
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # the first call carries the prompt
            self.prompt_seen = True
            return
        for row, token in zip(self.tokens, value.reshape(-1).tolist(), strict=True):
            row.put(token)

    def end(self) -> None:
        for row in self.tokens:
            row.end()

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        for row, gone in zip(self.tokens, self.stopped, strict=True):
            if row.finish_reason is None and gone():
                row.finish_reason = "stop"  # its later tokens (padding) are not its own
        done = [row.finish_reason is not None for row in self.tokens]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


@dataclass(eq=False)
class Waiting:
    """An admitted request: what it runs, its plan alone, its caller's ends; its answer or error once done."""

    ask: Ask
    ids: list[int]
    new_tokens: int
    plan: memory.MemoryPlan
    on_text: Callable[[str], None]
    stopped: Callable[[], bool]
    done: threading.Event = field(default_factory=threading.Event)
    answer: Answer | None = None
    error: BaseException | None = None
    sent: bool = False  # some of its text went to its caller
    alone: bool = False  # its batch failed: it runs in none again
    arrived: float = field(default_factory=time.perf_counter)  # its first token's latency counts from here


class Engine:
    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        artifact: Artifact | None,
        settings: dict,
        name: str,
        prefill_chunk: int = KEPT_CHUNK,
        max_batch: int = MAX_BATCH,
        prompt_dir: Path | None = None,
    ) -> None:
        """``prefill_chunk``: the prefill's chunk where prompts are kept (a cold run's and the rest's boundaries);
        ``max_batch``: the most requests decoded together; ``prompt_dir``: where kept prompts are read from at
        start and written to at shutdown (``save_prompts``)."""
        if max_batch < 1:
            raise InfinigenError(f"the largest batch must be at least 1, got {max_batch}")
        self.model, self.tokenizer, self.artifact, self.name = model, tokenizer, artifact, name
        self.prefill_chunk, self.max_batch = prefill_chunk, max_batch
        self.config = config_from(settings)  # refused here if bad
        self.paged = policy_class(self.config.policy).paged
        self.device = next(model.parameters()).device
        self.metrics = Metrics()
        self.draining = False  # shutting down: running requests finish, new ones are refused
        # the GPU budget every batch is planned in, measured once with the weights loaded and nothing running:
        # batches run one at a time, each with the whole of it (measured while one runs, it would be less)
        self.budget = memory.budget_bytes(self.config.gpu_memory_gb, self.device)
        # a request's pool comes first: kept prompts are evicted for it where the host cannot hold both (``admit``)
        self.prompts = PromptCache.of(self.config)
        # batches prefill a row at a time, each served from and kept in the prompt cache (``generation.rows_alone``)
        self.rowwise = self.prompts is not None and restorable_rows(self.config.policy, model.config)
        self.context = model.config.max_position_embeddings
        self.pad = pad_token_id(tokenizer)
        configured = getattr(model.generation_config, "eos_token_id", None)
        self.ends = set(configured if isinstance(configured, list) else [configured]) | {tokenizer.eos_token_id}
        self.ends.discard(None)
        self.waiting: list[Waiting] = []  # admitted, in arrival order
        self.turn = threading.Lock()  # held by whoever changes ``waiting`` or the worker
        self.worker: threading.Thread | None = None  # decodes while requests wait, then ends
        self.prompt_dir = prompt_dir
        self.prompt_files: dict[str, Path] = {}  # this model's prompt files in ``prompt_dir``, by name
        if prompt_dir is not None:
            if self.prompts is None:
                raise InfinigenError("a prompt directory needs kept prompts: a prompt cache above 0 GB")
            self._read_prompts(prompt_dir)

    @classmethod
    def load(
        cls, model: str | None, artifact: str | None, settings: dict, name: str, device=None, dtype=None, **options
    ) -> Engine:
        """The engine of ``model`` and ``artifact`` as the command line names them (``load_model``'s names, a
        folder or Hub id), the artifact checked against the model; ``options``: the constructor's."""
        from infinigen.artifacts import open_artifact, read_artifact
        from infinigen.models import load_model

        read = read_artifact(artifact)  # a missing or corrupted artifact before the model loads
        loaded = load_model(model, device=device, dtype=dtype)
        checked = open_artifact(read, loaded.model) if read is not None else None
        return cls(loaded.model, loaded.tokenizer, checked, settings, name, **options)

    def _read_prompts(self, folder: Path) -> None:
        """Keep the prompt files of ``folder`` made for this model and artifact, oldest first (the least recently
        used where they exceed the budget); one that cannot be read is left where it is, with a line on stderr."""
        model = model_fingerprint(self.model)
        artifact = self.artifact.manifest.tensors_sha256 if self.artifact is not None else None
        for path in sorted(folder.glob("*.prompt"), key=lambda p: p.stat().st_mtime):
            try:
                key = read_manifest(path)[0]["key"]
                if key.get("model") != model or key.get("artifact") != artifact:
                    continue  # another model's, or another artifact's: not this server's to use or remove
                kept = load_prompt(path, self.device)
            except (PromptFileError, KeyError, TypeError) as exc:
                print(f"infinigen serve: {path} not kept: {exc}", file=sys.stderr)
                continue
            self.prompts.add(kept)
            self.prompt_files[path.stem] = path

    def save_prompts(self) -> int:
        """Write every kept prompt to ``prompt_dir`` (each once: one read at start and kept is already there) and
        remove this model's files of prompts no longer kept: the directory holds what the cache holds. Returns
        how many were written."""
        if self.prompt_dir is None or self.prompts is None:
            return 0
        self.prompt_dir.mkdir(parents=True, exist_ok=True)
        written, kept = 0, {}
        for prompt in list(self.prompts.entries.values()):
            name = prompt_name(prompt)
            kept[name] = self.prompt_dir / f"{name}.prompt"
            if name not in self.prompt_files:
                save_prompt(prompt, kept[name])
                written += 1
        for name, path in self.prompt_files.items():
            if name not in kept:
                path.unlink(missing_ok=True)
        self.prompt_files = kept
        return written

    def prompt_ids(self, ask: Ask) -> list[int]:
        if not ask.chat:
            return self.tokenizer(ask.prompt)["input_ids"]
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("this model's tokenizer has no chat template: use /v1/completions", "messages")
        text = self.tokenizer.apply_chat_template(list(ask.messages), tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def admit(self, ask: Ask) -> tuple[list[int], int, memory.MemoryPlan]:
        """The request's prompt, new tokens and plan alone, or ``RequestError`` before any work: a model other
        than this one, a prompt the context cannot hold, a run the memory plan cannot fit."""
        if ask.model != self.name:
            raise RequestError(f"model {ask.model!r} is not served here: {self.name!r} is", "model", 404)
        if self.config.exact and ask.sampling.temperature > 0:  # the API's default temperature is 1
            raise RequestError(
                "this server decodes exactly (--exact), which is greedy: send temperature 0", "temperature"
            )
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
        found = self._plan([ids], new_tokens, keeps=self.prompts is not None)
        if self.prompts is not None:
            self.prompts.make_room(found)
        if why := memory.why_not(found):
            raise RequestError(why, "messages" if ask.chat else "prompt")
        return ids, new_tokens, found

    def _plan(self, prompts: list[list[int]], new_tokens: int, keeps: bool) -> memory.MemoryPlan:
        """The plan of a batch of ``prompts`` (left-padded to the longest) for ``new_tokens`` each: with kept
        prompts in chunks of ``prefill_chunk`` (the rest of a served prompt ends its chunks where a cold run
        does; a batched row has the chunks it has alone), else the prompt in one forward where it fits (the
        fastest); the plan's chunks where they must be smaller."""
        chunk = self.prefill_chunk if self.prompts is not None else None
        lengths, rowwise = {len(ids) for ids in prompts}, keeps and self.rowwise and len(prompts) > 1
        work = memory.Workload(len(prompts), max(lengths), new_tokens, chunk, len(lengths) > 1, keeps, rowwise=rowwise)
        return memory.plan_for(self.model, self.config, work, self.budget)

    def run(
        self, ask: Ask, admitted: tuple, on_text: Callable[[str], None], stopped: Callable[[], bool] = lambda: False
    ) -> Answer:
        """Decode ``ask`` (``admitted``: what ``admit`` said of it) in its batch, handing its text to ``on_text``
        as it comes; ``stopped()``, asked at every step, ends it early (a client gone)."""
        request = Waiting(ask, *admitted, on_text, stopped)
        with self.turn:
            self.waiting.append(request)
            self.metrics.add("queued", 1)
            if self.worker is None:
                self.worker = threading.Thread(target=self._work, name="infinigen-engine", daemon=True)
                self.worker.start()
        request.done.wait()
        if request.error is not None:
            raise request.error
        return request.answer

    def _work(self) -> None:
        """The worker: a batch at a time while requests wait."""
        while True:
            with self.turn:
                taken = self._take()
                if taken is None:
                    self.worker = None
                    return
            batch, found = taken
            self.metrics.batched(len(batch))
            self.metrics.add("active", len(batch))
            try:
                self._decode_batch(batch, found)
            finally:
                self.metrics.add("active", -len(batch))

    def _take(self) -> tuple[list[Waiting], memory.MemoryPlan] | None:
        """The next batch and its plan (``waiting`` locked): the first request waiting, then those after it that
        decode alike while the plan admits one more row, up to ``max_batch`` (with a paged policy, Quest's, of the
        first one's length only). One with a seed runs alone (its own random stream), as do long ones where
        kept rows cannot be placed in a batch (``_batches``). Those whose client left are answered, unrun."""
        for gone in [r for r in self.waiting if r.stopped()]:
            self.waiting.remove(gone)
            self.metrics.add("queued", -1)
            gone.answer = Answer("", "stop", len(gone.ids), 0)
            gone.done.set()
        if not self.waiting:
            return None
        batch, found = [self.waiting[0]], self.waiting[0].plan
        if self._batches(batch[0]):
            for other in self.waiting[1:]:
                if len(batch) == self.max_batch:
                    break
                if not self._batches(other) or other.ask.sampling != batch[0].ask.sampling:
                    continue
                if self.paged and len(other.ids) != len(batch[0].ids):  # padding would move its pages
                    continue
                rows = [*batch, other]
                grown = self._plan([r.ids for r in rows], max(r.new_tokens for r in rows), self.prompts is not None)
                if grown.fits and memory.fits_host(grown):
                    batch, found = rows, grown
        for request in batch:
            self.waiting.remove(request)
        self.metrics.add("queued", -len(batch))
        return batch, found

    def _batches(self, request: Waiting) -> bool:
        """Whether ``request`` may share a batch: where prompts are kept, only where batches prefill a row at a time
        (each row served and kept as alone) or it is within one prefill chunk (a kept prompt could serve little)."""
        if self.max_batch == 1 or request.alone or request.ask.sampling.seed is not None:
            return False
        return self.prompts is None or self.rowwise or len(request.ids) <= self.prefill_chunk

    def _decode_batch(self, batch: list[Waiting], found: memory.MemoryPlan) -> None:
        """Decode ``batch`` under ``found``, each request answered (or its error set) and told it is done."""
        times: list[list[float]] = [[] for _ in batch]

        def timed(row: int) -> Callable[[str], None]:
            def on_text(text: str) -> None:
                times[row].append(time.perf_counter())
                batch[row].sent = True
                batch[row].on_text(text)

            return on_text

        tokens = [
            Tokens(self.tokenizer, r.ask.stop, timed(i), set() if r.ask.ignore_eos else self.ends, r.new_tokens)
            for i, r in enumerate(batch)
        ]
        rows = Rows(tokens, [r.stopped for r in batch])
        alone = len(batch) == 1
        try:
            cached, peak = self._generate(batch, found, rows, self.prompts if alone or self.rowwise else None)
        except Exception as exc:  # the batch's failure: each row again alone where it had no text yet
            retry = [r for r in batch if not alone and not r.sent]
            for request in batch:
                if request in retry:
                    request.alone = True
                else:
                    request.error = RequestError(str(exc), status=400) if isinstance(exc, InfinigenError) else exc
                    request.done.set()
            with self.turn:
                self.waiting[:0] = retry
                self.metrics.add("queued", len(retry))
            return
        rows.end()
        for request, row, row_times, served in zip(batch, tokens, times, cached, strict=True):
            arrived = request.arrived
            self.metrics.finished(arrived, row_times, len(request.ids), len(row.ids), found, peak, served, self.prompts)
            request.answer = Answer(row.text, row.finish_reason or "length", len(request.ids), len(row.ids), served)
            request.done.set()

    def _generate(
        self, batch: list[Waiting], found, rows: Rows, prompts: PromptCache | None
    ) -> tuple[list[int], int | None]:
        """``model.generate`` over the batch's prompts, left-padded: each row's prompt tokens a kept prompt served
        and the GPU's peak (None elsewhere)."""
        inputs = left_padded([r.ids for r in batch], self.pad, self.device)
        chunk = found.workload.prefill_chunk
        kwargs = {"prefill_chunk_size": chunk} if chunk else {}
        sampling = batch[0].ask.sampling
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # batches differ in shape: each starts from no cached blocks, as planned
            torch.cuda.reset_peak_memory_stats(self.device)
        with cache_for(self.model, self.artifact, plan=found, prompts=prompts) as cache, torch.no_grad():
            self.model.generate(
                **inputs,
                max_new_tokens=max(r.new_tokens for r in batch),
                **sampling.generate_kwargs(),
                custom_generate=decode,
                decode_streamer=rows,
                stopping_criteria=StoppingCriteriaList([rows]),
                pad_token_id=self.pad,
                eos_token_id=None,  # each row's end tokens are its own (``Tokens``: none with ignore_eos)
                **kwargs,
                **{cache_argument(self.model): cache},
            )
            cached = cache.reused_rows or [cache.reused_tokens] * len(batch)  # (a batch prefilled whole: none)
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        return cached, peak
