"""Per-layer KV caches, plugged into transformers through its ``CacheLayerMixin`` interface.

- ``DenseLayer``: K/V on the compute device in preallocated buffers, appended in place.
- ``OffloadedLayer``: K/V in the CPU pool; on the compute device only what selection needs
  (validity of each slot, the partial key cache, fetch counters) and the fetched rows of the
  current step. A decode step attends over the fetched rows plus the current token.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin

from infinigen.architectures import ModelSpec, Norm
from infinigen.errors import InfinigenError
from infinigen.runtime.cache.graphs import SelectionGraph
from infinigen.runtime.cache.stats import LayerStats
from infinigen.runtime.config import RuntimeConfig
from infinigen.runtime.kernels.buffers import grown, grown_to
from infinigen.runtime.memory.pool import KVPool, stored_width
from infinigen.runtime.memory.reuse import ResidentRows
from infinigen.runtime.selection.policies import row_bits
from infinigen.runtime.selection.policies.base import Policy, RowCodec, Selection, rows_bound
from infinigen.runtime.selection.speculation import LayerSpeculator

if TYPE_CHECKING:
    from infinigen.runtime.cache import InfinigenCache


class _Layer(CacheLayerMixin):
    """What transformers asks of every layer: its length (tokens seen) and mask sizes."""

    is_sliding = False

    def __init__(self) -> None:
        super().__init__()
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1


class DenseLayer(_Layer):
    """KV in buffers with room to grow. A decode step writes its token at the cache's device-side
    ``slot`` and attends over the whole buffer through ``valid``: no shape or index in it depends on
    the length, so a captured decode step replays unchanged until the buffer grows."""

    def __init__(self, cache: InfinigenCache) -> None:
        super().__init__()
        # the cache this layer belongs to (its ``slot``), weakly: no cycle keeps a finished run's buffers alive
        self.cache = weakref.proxy(cache)
        self.valid: torch.Tensor | None = None  # (B, 1, capacity) bool: the slot holds a token (not padding)
        self.attention_valid: torch.Tensor | None = None  # (B, 1, capacity) for the current decode step

    def lazy_initialization(self, key_states, value_states) -> None:
        self.keys, self.values = key_states[:, :, :0].clone(), value_states[:, :, :0].clone()
        self.valid = torch.zeros(key_states.shape[0], 1, 0, dtype=torch.bool, device=key_states.device)
        self.is_initialized = True

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def reserve(self, tokens: int) -> None:
        """Room for ``tokens`` tokens: the run's length at once where the cache expects it (``expect``),
        else grown by an eighth (appends stay amortised O(1))."""
        if tokens <= self.cache.expected_tokens:
            wanted = self.cache.expected_tokens
            self.keys, self.values = grown_to(self.keys, wanted, 2), grown_to(self.values, wanted, 2)
        else:
            self.keys, self.values = grown(self.keys, tokens, 2), grown(self.values, tokens, 2)
        self.valid = grown_to(self.valid, self.capacity, 2, fill=False)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[2] > 1 or self.length == 0:
            return self._update_many(key_states, value_states)
        self.reserve(self.length + 1)
        slot = self.decode_slot()
        self.keys.index_copy_(2, slot, key_states)
        self.values.index_copy_(2, slot, value_states)
        self.valid.index_fill_(2, slot, True)
        self.length += 1
        self.attention_valid = self.valid
        return self.keys, self.values

    def decode_slot(self) -> torch.Tensor:
        """(1,) on the device: where a decode step's token goes (the cache's ``slot``, == length)."""
        return self.cache.slot

    def _update_many(self, key_states, value_states):
        start, end = self.length, self.length + key_states.shape[2]
        self.reserve(end)
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states
        self.valid[:, :, start:end] = True  # padding is cleared by the attention function
        self.length = end
        self.attention_valid = None
        return self.keys[:, :, :end], self.values[:, :, :end]

    def mark_padding(self, token_valid: torch.Tensor, padded: bool) -> None:
        """token_valid: (B, T) for the prompt tokens just stored (False at padding)."""
        self.valid[:, :, self.length - token_valid.shape[1] : self.length] &= token_valid[:, None, :]

    def grows(self) -> bool:
        """Whether the next decode step's token needs a bigger buffer."""
        return self.length + 1 > self.capacity

    def advance(self) -> None:
        self.length += 1


