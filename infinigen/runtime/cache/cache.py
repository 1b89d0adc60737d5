"""``InfinigenCache``: a transformers ``Cache`` whose offloaded layers keep KV in CPU memory: its layers, the
transfers of their rows, the decode steps' bookkeeping, the summary of a run; cut back by ``rollback``. It
connects itself to its model when made (``cache.hooks``: forward hooks, and the attention of ``cache.attention``
for the forwards given the cache) and disconnects when closed (``close``, the end of a ``with`` block) or
collected: the model is left as it was."""

from __future__ import annotations

import gc
import math
import weakref
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from infinigen.architectures import decoder_layers, model_spec, sliding_windows
from infinigen.artifacts import Artifact
from infinigen.errors import InfinigenError
from infinigen.runtime.cache.diagnostics import Diagnostics
from infinigen.runtime.cache.hooks import attach
from infinigen.runtime.cache.layers import DenseLayer, Fetched, OffloadedLayer
from infinigen.runtime.cache.prompts import PromptCache, prompt_key
from infinigen.runtime.cache.rollback import Croppable
from infinigen.runtime.cache.row_reuse import RowReuse
from infinigen.runtime.cache.sliding import SlidingLayer
from infinigen.runtime.cache.stats import cache_summary
from infinigen.runtime.config import RuntimeConfig
from infinigen.runtime.kernels import int8_rows
from infinigen.runtime.memory import allocator, plan, reuse
from infinigen.runtime.memory.host_memory import HostBlocks
from infinigen.runtime.memory.pool import row_bytes
from infinigen.runtime.memory.sizing import blocks_ahead, offloaded_layer_indices, pool_limit
from infinigen.runtime.selection.allocation import offloaded_budgets
from infinigen.runtime.selection.policies import Selection, make_policy, row_bits, supported_policy
from infinigen.runtime.selection.speculation import LayerSpeculator
from infinigen.runtime.streams import side_stream
from infinigen.runtime.weights import StreamedWeights, streamed_weights, weights_for_run
from infinigen.tensor_parallel import head_shard


def _emptied_then_closed(layers: list, streamed: StreamedWeights) -> None:
    """A cache's layers let go (with them its KV on the device), then its streamed weights put back."""
    layers.clear()
    gc.collect()  # a layer's own reference cycles
    streamed.close()


