"""``PromptCache``: kept prompts (``cache.kept``) in host memory across runs, found by a hash chain over
blocks of ``HASHED_TOKENS`` tokens, least recently used evicted beyond a byte budget.

    prompts = infinigen.PromptCache(gb=16)
    for question in questions:  # one long document: its KV is computed once
        cache = infinigen.cache_for(model, artifact, prompts=prompts)
        model.generate(document + question, past_key_values=cache, custom_generate=infinigen.decode)

A chain hash names each prefix of whole blocks: block j's hash covers the key (model, artifact, settings:
``prompt_key``) and every token up to the end of block j, so one lookup per block finds the kept prompts
that share a prompt's first j blocks; the tokens themselves then say how much one serves (``KeptPrompt.usable``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
import weakref
from collections import OrderedDict

import torch

from infinigen.architectures import fingerprint
from infinigen.errors import InfinigenError
from infinigen.runtime.cache.kept import KeptPrompt
from infinigen.runtime.memory import plan as memory
from infinigen.runtime.selection.policies import row_bits

# the settings a kept prompt's state depends on (the prefill's numbers and what its layers keep); the others
# (row reuse, the decode step's selection rules, where weights live) change only the decode steps
STATE_FIELDS = (
    "policy",
    "budget",
    "allocation",
    "min_tokens",
    "dense_layers",
    "block_tokens",
    "prefill_block_tokens",
    "partial_key_bits",
)
HASHED_TOKENS = 16  # each link of the chain (vLLM's block): a lookup hashes 8,192 links at 128K, in 4 ms
_fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its fingerprint, read once


def model_fingerprint(model) -> str:
    """The model's q/k fingerprint (``architectures.fingerprint``), read once per model: a kept prompt's ``model``."""
    if model not in _fingerprints:
        _fingerprints[model] = fingerprint(model)
    return _fingerprints[model]


def prompt_key(cache) -> dict:
    """What a cache's kept prompts depend on: the model (its q/k fingerprint, dtype, layers), the artifact
    (its tensors' checksum), the settings of ``STATE_FIELDS`` and the row format as they run, and the prefill
    chunk of its memory plan (the rest of a served prompt is computed in chunks ending where a cold run's do)."""
    model = cache.model_ref()
    if model is None:
        raise InfinigenError("this cache's model is gone")
    artifact = cache.artifact.manifest.tensors_sha256 if cache.artifact is not None else None
    settings = {name: getattr(cache.config, name) for name in STATE_FIELDS}
    return {
        "model": model_fingerprint(model),
        "dtype": str(cache.weights_dtype).removeprefix("torch."),
        "layers": len(cache.layers),
        "artifact": artifact,
        "kv_bits": row_bits(cache.config),
        **settings,
        "prefill_chunk": cache.memory_plan.workload.prefill_chunk if cache.memory_plan is not None else None,
    }


def block_hashes(key: dict, tokens: torch.Tensor, block_tokens: int) -> list[bytes]:
    """The chain hash of each whole block of ``tokens`` (N,): entry j names tokens[: (j + 1) * block_tokens]."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode())
    ids = tokens.to(torch.int64).cpu().numpy()
    hashes = []
    for end in range(block_tokens, ids.size + 1, block_tokens):
        digest.update(ids[end - block_tokens : end].tobytes())
        hashes.append(digest.copy().digest())
    return hashes


def prompt_name(kept: KeptPrompt) -> str:
    """A name for ``kept`` that only the same state has (its key and tokens): a prompt file's in a directory."""
    digest = hashlib.sha256(json.dumps(kept.key, sort_keys=True).encode())
    digest.update(kept.tokens.to(torch.int64).numpy().tobytes())
    return digest.hexdigest()[:32]


def keeps_prompts(config) -> bool:
    """Whether runs with ``config`` (a ``RuntimeConfig``) keep prompts: a prompt cache above 0 GB, beside an unlimited
    CPU pool (a limited one rewrites its slots)."""
    return config.prompt_cache_gb != 0 and config.cpu_pool_gb is None


def _locked(method):
    """``method`` under its PromptCache's lock: a server's requests are admitted while a batch decodes."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    return locked


class PromptCache:
    """Kept prompts in host memory, at most ``gb`` GB (10^9 bytes; None: no limit) and ``most`` of them, least
    recently used evicted first. Blocks shared by several kept prompts (a conversation's turns) count once. Safe to
    share between threads. ``read_only``: a run served from it keeps no prompt of its own (one document's
    questions: each would copy the document's GPU-resident parts again, after its first token)."""

    def __init__(self, gb: float | None = None, read_only: bool = False, most: int | None = None) -> None:
        if gb is not None and not gb >= 0:
            raise InfinigenError(f"prompt_cache_gb must be >= 0, got {gb}")
        self.budget = None if gb is None else int(gb * 1e9)
        self.read_only = read_only
        self.most = most  # kept prompts at most (None: as many as the budget holds)
        self.entries: OrderedDict[int, KeptPrompt] = OrderedDict()  # by id, least recently used first
        self.index: dict[bytes, set[int]] = {}  # block hash -> the kept prompts holding that prefix
        self.hits = self.misses = self.evicted = 0
        self.newest: KeptPrompt | None = None  # the latest added (a prompt file's next contents)
        self.lock = threading.RLock()

    @classmethod
    def of(cls, config, most: int | None = None) -> PromptCache | None:
        """The kept prompts of ``config`` (a ``RuntimeConfig``): ``prompt_cache_gb`` GB of host memory, by default
        half of what the host has free now; none at 0 or beside a limited CPU pool (``cpu_pool_gb``, whose slots
        are rewritten); more than the host has free is refused in one line."""
        if not keeps_prompts(config):
            return None
        gb, available = config.prompt_cache_gb, memory.host_available_bytes()
        if gb is None:
            return cls(None if available is None else available / 2 / 1e9, most=most)
        if available is not None and gb * 1e9 > available:
            raise InfinigenError(
                f"prompt_cache_gb {gb:g} is more than the host memory available now ({memory.gb(available)} GB): "
                "give less, or 0 to keep no prompts"
            )
        return cls(gb, most=most)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    @_locked
    def nbytes(self) -> int:
        """Host bytes the kept prompts hold, each block once."""
        held: dict[int, int] = {}
        for kept in self.entries.values():
            held |= kept.held()
        return sum(held.values())

    @_locked
    def match(self, key: dict, tokens: torch.Tensor) -> tuple[KeptPrompt | None, int]:
        """The kept prompt serving most of ``tokens`` (N,) for a cache of ``key``, and how many tokens it
        serves (0: none); a hit becomes the most recently used."""
        best, served = None, 0
        if self.entries:
            hashes = block_hashes(key, tokens, HASHED_TOKENS)
            for j in range(len(hashes) - 1, -1, -1):
                for kept in (self.entries[i] for i in self.index.get(hashes[j], ())):
                    n = kept.usable(tokens)
                    if n > served:
                        best, served = kept, n
                if best is not None:
                    break
        if best is None:
            self.misses += 1
            return None, 0
        self.hits += 1
        self.entries.move_to_end(id(best))
        return best, served

    @_locked
    def add(self, kept: KeptPrompt) -> None:
        """Keep ``kept`` (the most recently used), then evict the least recently used beyond the budget
        (``kept`` too, where it alone is over it). A prompt shorter than ``HASHED_TOKENS`` is not kept."""
        hashes = block_hashes(kept.key, kept.tokens, HASHED_TOKENS)
        if not hashes:
            return
        self.newest = kept
        self.entries[id(kept)] = kept
        for digest in hashes:
            self.index.setdefault(digest, set()).add(id(kept))
        while self.entries and (
            (self.budget is not None and self.nbytes > self.budget) or (self.most is not None and len(self) > self.most)
        ):
            self.evict()

    @_locked
    def make_room(self, found) -> None:
        """Evict the least recently used until the host can hold the run of plan ``found`` beside the rest: a run's
        pool comes before kept prompts."""
        while self.entries and not memory.fits_host(found):
            self.evict()

    @_locked
    def evict(self) -> None:
        """Drop the least recently used kept prompt."""
        self.drop(next(iter(self.entries.values())))
        self.evicted += 1

    @_locked
    def drop(self, kept: KeptPrompt) -> None:
        """Forget ``kept``: its memory goes once no cache reads it (nor a kept prompt that borrows its blocks)."""
        self.entries.pop(id(kept), None)
        for digest in block_hashes(kept.key, kept.tokens, HASHED_TOKENS):
            holders = self.index.get(digest)
            if holders is not None:
                holders.discard(id(kept))
                if not holders:
                    del self.index[digest]

    @_locked
    def clear(self) -> None:
        for kept in list(self.entries.values()):
            self.drop(kept)