@dataclass
class Fetched:
    """The rows fetched for one decode step, plus a slot for the current token."""

    rows: torch.Tensor  # (B, kv_heads, 2, K + 1, d): a K plane and a V plane per head
    valid: torch.Tensor  # (B, kv_heads, K + 1) bool
    indices: torch.Tensor  # (B, kv_heads, K) the slots fetched
    ready: torch.cuda.Event | None  # recorded on the transfer stream when the moved rows are complete
    selection_end: torch.cuda.Event | None = None  # recorded where the selection ran, after it
    packed: torch.Tensor | None = None  # (B, kv_heads, 2, K, stored_dim) as moved, decoded by ``codec``
    codec: RowCodec | None = None
    # 8-bit rows kept on the GPU (row reuse): ``packed`` their codes, dequantised with these (``int8_rows``)
    scales: torch.Tensor | None = None  # (B, kv_heads, 2, K) float32
    factors: torch.Tensor | None = None  # (B, kv_heads, 2, d) float32


class OffloadedLayer(_Layer):
    def __init__(
        self,
        index: int,
        policy: Policy,
        config: RuntimeConfig,
        speculator: LayerSpeculator | None,
        attention: torch.nn.Module,
        cache: InfinigenCache,
    ) -> None:
        super().__init__()
        self.index, self.policy, self.config, self.speculator = index, policy, config, speculator
        self.attention = attention  # the layer's attention module (the oracle computes its true query)
        # the cache this layer belongs to (shared stream, staging buffers, pool limit), weakly: a cycle would keep
        # a finished run's GPU buffers until Python's next full collection, which GPU memory does not trigger
        self.cache = weakref.proxy(cache)
        # from the first update (``lazy_initialization``): the keys' device, dtype and head_dim, the pool, and
        # (B, kv_heads, capacity) bool: the slot holds a cached token (not padding, not unused)
        self.device: torch.device | None = None
        self.dtype: torch.dtype | None = None
        self.head_dim = 0
        self.pool: KVPool | None = None
        self.valid: torch.Tensor | None = None
        self.max_tokens: int | None = None  # pool limit in tokens per (batch row, KV head); None: unlimited
        # eviction bookkeeping, only for a limited pool, each (B, kv_heads, capacity): the step each slot
        # was written (fifo, counter), last fetched (lru), and int32 its fetches since written (counter)
        self.inserted: torch.Tensor | None = None
        self.last_fetch: torch.Tensor | None = None
        self.fetch_count: torch.Tensor | None = None
        self.current_slots: torch.Tensor | None = None  # (B, kv_heads): the current decode token's slots
        self.used = 0  # slots in use (< length once the pool is full and evicts)
        self.step = 0
        self.fetched: Fetched | None = None
        self.attention_valid: torch.Tensor | None = None  # (B, kv_heads, K + 1) for the current decode step
        self.attention_slots: torch.Tensor | None = None  # (B, kv_heads, K + 1) their slots
        self.attended_fetch: Fetched | None = None  # what the current decode step attends over
        self.selection_graph: SelectionGraph | None = None  # CUDA: the selection, captured
        self.last_selection: tuple[Selection, torch.Tensor] | None = None  # the latest step's, with its fetch mask
        self.padded = False  # some batch row has padding slots (marked invalid)
        self.captured_moved: torch.Tensor | None = None  # (B,) rows per head a captured step fetches
        # rows per head it selects and attends, where they differ from the moved ones (row reuse)
        self.captured_counts: tuple[torch.Tensor | int | None, torch.Tensor | int | None] = (None, None)
        self.resident: ResidentRows | None = None  # with row reuse: the rows kept on the GPU
        self.past = 0  # a multi-token step: the earlier tokens its attention reads from the pool
        # a prefill chunk's earlier tokens, copied during the previous layer: (past, blocks, their region)
        self.fetched_ahead: tuple[int, list, torch.Tensor] | None = None
        self.stats = LayerStats()

    # --- transformers' layer interface -------------------------------------------------------

    def lazy_initialization(self, key_states, value_states) -> None:
        # sized from the keys received: under tensor parallelism, this rank's KV heads only
        batch, kv_heads, _, self.head_dim = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        self.max_tokens = self.cache.pool_limit(batch, self.dtype)
        self.cache.measure_reuse_room()
        self.pool = KVPool(
            batch,
            kv_heads,
            stored_width(self.head_dim, self.dtype, self.policy.codec),
            self.dtype,
            self.device,
            block_tokens=self.config.block_tokens,
            kv_bits=row_bits(self.config),
            gather_rows=self.config.gather_rows,
            gather_programs=self.config.gather_programs,
            host=self.cache.host_blocks,
        )
        self.valid = torch.zeros(batch, kv_heads, 0, dtype=torch.bool, device=self.device)
        if self.max_tokens is not None:  # eviction bookkeeping, only for a limited pool
            self.inserted = torch.zeros(batch, kv_heads, 0, dtype=torch.int64, device=self.device)
            self.last_fetch = torch.zeros(batch, kv_heads, 0, dtype=torch.int64, device=self.device)
            self.fetch_count = torch.zeros(batch, kv_heads, 0, dtype=torch.int32, device=self.device)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[2] > 1 or self.length == 0:
            return self._update_many(key_states, value_states)
        return self._update_decode(key_states, value_states)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise InfinigenError("beam search is not supported with KV in CPU memory: use greedy or sampling")

    # --- prefill -----------------------------------------------------------------------------

    def _update_many(self, key_states, value_states):
        """Prefill (or any multi-token step): store everything; attention reads the earlier tokens from the
        pool a block at a time (``past``: how many; ``cache.past_blocks``) and returns only the new ones.
        A policy that observes attention weighs every key at once: its step fetches them all."""
        new = key_states.shape[2]
        if self.used < self.length:
            raise InfinigenError("multi-token steps after the CPU pool has evicted tokens are not supported")
        self.past = self.used if not self.policy.observes_attention else 0
        past = self._fetch_all() if self.length and not self.past else None
        if past is not None:
            self.cache.wait(past)
        if self.max_tokens is not None and self.used + new > self.max_tokens:
            raise InfinigenError(
                f"the CPU KV pool holds {self.max_tokens} tokens per sequence per layer, too few for "
                f"{self.used + new} prompt tokens: raise --cpu-pool-gb"
            )
        slots = range(self.used, self.used + new)
        self.pool.reserve(slots.stop)
        self._append_metadata(slots.start, slots.stop, key_states)
        self.cache.store(self, slots.start, self._encoded(key_states, value_states))
        self.stats.written_rows += new * key_states.shape[0] * key_states.shape[1]
        self.length += new
        self.used += new
        self.attention_valid = None
        if past is None:
            return key_states, value_states
        rows = past.rows[:, :, :, :-1]
        return torch.cat([rows[:, :, 0], key_states], dim=2), torch.cat([rows[:, :, 1], value_states], dim=2)

    def past_ahead(self, end: int) -> bool:
        """Whether this layer's next multi-token step will read slots 0 .. end-1 from its pool (a later
        prefill chunk's, this layer not yet reached), so they may be fetched ahead."""
        return self.pool is not None and not self.policy.observes_attention and self.used == self.length == end

    @property
    def capacity(self) -> int:
        """Slots the CPU pool has room for. Every per-slot buffer (validity, the policy's state) is
        sized by it, so those buffers are reallocated only when it changes."""
        return self.pool.capacity

    def rows_room(self) -> int:
        """The most rows per head one fetch of this layer moves in this run: its budget's bound (every
        slot for an unbudgeted policy) at the capacity the pool has once the run's expected tokens
        (``InfinigenCache.expect``) are cached, in whole blocks: the memory plan's ``decode: fetch staging``."""
        block = self.config.block_tokens
        capacity = max(self.capacity, -(-self.cache.expected_tokens // block) * block)
        if self.max_tokens is not None:  # a limited pool evicts instead of growing past its limit
            capacity = max(self.capacity, min(capacity, self.max_tokens))
        if not self.policy.budgeted:
            return capacity
        return rows_bound(self.config.budget, capacity, self.config.min_tokens)

    def _append_metadata(self, start: int, end: int, key_states) -> None:
        """Mark slots start .. end-1 as cached by a multi-token step (the pool has room for them)."""
        capacity = self.capacity
        self.valid = grown_to(self.valid, capacity, 2, fill=False)
        self.valid[:, :, start:end] = True  # padding is cleared by the attention function
        if self.max_tokens is not None:
            self.inserted = grown_to(self.inserted, capacity, 2)
            self.inserted[:, :, start:end] = self.step
            self.last_fetch = grown_to(self.last_fetch, capacity, 2)
            self.last_fetch[:, :, start:end] = self.step
            self.fetch_count = grown_to(self.fetch_count, capacity, 2)
            self.fetch_count[:, :, start:end] = 0
        self.policy.stored(self, slice(start, end), key_states)

    def _encoded(self, key_states, value_states) -> torch.Tensor:
        """Pool rows (B, kv_heads, T, 2, stored_dim) for new keys and values (B, kv_heads, T, d)."""
        rows = torch.stack([key_states, value_states], dim=3)
        return rows if self.policy.codec is None else self.policy.codec.encode(rows)

    def mark_padding(self, token_valid: torch.Tensor, padded: bool) -> None:
        """token_valid: (B, T) for the prompt tokens just stored (False at padding); ``padded``: whether
        the forward's mask hides any key, these tokens' or earlier ones'."""
        start = self.used - token_valid.shape[1]
        self.valid[:, :, start : self.used] &= token_valid[:, None, :]
        self.padded = self.padded or padded

    def appends(self) -> bool:
        """Whether the next token goes to a new slot (else the full pool overwrites one)."""
        return self.max_tokens is None or self.used < self.max_tokens

    def grows(self) -> bool:
        """Whether the next decode step's token needs a new pool block."""
        return self.appends() and self.used + 1 > self.capacity

    def advance(self) -> None:
        """The host-side counters of one decode step (a replayed step runs only this on the host)."""
        if self.appends():
            self.used += 1
        self.step += 1
        self.length += 1
        self.stats.written_rows += self.valid.shape[0] * self.valid.shape[1]

    @property
    def spec(self) -> ModelSpec:
        return self.cache.spec

    def all_slots(self, n: int) -> torch.Tensor:
        """arange(n) on the device, shared by the cache's layers."""
        return self.cache.all_slots(n)

    def device_used(self) -> torch.Tensor:
        """``used`` as a (1,) tensor on the device: the cache's ``slot`` while the pool appends (a
        captured step reads its current value), else a constant (a full pool runs eagerly)."""
        return self.cache.slot if self.appends() else torch.full((1,), self.used, device=self.device)

    def resident_rows(self, positions: int) -> ResidentRows:
        """The rows kept on the GPU between steps (row reuse), with room for ``positions``."""
        if self.resident is None:
            batch, kv_heads = self.valid.shape[:2]
            int8 = self.pool.kv_bits == 8 and self.cache.resident_bits == 8  # kept as moved: codes and scales
            self.resident = ResidentRows(batch, kv_heads, self.head_dim, self.dtype, self.device, int8)
        held = self.resident.rows
        self.resident.grow(positions, self.capacity)
        if self.resident.rows is not held:  # new buffers, which the transfer stream writes
            self.cache.on_both_streams(self.resident.rows)
            if self.resident.scales is not None:
                self.cache.on_both_streams(self.resident.scales)
        return self.resident

    def every_slot(self) -> Selection:
        """A bulk fetch of every cached slot: indices over the whole capacity, the count of slots in
        use on the device, so a CUDA graph replays it."""
        batch, kv_heads = self.valid.shape[:2]
        indices = self.cache.all_slots(self.capacity).expand(batch, kv_heads, self.capacity)
        return Selection(indices=indices, count=self.device_used().to(torch.int32).expand(batch))

    def cached_tokens(self) -> torch.Tensor | int:
        """Tokens cached per batch row: (B,) on the device when padding makes rows differ, else an int."""
        return self.valid[:, :, : self.used].sum(dim=-1).amax(dim=1) if self.padded else self.used

    # --- decode ------------------------------------------------------------------------------

    def prefetch(self, hidden: torch.Tensor, norm: Norm, rope) -> None:
        """Select and start fetching the rows of the next decode step. hidden (B, hidden): the residual
        stream the selection reads (one layer ahead, or this layer's own), before ``norm``."""
        self.fetched = self.cache.aside(lambda: self._prefetched(hidden, norm, rope), (hidden, *(rope or ())))

    def _prefetched(self, hidden: torch.Tensor, norm: Norm, rope) -> Fetched:
        if self.cache.diagnostics.select_rows or self.last_selection is None:
            if self.cache.captures(self):  # not within a StepGraph's step, which captures the selection with it
                self.selection_graph = self.selection_graph or SelectionGraph()
                self.last_selection = self.selection_graph(self, hidden, norm, rope)
            else:
                self.last_selection = self.select(hidden, norm, rope)
        return self.cache.fetch(self, *self.last_selection)

    def select(self, hidden: torch.Tensor, norm: Norm, rope) -> tuple[Selection, torch.Tensor]:
        """The policy's selection and the validity of the rows it fetches (B, kv_heads, K + 1)."""
        selection = self.policy.select(self, norm(hidden), rope)
        return selection, self.cache.fetch_mask(self, selection)

    def _fetch_all(self) -> Fetched:
        return self.cache.fetch(self, Selection(), step=False)

    def _update_decode(self, key_states, value_states):
        fetched = self.fetched if self.fetched is not None else self.cache.fetch(self, self.every_slot())
        self.fetched, self.fetched_ahead = None, None  # a prefill's blocks no attention took: not held on
        self.attended_fetch = fetched
        # The token's own work runs while the rows still move: its row beside them (the last position,
        # which no move writes) and its store, once the selection has read what the store changes. A
        # full pool stores after the rows arrive instead: its token overwrites a slot a move may read.
        overlapped = self.appends()
        self.cache.wait(fetched, selection_only=overlapped)
        rows, valid = fetched.rows, fetched.valid
        rows[:, :, 0, -1] = key_states[:, :, 0]
        rows[:, :, 1, -1] = value_states[:, :, 0]
        valid[:, :, -1] = True
        self._store_token(key_states, value_states)
        if overlapped:
            self.cache.wait(fetched)
        self.attention_valid = valid
        if self.policy.observes_attention:
            self.attention_slots = torch.cat([fetched.indices, self.current_slots[..., None]], dim=-1)
        return rows[:, :, 0], rows[:, :, 1]

    def _store_token(self, key_states, value_states) -> None:
        new_rows = self._encoded(key_states, value_states)  # (B, kv_heads, 1, 2, stored_dim)
        if self.appends():
            self.pool.reserve(self.used + 1)
            slots = self.cache.slot.expand(key_states.shape[:2])  # (B, kv_heads): slot ``used``
        else:
            slots = self._victims()  # (B, kv_heads)
            self.stats.evicted_tokens += slots.shape[0]  # one token per batch row
        self.advance()
        self.pool.write_slots(slots, new_rows)  # on CUDA: the GPU writes the pinned rows itself
        self._write_metadata(slots, key_states)
        self.current_slots = slots

    def _victims(self) -> torch.Tensor:
        """Per (batch row, KV head), the slot a full pool overwrites."""
        used = self.used
        if self.config.eviction == "fifo":
            return self.inserted[:, :, :used].argmin(dim=-1)
        if self.config.eviction == "lru":
            return self.last_fetch[:, :, :used].argmin(dim=-1)
        older = self.inserted[:, :, :used].argsort(dim=-1)[:, :, : max(1, used // 2)]  # the older half
        least_fetched = self.fetch_count[:, :, :used].gather(-1, older).argmin(dim=-1, keepdim=True)
        return older.gather(-1, least_fetched)[..., 0]

    def _write_metadata(self, slots: torch.Tensor, key_states) -> None:
        """Mark the decode token's slots (B, kv_heads), new or overwritten, as cached."""
        at = slots[..., None]
        self.valid = grown_to(self.valid, self.capacity, 2, fill=False)
        self.valid.scatter_(-1, at, True)
        if self.max_tokens is not None:
            for name, value in (("inserted", self.step), ("last_fetch", self.step), ("fetch_count", 0)):
                buffer = grown_to(getattr(self, name), self.capacity, 2)
                setattr(self, name, buffer.scatter_(-1, at, value))
        self.policy.stored(self, slots, key_states)

    def record_fetch(self, indices: torch.Tensor, fetched_valid: torch.Tensor) -> None:
        """Count fetches per slot (counter eviction) and note the step (LRU)."""
        self.fetch_count.scatter_add_(-1, indices, fetched_valid.to(torch.int32))
        recent = torch.where(fetched_valid, self.step, self.last_fetch.gather(-1, indices))
        self.last_fetch.scatter_(-1, indices, recent)
