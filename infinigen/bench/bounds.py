"""The chip's limit for a ``bench`` row: what its decode step and its prefill could take at the rates this
process measures, so a row says how far it is from them.

A decode step reads every weight and the KV it attends on the GPU, and moves its fetched rows (and any
streamed layers) over the host link; the two overlap, so the step's bound (``step_bound_ms``) is the larger
of its device work and its bus bytes at the link's measured rate. Its device work is the longer of its bytes
read at the device's measured memory rate and its multiply-adds at the measured matrix rate
(``matmul_tflop_s``: a product in the run's dtype, the CPU's own on the CPU). The speculation's partial keys
and the selection are not counted: the bound is what the step would take without them. A prefill's
arithmetic (``prefill_tflop_s``): 2 FLOP a decoder weight a prompt token, causal attention's 2 x 2 x d per
head, layer and (query, key) pair it reads (T^2 / 2 of them; T x window for a sliding layer), and the head's
for each row's last token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infinigen.runtime.memory.sizing import Model, offloaded_layer_indices
from infinigen.runtime.memory.throughput import device_rates, measured_rates


@dataclass(frozen=True)
class ChipRates:
    matmul_tflop_s: float
    memory_gb_s: float  # device memory traffic (``throughput.device_rates``)
    bus_gb_s: float | None  # pinned host->device; None on the CPU (nothing crosses)


def measured(device: torch.device, dtype: torch.dtype, bus_gb_s: float | None) -> ChipRates:
    """The rates of ``device`` in this process (``bus_gb_s``: measured already by the caller); on the CPU from
    a smaller copy and matmul, which take it a second."""
    if device.type == "cuda":
        rates = measured_rates(device, dtype, bus_gb_s)
        return ChipRates(rates.matmul_tflops, rates.device_gb_s, bus_gb_s)
    traffic, tflops = device_rates(device, dtype, 64 << 20, 1024)
    return ChipRates(tflops, traffic, None)


def _decoder_weights(model: Model, dtype: torch.dtype) -> int:
    """The parameters every token multiplies by: all but the embedding table and the head."""
    return model.weight_bytes // dtype.itemsize - model.vocab * model.hidden * (1 if _tied(model) else 2)


def _tied(model: Model) -> bool:
    return bool(getattr(model.config, "tie_word_embeddings", False))


def _attended(model: Model, tokens: int, offloaded: set[int], fraction: float) -> list[float]:
    """Keys each layer's query reads per batch row at ``tokens`` cached: a sliding layer its window, an
    offloaded layer ``fraction`` of them."""
    return [
        min(window or tokens, tokens) * (fraction if i in offloaded else 1.0) for i, window in enumerate(model.windows)
    ]


def step_work(
    model: Model, dtype: torch.dtype, batch: int, tokens: int, dense_layers: int | None, fraction: float
) -> dict:
    """A decode step's device work at ``tokens`` cached per row: the bytes it reads (every weight but the
    embedding table's unread rows, the attended KV in the model's dtype) and its FLOP. ``dense_layers``:
    None where every layer's KV is on the GPU, else the layers an offloading policy keeps there, the others
    attending ``fraction`` of their tokens."""
    spec, e = model.spec, dtype.itemsize
    offloaded = set() if dense_layers is None else set(offloaded_layer_indices(model.windows, dense_layers, True))
    keys = sum(_attended(model, tokens, offloaded, fraction))  # per batch row, over the layers
    table = 0 if _tied(model) else model.vocab * model.hidden  # the embedding table: a row per token read
    read = model.weight_bytes - table * e + batch * keys * spec.n_kv_heads * spec.head_dim * 2 * e
    flops = 2 * batch * (_decoder_weights(model, dtype) + model.vocab * model.hidden)
    flops += 4 * batch * keys * spec.n_heads * spec.head_dim  # q·k and p·v
    return {"device_mb_per_step": read / 1e6, "step_gflop": flops / 1e9}


def prefill_flop(model: Model, dtype: torch.dtype, batch: int, tokens: int) -> float:
    """A causal prefill's FLOP for ``batch`` rows of ``tokens``."""
    spec = model.spec
    pairs = sum(_causal_pairs(tokens, window or tokens) for window in model.windows)
    attention = 4 * batch * pairs * spec.n_heads * spec.head_dim
    return 2 * batch * tokens * _decoder_weights(model, dtype) + attention + 2 * batch * model.vocab * model.hidden


def _causal_pairs(tokens: int, window: int) -> int:
    """(query, key) pairs of a causal prefill whose queries read at most ``window`` keys each."""
    near = min(tokens, window)
    return near * (near + 1) // 2 + (tokens - near) * window


def with_bound(row: dict, rates: ChipRates) -> dict:
    """``row`` (a ``run_case`` result) with its step's bound and ratio to it, and its prefill's FLOP rate."""
    if "ms_per_step" not in row or "step_gflop" not in row:
        return row
    compute = max(row["device_mb_per_step"] / rates.memory_gb_s, row["step_gflop"] / rates.matmul_tflop_s)  # ms
    crossing = (row.get("h2d_mb_per_step") or 0) + (row.get("streamed_weights_mb_per_step") or 0)
    bus = crossing / rates.bus_gb_s if rates.bus_gb_s else 0.0  # MB over GB/s: ms
    bound = max(compute, bus)
    return row | {
        "step_compute_ms": _significant(compute),
        "step_bus_ms": _significant(bus),
        "step_bound_ms": _significant(bound),
        "step_over_bound": round(row["ms_per_step"] / bound, 2),
        "prefill_tflop_s": _significant(row["prefill_tflop"] / row["prefill_s"]) if row.get("prefill_s") else None,
    }


def _significant(value: float) -> float:
    return float(f"{value:.4g}")
