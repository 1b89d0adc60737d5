"""``infinigen bench --micro``: the selective gather against the bulk pinned copy, and speculation
against a dense decode layer, each timed as decode steps run them (CUDA graph replays)."""

from __future__ import annotations

import functools
import itertools
import math
import statistics
import time

import torch
from transformers import PreTrainedModel

from infinigen.bench.runs import BenchCase, pinned_bandwidth, run_case
from infinigen.runtime import RuntimeConfig


def median_ms(fn, device: torch.device, repeats: int = 20) -> float:
    """Median milliseconds of ``fn()`` (after one warm-up call): between CUDA events on a GPU."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type != "cuda":
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
            continue
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


@torch.no_grad()
def micro_gather(
    device: str,
    dtype: torch.dtype,
    kv_heads: int,
    head_dim: int,
    contexts: list[int],
    fractions: list[float],
    bulk: float | None,
    kv_bits: list[int],
    gather_rows: int | None = None,
    gather_programs: int | None = None,
) -> list[dict]:
    """The selective gather alone (one layer, batch 1, random sorted slots per head) against the
    same run's pinned bulk copy (``bulk`` GB/s; None on CPU): GB/s and share of it per context,
    fraction and row format (``kv_bits``; GB/s of bytes moved, 8-bit rows dequantised on the way),
    with the gather's tuning (``RuntimeConfig.gather_rows`` / ``gather_programs``) as given. On
    CUDA the gathers are replayed from a CUDA graph, as decode steps run them, several back to back:
    the figure is the device's time per call, not the host's launch cost."""
    from infinigen.runtime.memory.pool import KVPool

    rows = []
    generator = torch.Generator().manual_seed(0)
    for context, bits in itertools.product(contexts, kv_bits):
        pool = KVPool(
            1,
            kv_heads,
            head_dim,
            dtype,
            torch.device(device),
            block_tokens=1024,
            kv_bits=bits,
            gather_rows=gather_rows,
            gather_programs=gather_programs,
        )
        pool.reserve(context)
        for fraction in fractions:
            k = max(1, round(fraction * context))
            slots = torch.rand(kv_heads, context, generator=generator).topk(k).indices.sort().values
            indices = slots[None].to(device)
            out = torch.empty(1, kv_heads, 2, k, head_dim, dtype=dtype, device=device)
            ms = device_ms(functools.partial(pool.gather, indices, None, out), torch.device(device))
            nbytes = k * kv_heads * pool.row_bytes
            rows.append(
                {
                    "context": context,
                    "kv_bits": bits,
                    "fraction": fraction,
                    "bytes": nbytes,
                    "ms": round(ms, 3),
                    "gb_s": round(nbytes / ms / 1e6, 1),
                    "share_of_bulk": round(nbytes / ms / 1e6 / bulk, 3) if bulk else None,
                }
            )
    return rows


def _speculate(x, query_projection, partial_keys, key_scale, valid, budget: float) -> None:
    from infinigen.runtime.kernels.top_slots import CountRule
    from infinigen.runtime.selection.policies.infinigen import select_tokens

    partial_query = torch.einsum("bx,hxr->bhr", x, query_projection)
    k_max = math.ceil(budget * partial_keys.shape[2])
    select_tokens(partial_query, partial_keys, valid, k_max, CountRule(budget, math.inf, 8), key_scale=key_scale)


CALLS_PER_REPLAY = 8  # --micro on CUDA: calls per timed graph replay


def captured_replay(fn, calls: int = 1):
    """``fn`` called ``calls`` times back to back, captured as one CUDA graph: its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def device_ms(fn, device: torch.device) -> float:
    """Milliseconds of one ``fn()``. On CUDA: replayed from a CUDA graph, as the runtime runs a
    layer's selection and gather, several calls back to back, so the figure is the device's time
    per call and not the host's launch cost."""
    if device.type != "cuda":
        return median_ms(fn, device)
    return median_ms(captured_replay(fn, CALLS_PER_REPLAY), device) / CALLS_PER_REPLAY


@torch.no_grad()
def micro_speculation(model: PreTrainedModel, budget: float, batch: int, contexts: list[int], rank: int) -> list[dict]:
    """Speculation of one layer (partial query projection, scores over the partial key cache, per-row
    count, top-k; replayed from a CUDA graph on CUDA, as the runtime does) against the layer's own
    share of a dense decode step, per context length."""
    from infinigen.architectures import model_spec
    from infinigen.runtime.kernels.scoring import quantize_rows

    spec = model_spec(model.config)
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    rows = []
    for context in contexts:
        x = torch.randn(batch, spec.hidden_size, device=device, dtype=dtype)
        query_projection = torch.randn(spec.n_heads, spec.hidden_size, rank, device=device, dtype=dtype)
        partial_keys = torch.randn(batch, spec.n_kv_heads, context, rank, device=device, dtype=dtype)
        codes, scale = quantize_rows(partial_keys, RuntimeConfig.partial_key_bits)  # as the runtime stores them
        valid = torch.ones(batch, spec.n_kv_heads, context, dtype=torch.bool, device=device)
        speculate = functools.partial(_speculate, x, query_projection, codes, scale, valid, budget)
        speculation_ms = device_ms(speculate, device)
        dense = run_case(model, None, BenchCase("dense", batch, context, gen_len=5, warmup=2))
        layer_ms = dense["ms_per_step"] / spec.n_layers
        rows.append(
            {
                "context": context,
                "speculation_ms": round(speculation_ms, 3),
                "dense_layer_ms": round(layer_ms, 3),
                "speculation_share": round(speculation_ms / layer_ms, 3),
            }
        )
    return rows


def micro_report(model: PreTrainedModel, contexts: list[int], budget: float, kv_bits: list[int]) -> dict:
    """``bench --micro``: the gather over fractions of each context in each row format, and
    speculation at ``budget``."""
    from infinigen.architectures import model_spec
    from infinigen.prepare import DEFAULT_RATIO, n_channels_for
    from infinigen.runtime.selection.speculation import padded_channels

    spec = model_spec(model.config)
    param = next(model.parameters())
    device = str(param.device)
    fractions = [0.01, 0.02, 0.05, 0.1, 0.2]
    rank = padded_channels(n_channels_for(DEFAULT_RATIO, spec.head_dim))
    bulk = pinned_bandwidth(device)  # None on CPU
    return {
        "pinned_h2d_gb_s": round(bulk, 1) if bulk is not None else None,
        "gather": micro_gather(device, param.dtype, spec.n_kv_heads, spec.head_dim, contexts, fractions, bulk, kv_bits),
        "speculation": micro_speculation(model, budget, 1, contexts, rank),
    }
