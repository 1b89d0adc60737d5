"""The CPU KV pool of one offloaded layer.

Layout: blocks of ``[batch, kv_heads, block_tokens, 2, head_dim]`` (pinned on CUDA: ``host_memory``), so
one token's K and V of one KV head form one contiguous row of ``2 * head_dim`` elements (512 B at
head_dim 128 in float16): the unit every fetch moves. With ``kv_bits`` 8 a row holds each K and V
as int8 codes (keys smoothed per channel first) and their scales and the channels' factors stay on the
compute device (``scales``, ``factors``, ``int8_rows``): rows are quantised as they are written and
dequantised by the gather. The pool grows block by block; nothing
in host memory is ever copied to grow it.

A prompt's rows go in, and a multi-token step reads every cached row back, as DMA copies
(``write_range``, ``read_range``); a decode step's rows and its selected rows go through
``kernels.transfer``: a zero-copy Triton kernel on CUDA (the GPU reads/writes pinned host
memory directly), plain PyTorch indexing on CPU.
"""

from __future__ import annotations

import math
import weakref

import torch

from infinigen.runtime.kernels import int8_rows, transfer
from infinigen.runtime.kernels.buffers import grown_to
from infinigen.runtime.kernels.triton_support import on_triton
from infinigen.runtime.memory.host_memory import HostBlocks, copy_runs, retire
from infinigen.runtime.selection.policies.base import RowCodec


def stored_width(head_dim: int, dtype: torch.dtype, codec: RowCodec | None) -> int:
    """Elements of ``dtype`` per K or V in a pool row: head_dim, or a policy codec's stored width."""
    return head_dim if codec is None else codec.stored_dim(head_dim, dtype)


def row_bytes(head_dim: int, dtype: torch.dtype, codec: RowCodec | None, kv_bits: int) -> int:
    """Bytes of one pool row (K and V of one token and KV head) in host memory: what sizes a limited
    pool before any pool exists (``KVPool.row_bytes`` once one does)."""
    if kv_bits == 8:
        return 2 * head_dim
    return 2 * stored_width(head_dim, dtype, codec) * dtype.itemsize