class InfinigenCache(RowReuse, Croppable, Cache):
    def __init__(
        self,
        model: PreTrainedModel,
        config: RuntimeConfig,
        artifact: Artifact | None = None,
        memory_plan: plan.MemoryPlan | None = None,
        prompts: PromptCache | None = None,
    ) -> None:
        self.spec = model_spec(model.config)
        self.artifact = artifact
        self.model_ref = weakref.ref(model)  # to make the layers again where the plan changes their settings
        self.asked = config  # the settings as given; ``config``: as they run (the plan's choices applied)
        # the plan the cache runs under: the caller's, else its own from its first forward (``planning``)
        self.memory_plan = memory_plan
        self.prefill_chunks: tuple[int | None, int | None] | None = None  # infinigen.decode's: (asked, taken)
        # kept prompts this cache's run may start from and adds its own to (``infinigen.decode``: ``cache.prompts``)
        self.prompts = prompts
        self.reused_tokens, self.reused_rows = 0, None  # prompt tokens kept prompts gave it; each row's (rows_alone)
        self.verified = None  # exact decoding's counts (``exact.Verified``)
        # the heads this rank computes (all in one process); refuses KV heads the ranks do not divide
        self.shard = head_shard(decoder_layers(model)[0].self_attn, self.spec.head_dim)
        super().__init__(layers=[])
        param = next(model.parameters())
        self.device, self.weights_dtype = param.device, param.dtype
        allocator.expandable(self.device)  # the allocator the plan assumes, before this cache allocates
        # the running forward's rotary (cos, sin) by layer type (None: one for every layer; hooks.py)
        self.ropes: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
        self.rope_types = tuple(getattr(model.config, "layer_types", None) or (None,) * self.spec.n_layers)
        self.decoding = False  # whether the running forward is a decode step (one token per row)
        self.forward_valid: torch.Tensor | None = None  # (B, T) bool: a prefill forward's tokens, not padding
        cuda = self.device.type == "cuda"
        self.stream = side_stream(self.device, "transfer") if cuda else None  # row moves
        self.selection_stream = side_stream(self.device, "selection") if cuda else None
        self.selected_aside = False  # the running forward queued work on it (``join_selections``)
        self.buffers: dict[tuple[str, int], torch.Tensor] = {}
        self.host_blocks = HostBlocks(self.device)  # the pools' blocks, made ahead of each prefill
        self.wait_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # eager steps' waits
        # the captured step's waits: its events are graph nodes, so every replay times them again
        self.step_wait_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.slot_range = torch.arange(0, device=self.device)
        self.slot = torch.zeros(1, dtype=torch.int64, device=self.device)  # where a decode step's token goes
        self.driven = False  # a StepGraph runs the decode steps (and begins each one itself)
        self.capturing = False  # a decode step is being captured: no host work that a replay would skip
        self.replayed_steps = 0  # decode steps run as graph replays (the last one's waits are timed)
        self.diagnostics = Diagnostics()
        self.gpu_budget: int | None = None  # the budget auto reuse plans within, from the first prefill
        self.expected_tokens = 0  # what the run will cache per row, where its decode loop says (``expect``)
        # what the plan reads of the model: its config and its weights (every tensor-parallel rank's)
        self.planned = plan.loaded_model(model, self.shard.ranks)
        self.reuse_capacity = 0  # the pool capacity of the latest auto decision
        self.streamed: weakref.finalize | None = None
        self.configure(model, config)
        self.closing_summary: dict | None = None  # the summary as it stood at ``close``
        # last: a cache that failed to initialise leaves nothing on the model
        self._detach = weakref.finalize(self, attach(model, self))

    def configure(self, model: PreTrainedModel, config: RuntimeConfig) -> None:
        """What the settings decide, before any KV is stored (made again where the plan changes them):
        the layers and their shares of the budget, row reuse as it starts, the weights streamed."""
        if any(layer.is_initialized for layer in self.layers):
            raise InfinigenError("a cache's settings cannot change once it holds KV")
        self.config = config
        # its flags; each offloaded layer holds an instance
        self.policy_type = supported_policy(config, has_artifact=self.artifact is not None)
        windows = sliding_windows(model.config)
        self.offloaded_indices = offloaded_layer_indices(windows, config.dense_layers, self.policy_type.offloads)
        self.n_offloaded = len(self.offloaded_indices)
        # each offloaded layer's share of the budget (``allocation``), from the whole artifact on every rank
        artifact = self.artifact if self.policy_type.budgeted else None
        self.layer_budgets, self.allocation = offloaded_budgets(
            config.budget, config.allocation, artifact, self.offloaded_indices
        )
        self.layers[:] = self._made_layers(model, decoder_layers(model), self.artifact)
        # row reuse (budgeted policies only): as asked, or auto (``reuse_auto``: a decision still to make, or to check
        # again as the pools grow); the rows of earlier steps it keeps and the bits it keeps rows in, as they apply
        self.reuse, self.reuse_auto, self.resident_extra, self.resident_bits = reuse.initial(config, self.policy_type)
        self.reuse_from_plan()
        if self.streamed is None:
            streamed = weights_for_run(model, config, self.device, self.shard.ranks)
            # the weights go back once the KV is gone: at a budget that streams them both do not fit at once
            if streamed is not None:
                self.streamed = weakref.finalize(self, _emptied_then_closed, self.layers, streamed)
        self.graphs = config.cuda_graphs and streamed_weights(model) is None  # a graph would keep one slot a layer

    def _made_layers(self, model: PreTrainedModel, blocks, artifact: Artifact | None) -> list:
        """One layer per decoder block: sliding-window, dense (KV on the device), or offloaded with its
        budget's share, its own policy instance (it keeps the layer's selection state) and speculator."""
        budgets = dict(zip(self.offloaded_indices, self.layer_budgets, strict=True))
        layers: list = []
        for i, window in enumerate(sliding_windows(model.config)):
            if window is not None:
                layers.append(SlidingLayer(window, cache=self))
            elif i not in budgets:
                layers.append(DenseLayer(cache=self))
            else:
                speculator = None
                if self.policy_type.speculates:
                    param = next(model.parameters())
                    speculator = LayerSpeculator(self.spec, artifact, i, blocks[i].self_attn, param.device, param.dtype)
                layer_config = replace(self.config, budget=budgets[i])
                policy = make_policy(layer_config)
                layers.append(OffloadedLayer(i, policy, layer_config, speculator, blocks[i].self_attn, cache=self))
        return layers

    def close(self) -> None:
        """Disconnect from the model (also done when the cache is collected): its hooks go with the
        model's last cache, no forward can use this one any more, and its layers (their KV) are let go.
        The summary stays readable."""
        if self.closed:
            return
        self._detach()
        try:
            self.closing_summary = self.summary()
        finally:
            self.layers.clear()
            if self.streamed is not None:  # the weights it streamed, restored once the layers are gone
                self.streamed()

    @property
    def closed(self) -> bool:
        return not self._detach.alive

    def __enter__(self) -> InfinigenCache:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def prompt_key(self) -> dict:
        """What a prompt kept from this cache depends on (``prompts.prompt_key``)."""
        return prompt_key(self)

    def expect(self, tokens: int) -> None:
        """The run will cache up to ``tokens`` tokens per row (prompt and new ones; a decode loop that knows
        its length says so before the prefill): dense layers then hold their buffers at that size from
        the start, instead of growing as tokens arrive (each growth copies a layer's KV beside itself)."""
        self.expected_tokens = max(self.expected_tokens, tokens)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.closed:
            raise InfinigenError("this cache is closed: make a new one with infinigen.cache_for(model)")
        many = key_states.shape[2] > 1
        if many and layer_idx == 0:
            self.host_blocks.plan(self.blocks_ahead(key_states))
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if many and layer_idx == len(self.layers) - 1:
            self.host_blocks.settle()  # before any decode step is captured
        return out

    def blocks_ahead(self, key_states: torch.Tensor) -> list[int]:
        """The sizes of the pool blocks a multi-token step of these keys (layer 0's, B, kv_heads, T, d)
        will add, layer by layer (``sizing.blocks_ahead``)."""
        batch, kv_heads, new, head_dim = key_states.shape
        rows = row_bytes(head_dim, key_states.dtype, self.policy_type.codec, row_bits(self.config))
        made = [(layer.used, 0 if layer.pool is None else len(layer.pool.blocks)) for layer in self.offloaded]
        limit = self.pool_limit(batch, key_states.dtype)
        return blocks_ahead(made, new, batch * kv_heads * rows, self.config.block_tokens, limit)

    def rope(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer ``layer``'s rotary (cos, sin) in the running forward (its type's own where types
        differ: Gemma 3's local and global layers have different bases); None without RoPE."""
        return self.ropes.get(self.rope_types[layer], self.ropes.get(None))

    @property
    def offloaded(self) -> list[OffloadedLayer]:
        return [layer for layer in self.layers if isinstance(layer, OffloadedLayer)]

    def pool_limit(self, batch: int, dtype: torch.dtype) -> int | None:
        """Tokens per (batch row, KV head) each offloaded layer's pool may hold (whole blocks).
        ``cpu_pool_gb`` is the limit of all tensor-parallel ranks together, each holding its share of
        the KV heads: every rank keeps as many tokens as one process would, and evicts the same ones."""
        nbytes = row_bytes(self.spec.head_dim, dtype, self.policy_type.codec, row_bits(self.config))
        pool_gb = None if self.config.cpu_pool_gb is None else self.config.cpu_pool_gb / self.shard.ranks
        return pool_limit(pool_gb, self.n_offloaded, batch, self.shard.kv_count, nbytes, self.config.block_tokens)

    # --- decode steps ------------------------------------------------------------------------

    def begin_decode_step(self) -> None:
        """Host only, before each decode step: the device-side ``slot`` its token goes to (the same in
        every layer while no pool evicts)."""
        self.all_slots(max((layer.capacity for layer in self.layers if layer.is_initialized), default=0) + 1)
        self.slot.fill_(self.get_seq_length())

    def step_signature(self) -> tuple | None:
        """What a CUDA graph of the next decode step depends on (the buffers' capacities), or None where
        it cannot be captured: a buffer grows, CPU, graphs off, streamed weights, a limited pool, a diagnostic."""
        capturable = (
            self.stream is not None
            and self.graphs
            and all(self._capturable(layer) for layer in self.offloaded)
            and all(layer.is_initialized and not layer.grows() for layer in self.layers)
            and self.diagnostics.decode_probe is None
            and self.diagnostics.kept_gathers is None
        )
        if not capturable:
            return None
        return tuple(layer.capacity for layer in self.layers), self.diagnostics.move_rows, self.diagnostics.select_rows

    def captures(self, layer: OffloadedLayer) -> bool:
        """Whether ``layer``'s selection runs as its own CUDA graph: on CUDA, with an
        unlimited pool (eviction bookkeeping counts steps on the host), under transformers' own loop
        (a ``StepGraph`` captures whole steps instead)."""
        return not self.driven and self._capturable(layer)

    def _capturable(self, layer: OffloadedLayer) -> bool:
        return self.graphs and self.stream is not None and layer.max_tokens is None

    def cached_tokens(self) -> torch.Tensor | int:
        """Tokens cached per batch row (``OffloadedLayer.cached_tokens``). In a capturable step every
        pool is unlimited, so every offloaded layer holds the same slots: one layer answers for all."""
        return self.offloaded[0].cached_tokens() if self.offloaded else 0

    def replayed(self, cached: torch.Tensor | int, captured: bool) -> None:
        """After a replay of a captured decode step, the host-side work the replay skipped: each
        offloaded layer's fetch statistics (``cached``: ``cached_tokens()`` before the step), and,
        unless the replay follows its capture (which ran the Python once), the layers' counters."""
        self.replayed_steps += 1
        layers = self.offloaded
        if layers:
            moved = torch.stack([layer.captured_moved for layer in layers])  # (layers, B), out of the graph
            for layer, rows in zip(layers, moved, strict=True):
                # each a graph's buffer (refilled by each replay), an int or None
                selected, attended = (c.clone() if isinstance(c, torch.Tensor) else c for c in layer.captured_counts)
                layer.stats.record(rows, cached, *layer.valid.shape[:2], selected=selected, attended=attended)
        if not captured:
            for layer in self.layers:
                layer.advance()

    # --- fetches -----------------------------------------------------------------------------

    def fetch_mask(self, layer: OffloadedLayer, selection: Selection) -> torch.Tensor:
        """Which fetched rows attention may read: (B, kv_heads, K + 1) bool, the last for the current
        token (set when it arrives). Device work only: it runs inside captured selections."""
        indices, count = self.selected_slots(layer, selection), selection.count
        k = indices.shape[-1]
        valid = torch.empty(*indices.shape[:2], k + 1, dtype=torch.bool, device=self.device)
        selected = valid[:, :, :k]
        selected.copy_(layer.valid.gather(-1, indices))
        if count is not None:
            selected &= self.all_slots(k) < count[:, None, None]
        if selection.valid is not None:
            selected &= selection.valid
        return valid

    def selected_slots(self, layer: OffloadedLayer, selection: Selection) -> torch.Tensor:
        """(B, kv_heads, K) the slots of ``selection`` (every used slot where it names none)."""
        if selection.indices is not None:
            return selection.indices
        batch, kv_heads = layer.valid.shape[:2]
        return self.all_slots(layer.used).expand(batch, kv_heads, layer.used)

    def fetch(
        self, layer: OffloadedLayer, selection: Selection, valid: torch.Tensor | None = None, step: bool = True
    ) -> Fetched:
        """Start moving the selected rows of ``layer`` into a staging buffer; ``valid``: their ``fetch_mask``
        (computed here when not given); ``step``: False for a multi-token step (every cached row selected)."""
        indices, count = self.selected_slots(layer, selection), selection.count
        if valid is None:
            valid = self.fetch_mask(layer, selection)
        if step and self.reuses(layer):  # a multi-token step's bulk fetch leaves the resident rows alone
            return self._fetch_new_rows(layer, indices, count, valid, step)
        batch, kv_heads, k = indices.shape
        parity, room = layer.index % 2, max(k, layer.rows_room())
        rows = self._buffer("rows", parity, (batch, kv_heads, 2, k + 1, layer.head_dim), layer.dtype, room + 1)
        self.count_fetch(layer, count if count is not None else k, step=step)
        if layer.max_tokens is not None:
            layer.record_fetch(indices, valid[:, :, :k])
        packed = None
        moved = rows[:, :, :, :k]
        if layer.policy.codec is not None:  # rows move compressed; ``wait`` decodes them
            width = layer.pool.shape[-1]
            packed = moved = self._buffer("packed", parity, (*rows.shape[:3], k, width), layer.dtype, room)
        selection_end = self._selection_end()
        if step:
            ready = self._move(layer, indices, count, moved)
        else:  # every cached row: block copies, no row kernel
            ready = self._on_transfer_stream(layer, partial(layer.pool.read_range, k, moved))
        return Fetched(rows, valid, indices, ready, selection_end, packed, layer.policy.codec)

    def _fetch_new_rows(self, layer: OffloadedLayer, indices, count, valid, step: bool) -> Fetched:
        """``fetch`` with row reuse: the rows selected again stay where they are on the GPU, and only
        the rows the selection adds move, into the positions the dropped ones free (``reuse``; with
        ``resident_extra``, into free positions, then those of the least recently selected rows)."""
        k, extra = indices.shape[-1], self.resident_extra
        resident = layer.resident_rows(reuse.resident_positions(k, extra))
        placement = resident.place(indices, valid[:, :, :k], keep_recent=extra > 0)
        slots = resident.slots.clamp(min=0)
        # eagerly, the statistics' cached tokens, read before the token's store may change the validity
        cached = None if self.capturing else layer.cached_tokens()
        selection_end = self._selection_end()
        # the move starts after everything the compute stream reads from this stream (its ready event)
        ready = self._move(
            layer, placement.missing, placement.count, resident.rows, placement.destination, resident.scales
        )
        # the statistics once the move is queued: off the path from the selection to the rows. They read
        # the held positions alone: the compute stream sets the token's (the last) after ``selection_end``.
        selected = count if count is not None else k
        # attended: the selection, and with ``resident_extra`` the rows of earlier steps held with it
        attended = placement.held.double().mean(dim=1) if extra else selected
        self.count_fetch(layer, placement.count.double().mean(dim=1), selected, attended, step, cached)
        if resident.scales is None:
            return Fetched(resident.rows, placement.attend, slots, ready, selection_end)
        # 8-bit rows stay codes: ``wait`` dequantises them into one buffer every layer's attention shares
        room = reuse.resident_positions(max(k, layer.rows_room()), extra) + 1
        rows = self._buffer("dequantised", 0, resident.rows.shape, layer.dtype, room)
        codes, scales, factors = resident.rows[:, :, :, :-1], resident.scales[:, :, :, :-1], layer.pool.factors
        attend = placement.attend
        return Fetched(rows, attend, slots, ready, selection_end, packed=codes, scales=scales, factors=factors)

    def count_fetch(
        self, layer: OffloadedLayer, moved, selected=None, attended=None, step: bool = True, cached=None
    ) -> None:
        """A fetch's statistics: rows per head moved (B,) or int, selected and attended where they differ
        (row reuse), ``cached``: ``layer.cached_tokens()`` if read earlier; a captured step's: ``replayed``."""
        if self.capturing:
            layer.captured_moved, layer.captured_counts = moved, (selected, attended)
        else:
            cached = layer.cached_tokens() if cached is None else cached
            layer.stats.record(moved, cached, *layer.valid.shape[:2], selected=selected, attended=attended, step=step)

    def all_slots(self, n: int) -> torch.Tensor:
        """arange(n) on the device, cached."""
        if self.slot_range.numel() < n:
            self.slot_range = torch.arange(max(n, 2 * self.slot_range.numel()), device=self.device)
        return self.slot_range[:n]

    def _buffer(self, name: str, parity: int, shape: tuple[int, ...], dtype: torch.dtype, room: int) -> torch.Tensor:
        """A staging buffer's view, two per name (layers alternate), made once at ``room`` tokens (``rows_room``)."""
        numel = math.prod(shape)
        buffer = self.buffers.get((name, parity))
        if buffer is None or buffer.dtype != dtype or buffer.numel() < numel:
            self.buffers[name, parity] = buffer = None  # the old one's memory free for the new
            empty = torch.empty(max(numel, numel // max(shape[-2], 1) * room), dtype=dtype, device=self.device)
            buffer = self.buffers[name, parity] = self.on_both_streams(empty)
        return buffer[:numel].view(shape)

    # --- streams: selections and row moves beside the compute --------------------------------

    def aside(self, prefetch: Callable[[], Fetched], inputs: tuple[torch.Tensor, ...]) -> Fetched:
        """Run ``prefetch`` (a layer's selection and fetch) on the selection stream after the compute
        stream's work so far; the compute stream goes on with the current layer meanwhile and meets the
        result at the fetch's events. ``inputs``: compute-stream tensors it reads. Inline on CPU."""
        side = self.selection_stream
        if side is None:
            return prefetch()
        compute = torch.cuda.current_stream(self.device)
        side.wait_stream(compute)
        self.selected_aside = True
        with torch.cuda.stream(side):
            fetched = prefetch()
            if fetched.ready is None:  # rows not moved (--breakdown): the compute stream meets the selection
                fetched.ready = torch.cuda.Event()
                fetched.ready.record(side)
                fetched.selection_end = fetched.ready
        # the allocator must not hand these blocks to other work while the other stream may still read them
        for tensor in inputs:
            tensor.record_stream(side)
        for tensor in (fetched.valid, fetched.indices):
            tensor.record_stream(compute)
        return fetched

    def _selection_end(self) -> torch.cuda.Event | None:
        """An event after a fetch's selection, where it ran (None on CPU): from it the token may be stored."""
        return torch.cuda.current_stream(self.device).record_event() if self.stream is not None else None

    def _move(
        self, layer: OffloadedLayer, indices, count, out, destination=None, scales=None
    ) -> torch.cuda.Event | None:
        """The selected rows' gather (unless a diagnostic skips it; kept for --breakdown's replay);
        ``scales``: 8-bit rows' scales where the rows stay codes (``transfer.gather_rows``)."""
        if self.diagnostics.kept_gathers is not None:
            self.diagnostics.kept_gathers.append((layer.pool, indices, count, out, destination, scales))
        if not self.diagnostics.move_rows:
            return None
        move = partial(layer.pool.gather, indices, count, out, destination, scales)
        return self._on_transfer_stream(layer, move, indices, count, destination)

    def _on_transfer_stream(self, layer: OffloadedLayer, move, *used: torch.Tensor | None) -> torch.cuda.Event | None:
        """A row move of ``layer``'s pool: inline on CPU; on CUDA on the transfer stream, after the
        current stream's work so far (the selection's), returning the event that marks its end."""
        if self.stream is None:
            move()
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            move()
            ready = torch.cuda.Event()
            ready.record(self.stream)
        # this step's (``out`` is recorded where it is allocated), and the block table and 8-bit
        # scales, which the token's store may replace while the rows move (``KVPool.reserve``)
        for tensor in (*used, layer.pool.block_table, layer.pool.scales):
            if tensor is not None:
                tensor.record_stream(self.stream)
        return ready

    def store(self, layer: OffloadedLayer, start: int, rows: torch.Tensor) -> None:
        """A multi-token step's rows (B, kv_heads, T, 2, d) into the layer's pool from slot ``start``:
        on CUDA on the transfer stream, after the compute stream's work so far, so that the copies
        (all of the prompt's KV over the bus) run beside the next layers' compute instead of holding
        the compute stream. Every later read of the pool is a gather on that same stream. (8-bit rows
        are encoded first, on the compute stream, which writes their device-side scales.)"""
        rows = layer.pool.encode_range(start, rows, self.forward_valid)
        if self.stream is None:
            layer.pool.write_range(start, rows)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            layer.pool.write_range(start, rows)
        rows.record_stream(self.stream)

    def wait(self, fetched: Fetched, selection_only: bool = False) -> None:
        """Make the compute stream wait for a prefetch (timed with events), then decode compressed rows;
        ``selection_only``: for the end of its selection alone. In a captured step the events are graph
        nodes (``external``): each replay records them again, so the last replay's waits can be read."""
        if selection_only:
            if fetched.selection_end is not None:
                torch.cuda.current_stream(self.device).wait_event(fetched.selection_end)
            return
        if fetched.ready is not None:
            before, after = (torch.cuda.Event(enable_timing=True, external=self.capturing) for _ in range(2))
            before.record()
            torch.cuda.current_stream(self.device).wait_event(fetched.ready)
            after.record()
            (self.step_wait_events if self.capturing else self.wait_events).append((before, after))
        if fetched.scales is not None:
            out = fetched.rows[:, :, :, : fetched.packed.shape[3]]
            int8_rows.dequantise(fetched.packed, fetched.scales, fetched.factors, out)
        elif fetched.packed is not None:
            fetched.codec.decode(fetched.packed, fetched.rows[:, :, :, : fetched.packed.shape[3]])

    def join_selections(self) -> None:
        """After a forward that selected on the side, the compute stream waits for the selection stream's
        work: the statistics queued after each move (a capture must join every stream it forked, only those)."""
        if self.selected_aside:
            self.selected_aside = False
            torch.cuda.current_stream(self.device).wait_stream(self.selection_stream)

    def on_both_streams(self, buffer: torch.Tensor) -> torch.Tensor:
        """``buffer``, which the transfer stream writes: the allocator must not reuse its memory while
        that stream may still do so."""
        if self.stream is not None:
            buffer.record_stream(self.stream)
        return buffer

    def summary(self) -> dict:
        """What the run did (``stats.cache_summary``); as it stood at ``close`` once closed."""
        return self.closing_summary if self.closing_summary is not None else cache_summary(self)
