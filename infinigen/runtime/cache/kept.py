"""Kept prompts: a prompt's KV and selection state, taken from a cache after its prefill and given to later
caches whose prompts start with it, which then prefill only the rest.

What a cache holds after a prefill of N tokens is a function of those tokens alone: the offloaded layers'
pool rows as stored (8-bit codes or 16-bit), their 8-bit scales and channel factors, the dense layers' KV,
sliding-window rings, the slots' validity and each policy's per-slot state (partial keys, page bounds).
``keep`` takes all of it: the pools' full blocks by reference (they are never written again: a decode step
appends, and a limited pool, which overwrites, keeps nothing), the last partial block and the GPU-resident
parts as host copies. ``restore`` gives a new cache the first ``length`` tokens of it: the full blocks lent,
a partial one copied (the new cache appends to it), the GPU parts copied back.

A kept prompt serves the longest common prefix (``usable``), cut where it ends, since every slot's state depends
only on its token and the earlier ones; the rest is computed in chunks ending where a cold run's do. Where the cut
falls on a chunk boundary of the kept prompt's own prefill (and always for the prompt it extends whole), the
result is a cold run's bit for bit. Inside one of its chunks, the served rows were computed in a longer forward
than a cold run would split there, so the rest matches a cold run cut at the same token to rounding (the
tokens are the cold run's wherever rounding does not decide them; tests/test_prompt_cache.py). Not cut: where a
policy accumulates what later queries attend to (h2o's scores) or a sliding window has moved past the cut:
such a kept prompt serves only prompts that extend it whole (a conversation's next turn). A paged policy's
(Quest's) cut falls on whole pool blocks: a page bound past the cut would hold later tokens' keys. 8-bit rows'
channel factors come from a row's first chunk: a cut inside it would leave the later tokens in them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from infinigen.architectures import sliding_windows
from infinigen.errors import InfinigenError
from infinigen.runtime.cache.layers import DenseLayer, OffloadedLayer
from infinigen.runtime.cache.sliding import SlidingLayer
from infinigen.runtime.memory.host_memory import HostBlocks, retire
from infinigen.runtime.selection.policies import policy_class


@dataclass
class LayerState:
    """One layer's part of a kept prompt. ``tensors``: host copies, each slot's state along dim 2 (or a
    fixed number of slots per entry, as Quest's pages): ``keys``, ``values``, ``valid``, ``scales``,
    ``factors``, ``policy.<name>``. ``blocks``: an offloaded layer's pool blocks (B, kv_heads, block, 2, w)."""

    kind: str  # "dense" | "sliding" | "offloaded"
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    blocks: list[torch.Tensor] = field(default_factory=list)


@dataclass(eq=False)
class KeptPrompt:
    """A prompt's cache state in host memory. ``key``: what a cache must run with to use it
    (``prompts.prompt_key``); ``tokens`` (N,) int64; ``cuttable``: whether it also serves a shorter prefix."""

    key: dict
    device: torch.device  # the compute device it serves (its pinned blocks are retired to it)
    tokens: torch.Tensor
    block_tokens: int
    cuttable: bool
    layers: list[LayerState]
    # kept prompts whose blocks this one reads (a conversation's earlier turn): held alive with it
    lenders: list[KeptPrompt] = field(default_factory=list)

    def __post_init__(self) -> None:
        owned = [t for layer in self.layers for t in (*layer.blocks, *layer.tensors.values())]
        borrowed = {id(b) for lender in self.lenders for layer in lender.layers for b in layer.blocks}
        # reused or freed as a dropped pool's blocks are, once no pool reads them (each holds its lenders)
        weakref.finalize(self, retire, [t for t in owned if id(t) not in borrowed and t.numel()], self.device)

    @property
    def length(self) -> int:
        return self.tokens.numel()

    def held(self) -> dict[int, int]:
        """The host bytes this prompt holds alive, by address (blocks shared with other kept prompts once)."""
        return {t.data_ptr(): t.nbytes for layer in self.layers for t in (*layer.blocks, *layer.tensors.values())}

    @property
    def nbytes(self) -> int:
        return sum(self.held().values())

    def usable(self, tokens: torch.Tensor) -> int:
        """How many of ``tokens`` (N,) this prompt serves: their common prefix, at most N - 2 (the rest is a
        prefill forward: one of a single token is a decode step, which attends the policy's selection); the
        whole prompt where they extend it, else only where it is ``cuttable``, on whole pool blocks for a paged
        policy, and past its first chunk with 8-bit rows (the module's docstring says why)."""
        n = min(self.length, tokens.numel() - 2)
        if n <= 0:
            return 0
        tokens = tokens.cpu()
        differs = (self.tokens[:n] != tokens[:n]).nonzero()
        common = int(differs[0]) if differs.numel() else n
        if common == self.length:
            return common
        first_chunk = self.key.get("prefill_chunk") or self.length
        if not self.cuttable or (self.key.get("kv_bits") == 8 and common < first_chunk):
            return 0
        unit = self.block_tokens if policy_class(self.key["policy"]).paged else 1
        return common // unit * unit


def keep(cache, tokens: torch.Tensor) -> KeptPrompt:
    """The state ``cache`` holds after its prefill of ``tokens`` (N,), one unpadded row (before any decode
    step): the full pool blocks from now on the kept prompt's (lent to the cache), the rest host copies."""
    if any(isinstance(layer, OffloadedLayer) and layer.max_tokens is not None for layer in cache.layers):
        raise InfinigenError("a prompt cannot be kept with a limited CPU pool (--cpu-pool-gb): its slots are rewritten")
    n = tokens.numel()
    if any(layer.get_seq_length() != n for layer in cache.layers):
        raise InfinigenError(f"keep: the cache holds {cache.get_seq_length()} tokens, not the prompt's {n}")
    if cache.device.type == "cuda":
        torch.cuda.synchronize(cache.device)  # the prompt's rows stored, before the host copies its last blocks
    sources: list[torch.Tensor] = []
    _layer_states(cache, n, lambda tensor: sources.append(tensor) or tensor)  # what is copied, to plan its blocks
    copy = _HostCopies(cache.device, sources)
    states = _layer_states(cache, n, copy)
    copy.done()
    lenders = []
    for layer in cache.offloaded:
        lenders.extend(lender for lender in layer.pool.lenders if lender not in lenders)
    cuttable = not any(s.kind == "sliding" for s in states) and not cache.policy_type.observes_attention
    tokens = tokens.cpu().clone()
    kept = KeptPrompt(cache.prompt_key, cache.device, tokens, cache.config.block_tokens, cuttable, states, lenders)
    for layer in cache.offloaded:
        layer.pool.lend(n // layer.pool.block_tokens, kept)
    return kept


def _layer_states(cache, n: int, copy) -> list[LayerState]:
    states = []
    for layer in cache.layers:
        if isinstance(layer, OffloadedLayer):
            states.append(_offloaded_state(layer, n, copy))
        else:
            kind = "sliding" if isinstance(layer, SlidingLayer) else "dense"
            end = layer.capacity if kind == "sliding" else n
            tensors = {name: copy(getattr(layer, name)[:, :, :end]) for name in ("keys", "values", "valid")}
            states.append(LayerState(kind, tensors))
    return states


def _offloaded_state(layer: OffloadedLayer, n: int, copy) -> LayerState:
    pool = layer.pool
    full = n // pool.block_tokens
    blocks = pool.blocks[:full]
    if n % pool.block_tokens:  # the cache goes on appending to its last block: a copy of it
        blocks.append(copy(pool.blocks[full]))
    tensors = {"valid": copy(layer.valid)}
    if pool.kv_bits == 8:
        tensors |= {"scales": copy(pool.scales), "factors": copy(pool.factors)}
    for name, value in vars(layer.policy).items():
        if isinstance(value, torch.Tensor):
            tensors[f"policy.{name}"] = copy(value)
        elif value is not None and name != "config":
            raise InfinigenError(f"policy {layer.policy.name!r} keeps state a prompt cannot keep: {name}")
    return LayerState("offloaded", tensors, blocks)


class _HostCopies:
    """Host copies of ``sources`` (in that order): on CUDA into pinned blocks of their exact sizes, made on the
    workers (``host_memory.HostBlocks``) and copied back at the link's speed, queued until ``done``."""

    def __init__(self, device: torch.device, sources: list[torch.Tensor]) -> None:
        self.device = device
        self.blocks = HostBlocks(device)
        self.blocks.plan([tensor.nbytes for tensor in sources if tensor.numel()])

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.numel():
            return torch.empty(tensor.shape, dtype=tensor.dtype)
        host = self.blocks.take(tensor.nbytes).view(tensor.dtype).view(tensor.shape)
        return host.copy_(tensor, non_blocking=True)

    def done(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


def restore(cache, kept: KeptPrompt, length: int) -> None:
    """Give the empty ``cache`` (configured, with ``kept.key``) the first ``length`` tokens of ``kept``."""
    if cache.prompt_key != kept.key:
        raise InfinigenError("this kept prompt was made with other settings or another model")
    if any(layer.is_initialized for layer in cache.layers):
        raise InfinigenError("a kept prompt goes into an empty cache")
    for layer, state in zip(cache.layers, kept.layers, strict=True):
        if isinstance(layer, OffloadedLayer):
            _restore_offloaded(cache, layer, state, kept, length)
        else:
            _restore_dense(layer, state, length, kept.length)
    cache.reused_tokens = length


def restorable_rows(policy: str, model_config) -> bool:
    """Whether kept prompts can be placed as the rows of a batch (``restore_rows``) for ``policy`` and a model of
    ``model_config``: not where a slot's state depends on where the row starts (a paged policy's page bounds, a
    sliding window's ring)."""
    return not policy_class(policy).paged and all(window is None for window in sliding_windows(model_config))


def restore_rows(cache, rows: list[KeptPrompt]) -> None:
    """Give the empty ``cache`` (configured, with their key) ``rows`` whole as its batch rows, right-aligned at the
    longest: row b's first ``length - rows[b].length`` slots padding, as a left-padded batch's prompt, each row's
    slots its own kept state (so a batch of rows each prefilled alone decodes from their alone states)."""
    if any(kept.key != cache.prompt_key for kept in rows):
        raise InfinigenError("this kept prompt was made with other settings or another model")
    if any(layer.is_initialized for layer in cache.layers):
        raise InfinigenError("kept prompts go into an empty cache")
    length = max(kept.length for kept in rows)
    offsets = [length - kept.length for kept in rows]
    for index, layer in enumerate(cache.layers):
        states = [kept.layers[index] for kept in rows]
        if isinstance(layer, SlidingLayer):
            raise InfinigenError("a sliding window's ring cannot start where another row's does")
        if isinstance(layer, OffloadedLayer):
            _restore_offloaded_rows(cache, layer, states, offsets, length)
        else:
            _restore_dense_rows(layer, states, offsets, length)


def _placed(into: torch.Tensor, tensors: list[torch.Tensor], offsets: list[int], length: int) -> torch.Tensor:
    """``into`` (B, H, slots, *rest), zero (or False), with each row's per-slot state (1, H, >= its length, *rest)
    at slots offsets[b] .. length - 1 of row b."""
    for row, (tensor, offset) in enumerate(zip(tensors, offsets, strict=True)):
        into[row, :, offset:length].copy_(tensor[0, :, : length - offset], non_blocking=True)
    return into


def _zeros(tensors: list[torch.Tensor], slots: int, device) -> torch.Tensor:
    """(B, H, ``slots``, *rest) zeros for the rows' state ``tensors`` (1, H, n, *rest)."""
    first = tensors[0]
    return torch.zeros(len(tensors), first.shape[1], slots, *first.shape[3:], dtype=first.dtype, device=device)


def _restore_dense_rows(layer: DenseLayer, states: list[LayerState], offsets: list[int], length: int) -> None:
    keys = states[0].tensors["keys"]
    empty = torch.empty(len(states), keys.shape[1], 0, keys.shape[3], dtype=keys.dtype, device=layer.cache.device)
    layer.lazy_initialization(empty, empty)
    layer.reserve(length)  # zeroed buffers (no token yet), filled in place
    for name in ("keys", "values", "valid"):
        _placed(getattr(layer, name), [state.tensors[name] for state in states], offsets, length)
    layer.length = length


def _restore_offloaded_rows(
    cache, layer: OffloadedLayer, states: list[LayerState], offsets: list[int], length: int
) -> None:
    kv_heads, dtype = states[0].blocks[0].shape[1], cache.weights_dtype  # blocks (1, kv_heads, block, 2, w)
    empty = torch.empty(len(states), kv_heads, 0, cache.spec.head_dim, dtype=dtype, device=cache.device)
    layer.lazy_initialization(empty, empty)  # (a limited pool keeps no prompt: ``keep`` refused it)
    pool = layer.pool
    pool.reserve(length)
    for row, (state, offset) in enumerate(zip(states, offsets, strict=True)):
        pool.clear_row(row, offset)
        for start, block in zip(range(0, length - offset, pool.block_tokens), state.blocks, strict=False):
            pool.write_row(row, offset + start, block[0, :, : length - offset - start])
    capacity, device = pool.capacity, layer.device
    if pool.kv_bits == 8:  # the pool's scales, grown with its blocks (zero), filled in place
        _placed(pool.scales, [s.tensors["scales"] for s in states], offsets, length)
        pool.factors.copy_(torch.cat([s.tensors["factors"] for s in states]))
        pool.smoothed = True
        pool.rows_smoothed.fill_(True)
    for name in (n for n in states[0].tensors if n == "valid" or n.startswith("policy.")):
        tensors = [s.tensors[name] for s in states]
        value = _placed(_zeros(tensors, capacity, device), tensors, offsets, length)
        setattr(layer if name == "valid" else layer.policy, name.removeprefix("policy."), value)
    layer.length = layer.used = length
    layer.padded = any(offsets)


def _empty_keys(cache, state: LayerState, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, kv_heads, 0, head_dim) on the cache's device: what a layer's ``lazy_initialization`` sizes itself from."""
    batch = (state.blocks or [state.tensors.get("keys")])[0].shape[0]
    return torch.empty(batch, kv_heads, 0, cache.spec.head_dim, dtype=dtype, device=cache.device)


def _restore_dense(layer: DenseLayer, state: LayerState, length: int, kept_length: int) -> None:
    if isinstance(layer, SlidingLayer) and length != kept_length:
        raise InfinigenError("a sliding window's ring is kept whole: this prompt cannot be cut")
    keys = state.tensors["keys"]
    empty = _empty_keys(layer.cache, state, keys.shape[1], keys.dtype)
    layer.lazy_initialization(empty, empty)
    layer.reserve(length)
    end = min(layer.capacity, keys.shape[2], length)
    for name in ("keys", "values", "valid"):
        getattr(layer, name)[:, :, :end].copy_(state.tensors[name][:, :, :end], non_blocking=True)
    layer.length = length


def _restore_offloaded(cache, layer: OffloadedLayer, state: LayerState, kept: KeptPrompt, length: int) -> None:
    empty = _empty_keys(cache, state, state.blocks[0].shape[1], cache.weights_dtype)
    layer.lazy_initialization(empty, empty)  # its pool, empty, as the first prefill would make it
    if layer.max_tokens is not None:
        raise InfinigenError("a kept prompt cannot serve a limited CPU pool (--cpu-pool-gb)")
    pool, block_tokens = layer.pool, layer.pool.block_tokens
    full, capacity = length // block_tokens, -(-length // block_tokens) * block_tokens
    kept_capacity = len(state.blocks) * block_tokens
    own = []
    if length % block_tokens:  # a copy this cache may append to
        block = pool.host.take(pool.block_nbytes).view(pool.dtype).view(pool.shape)
        own.append(block.copy_(state.blocks[full]))  # host to host: at once
    scales = _cut(state.tensors.get("scales"), kept_capacity, capacity, layer.device)
    factors = state.tensors.get("factors")
    pool.adopt(state.blocks[:full], kept, own, scales, None if factors is None else factors.to(layer.device))
    layer.valid = _cut(state.tensors["valid"], kept_capacity, capacity, layer.device)
    layer.valid[:, :, length:] = False  # the kept prompt's later tokens in a cut block: unused slots
    for name, value in state.tensors.items():
        if name.startswith("policy."):
            setattr(layer.policy, name.removeprefix("policy."), _cut(value, kept_capacity, capacity, layer.device))
    layer.length = layer.used = length


def _cut(tensor: torch.Tensor | None, kept: int, capacity: int, device) -> torch.Tensor | None:
    """A per-slot tensor kept at ``kept`` slots (dim 2: one entry per slot, or per page as Quest's) for a
    cache of ``capacity`` slots (fewer where the prompt is cut), on ``device``."""
    if tensor is None:
        return None
    entries = tensor.shape[2]
    return tensor[:, :, : entries * capacity // kept].to(device, copy=True, non_blocking=True)