class KVPool:
    def __init__(
        self,
        batch: int,
        kv_heads: int,
        width: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        block_tokens: int,
        kv_bits: int = 16,
        gather_rows: int | None = None,
        gather_programs: int | None = None,
        host: HostBlocks | None = None,
    ) -> None:
        """``width`` elements of ``dtype`` per K or V: head_dim, or a policy codec's stored width.
        ``kv_bits`` 8: rows of head_dim values are stored in 8 bits (``int8_rows``), and ``dtype``
        is the one they are written and gathered in. ``host``: where blocks come from (the cache's,
        which makes a prefill's blocks ahead of it)."""
        self.kv_bits = kv_bits
        self.dtype = dtype if kv_bits == 16 else torch.int8  # as stored
        self.device = device
        self.shape = (batch, kv_heads, block_tokens, 2, width)
        self.block_tokens = block_tokens
        # the CUDA gather's tuning (``RuntimeConfig.gather_rows``, ``gather_programs``): 16 rows a loop
        # step for either format (8-bit rows, 256 B: 15.81 vs 16.91 ms a 1 x 128K step with 8; H200)
        self.gather_rows = gather_rows or 16
        self.gather_programs = gather_programs
        self.host = host or HostBlocks(device)
        self.blocks: list[torch.Tensor] = []
        # the blocks this pool made, reused or freed once it is gone and no queued work reads them; the
        # others belong to kept prompts (``cache.kept``), which the pool holds alive while it reads them
        self.owned: list[torch.Tensor] = []
        self.lenders: list[object] = []
        weakref.finalize(self, retire, self.owned, device)
        self.block_table = torch.empty(0, dtype=torch.int64, device=device)  # data_ptr of each block
        # 8-bit rows: (B, kv_heads, capacity, 2) float32, each slot's K and V scale, on the compute
        # device. Written on the compute stream only (``encode_range``, ``write_slots``), beside the
        # layer's other per-slot state; replaced (grown) only where the block table is
        self.scales = torch.zeros(batch, kv_heads, 0, 2, device=device) if kv_bits == 8 else None
        # 8-bit rows: (B, kv_heads, 2, width) float32, each row's channels' smoothing factors (``int8_rows``),
        # set in place from the row's first tokens written (``smoothed``), so a captured step's pointer stays valid
        self.factors = torch.ones(batch, kv_heads, 2, width, device=device) if kv_bits == 8 else None
        self.smoothed = False  # every row's factors set
        self.rows_smoothed = torch.zeros(batch, dtype=torch.bool, device=device) if kv_bits == 8 else None

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.block_tokens

    @property
    def row_bytes(self) -> int:
        """Bytes of one (token, KV head) row in host memory: its K and V (what a fetch moves)."""
        return 2 * self.shape[-1] * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return sum(block.nbytes for block in self.blocks)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block: ``block_tokens`` rows per (batch row, KV head)."""
        return math.prod(self.shape) * self.dtype.itemsize

    def reserve(self, n_tokens: int) -> None:
        """Allocate blocks until ``n_tokens`` slots exist (the caller writes every new slot below
        ``n_tokens``; the new slots above it are zeroed: a fetch of a whole page or a fixed number of
        rows may read them, and attention masks them, but a masked row must hold no NaN)."""
        added = False
        while self.capacity < n_tokens:
            self.blocks.append(self.host.take(self.block_nbytes).view(self.dtype).view(self.shape))
            self.owned.append(self.blocks[-1])
            added = True
        if added:
            self.blocks[-1][:, :, n_tokens - self.capacity + self.block_tokens :].zero_()
            self._blocks_changed()

    def _blocks_changed(self) -> None:
        """The device's block table (and 8-bit scales) for the blocks as they now are."""
        pinned = self.device.type == "cuda"
        table = torch.tensor([block.data_ptr() for block in self.blocks], dtype=torch.int64, pin_memory=pinned)
        # from pinned memory without waiting for the device (a pageable copy would wait for the queued work)
        self.block_table = table.to(self.device, non_blocking=True)
        if self.scales is not None:
            self.scales = grown_to(self.scales, self.capacity, 2)

    def lend(self, blocks: int, lender: object) -> list[torch.Tensor]:
        """The first ``blocks`` blocks, which from now on belong to ``lender`` (a kept prompt): this pool
        reads them on, holding the lender alive, and no longer retires them."""
        lent = self.blocks[:blocks]
        self.owned[:] = [block for block in self.owned if not any(block is other for other in lent)]
        self.lenders.append(lender)
        return lent

    def adopt(self, lent: list[torch.Tensor], lender: object, own: list[torch.Tensor], scales, factors) -> None:
        """An empty pool starts from a kept prompt's blocks: ``lent`` (read, never written: ``lender``'s)
        then ``own`` (copies this pool may write), its 8-bit ``scales`` (B, kv_heads, slots, 2) and
        channel ``factors``."""
        self.blocks[:] = [*lent, *own]
        self.owned[:] = own
        self.lenders.append(lender)
        if self.kv_bits == 8:
            self.factors.copy_(factors)
            self.smoothed = True
            self.rows_smoothed.fill_(True)
            self.scales = scales
        self._blocks_changed()

    def encode_range(self, start: int, rows: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Rows (batch, kv_heads, T, 2, d) for slots start .. start+T-1 as ``write_range`` takes them:
        with ``kv_bits`` 8 their codes, their scales written into ``scales`` here (on the current stream).
        ``valid`` (B, T) bool: which are tokens, not padding (None: all)."""
        if self.kv_bits == 16:
            return rows
        self.reserve(start + rows.shape[2])
        codes, scales = int8_rows.encode(rows, self.smoothing(rows, valid))
        self.scales[:, :, start : start + rows.shape[2]] = scales
        return codes

    def smoothing(self, rows: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """The channel factors (B, kv_heads, 1, 2, width), broadcast to rows (B, kv_heads, T, 2, width), each
        row's set from its first tokens among ``rows`` (``valid`` (B, T) bool: which are tokens; None: all)
        if none were yet: a prompt's first chunk, padding and the other rows left out, so that a row's codes
        are those it has alone (where its first chunk holds the same tokens)."""
        if self.smoothed:
            return self.factors[:, :, None]
        found = int8_rows.channel_factors(rows, valid)
        if valid is None:  # every row has its first tokens here: no wait for the device
            self.factors.copy_(torch.where(self.rows_smoothed[:, None, None, None], self.factors, found))
            self.rows_smoothed.fill_(True)
            self.smoothed = True
            return self.factors[:, :, None]
        given = valid.any(1)
        first = given & ~self.rows_smoothed  # (B,): rows whose first tokens these are
        self.factors.copy_(torch.where(first[:, None, None, None], found, self.factors))
        self.rows_smoothed |= given
        self.smoothed = bool(self.rows_smoothed.all())  # a padded prefill's wait, until every row has tokens
        return self.factors[:, :, None]

    def write_range(self, start: int, rows: torch.Tensor) -> None:
        """Store encoded rows (``encode_range``) at slots start .. start+T-1 of every (batch, head)."""
        end = start + rows.shape[2]
        self.reserve(end)
        for index in range(start // self.block_tokens, (end - 1) // self.block_tokens + 1):
            block_start = index * self.block_tokens
            lo, hi = max(start, block_start), min(end, block_start + self.block_tokens)
            slots = self.blocks[index][:, :, lo - block_start : hi - block_start]
            _copy_runs(slots, rows[:, :, lo - start : hi - start])

    def write_row(self, row: int, start: int, rows: torch.Tensor) -> None:
        """Store rows (kv_heads, T, 2, w) as stored (a kept prompt's) at slots start .. start+T-1 of batch row
        ``row`` (the slots exist): a host copy."""
        end = start + rows.shape[1]
        for index in range(start // self.block_tokens, (end - 1) // self.block_tokens + 1):
            block_start = index * self.block_tokens
            lo, hi = max(start, block_start), min(end, block_start + self.block_tokens)
            self.blocks[index][row, :, lo - block_start : hi - block_start].copy_(rows[:, lo - start : hi - start])

    def clear_row(self, row: int, end: int) -> None:
        """Zero slots 0 .. end-1 of batch row ``row`` (padding: masked, but no NaN may be read there)."""
        for index in range(-(-end // self.block_tokens)):
            self.blocks[index][row, :, : end - index * self.block_tokens].zero_()

    def read_range(self, end: int, out: torch.Tensor) -> None:
        """out (B, H, 2, end, d) <- slots 0 .. end-1 of every (batch, head), K and V split into planes
        and 8-bit rows dequantised as ``gather`` leaves them: a multi-token step's read of everything
        cached, as DMA copies a block at a time into one block on the device. No row kernel runs, so a
        process's first prefill does not wait for one to be built."""
        staged = self.new_block(self.block_tokens)
        for lo in range(0, end, self.block_tokens):
            hi = min(end, lo + self.block_tokens)
            out[:, :, :, lo:hi] = self.read_rows(lo, hi, staged, out.dtype).transpose(2, 3)

    def new_block(self, tokens: int) -> torch.Tensor:
        """An empty (B, H, tokens, 2, width) on the compute device, in the pool's stored dtype: ``read_rows``'s."""
        return torch.empty(*self.shape[:2], tokens, *self.shape[3:], dtype=self.dtype, device=self.device)

    def read_rows(
        self, lo: int, hi: int, staged: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Slots lo .. hi-1 of every (batch, head) as DMA copies into ``staged`` (B, H, >= hi - lo, 2, width,
        on the device, in the pool's stored dtype): (B, H, hi - lo, 2, width) rows, 8-bit ones dequantised
        to ``dtype`` (into ``out`` where given, else a new tensor)."""
        part = staged[:, :, : hi - lo]
        for index in range(lo // self.block_tokens, (hi - 1) // self.block_tokens + 1):
            start = index * self.block_tokens
            a, b = max(lo, start), min(hi, start + self.block_tokens)
            _copy_runs(part[:, :, a - lo : b - lo], self.blocks[index][:, :, a - start : b - start])
        if self.kv_bits != 8:
            return part
        scales = self.scales[:, :, lo:hi]  # (B, H, n, 2)
        if not on_triton(part.device):
            rows = int8_rows.decode(part, scales, dtype, self.factors[:, :, None])
            return rows if out is None else out.copy_(rows)
        rows = torch.empty(part.shape, dtype=dtype, device=part.device) if out is None else out  # one kernel
        int8_rows.dequantise(part.transpose(2, 3), scales.transpose(2, 3), self.factors, rows.transpose(2, 3))
        return rows

    def write_slots(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Store rows (batch, kv_heads, 1, 2, d) at per-(batch, head) slots (batch, kv_heads)."""
        if self.kv_bits == 8:
            rows, scales = int8_rows.encode(rows, self.smoothing(rows))
            self.scales.scatter_(2, slots[:, :, None, None].expand(-1, -1, 1, 2), scales)
        transfer.scatter_rows(self, slots, rows)

    def gather(
        self, indices: torch.Tensor, count: torch.Tensor | None, out: torch.Tensor, destination=None, out_scales=None
    ) -> None:
        """out[b, h, j] = row indices[b, h, j], for j < count[b] or count[b, h] (all j when count is None);
        with ``destination`` (B, H, K), at out[b, h, destination[b, h, j]] instead. 8-bit rows arrive
        dequantised to ``out``'s dtype, or as stored with ``out_scales`` (``transfer.gather_rows``)."""
        transfer.gather_rows(self, indices, count, out, destination, out_scales)


def _copy_runs(target: torch.Tensor, source: torch.Tensor) -> None:
    """target <- source, (B, H, T, 2, w), one of them (on the host) part of a pool block. Part of a
    block is strided, which ``copy_`` would stage in pageable memory, and a strided GPU side ``copy_``
    stages in a GPU buffer and copies again: on CUDA one 2D DMA copy of every (batch row, head) run
    (``host_memory.copy_runs``), else one copy per run (not the GPU's own stores, which reach freshly
    registered pages at a tenth of the link: 3.7 vs 40 GB/s, BENCHMARKS "Prefill")."""
    if (target.is_contiguous() and source.is_contiguous()) or "cuda" not in (target.device.type, source.device.type):
        target.copy_(source, non_blocking=True)
        return
    if copy_runs(target, source):  # one 2D copy of every run
        return
    for run, part in zip(target.flatten(0, 1), source.flatten(0, 1), strict=True):
        run.copy_(part, non_blocking=True)
