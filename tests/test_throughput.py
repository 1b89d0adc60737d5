"""Throughput mode (``runtime.memory.throughput``): the batch and streamed layers of the most tokens/s, its
step estimate, and ``bench --sizes autoxN``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import invoke

from infinigen.bench.shapes import shape_config
from infinigen.runtime.config import RuntimeConfig
from infinigen.runtime.memory import plan as memory
from infinigen.runtime.memory.throughput import (
    DeviceRates,
    best_batch,
    measured_rates,
    prefill_estimate_ms,
    step_estimate_ms,
)

RATES = DeviceRates(h2d_gb_s=50.0, device_gb_s=4000.0, matmul_tflops=500.0)  # an H200's order of magnitude
F16 = torch.float16
HOST = 110 * 10**9


def opt_30b() -> memory.Model:
    return memory.model_of(shape_config("opt-30b"), F16)


def test_a_streamed_step_is_its_bytes_over_the_link():
    """Every layer streamed, ``full``: the step is the streamed weights and every cached row over the link
    (the device's own work is far shorter); with the weights resident, ``dense`` is the weights read once."""
    model, work = opt_30b(), memory.Workload(8, 512, 32, 4096)
    found = memory.plan(model, F16, work, RuntimeConfig(policy="full", streamed_layers=48, dense_layers=0, kv_bits=16))
    rows = 48 * 8 * 56 * 544 * 128 * 2 * 2  # every layer's K and V of every (row, head, token)
    expected = (48 * model.layer_bytes + rows) / 50e9 * 1e3
    assert step_estimate_ms(found, RATES) == pytest.approx(expected, rel=1e-6)
    dense = memory.plan(model, F16, work, RuntimeConfig(policy="dense"))
    kv = sum(p.nbytes for p in dense.parts if p.name == "dense layers' KV")
    assert step_estimate_ms(dense, RATES) == pytest.approx((model.weight_bytes + kv) / 4000e9 * 1e3)


def test_the_prefill_is_its_chunks_weight_streams_and_rereads_and_counts_in_the_throughput():
    """A streamed prefill in chunks: every chunk streams the streamed layers, every later chunk reads about half
    the pool back; tokens/s are over the whole run, so few new tokens favour larger chunks (fewer streams)
    and many favour the larger batch whatever its chunks."""
    model, budget = opt_30b(), 48 * 10**9 - memory.CONTEXT_BYTES
    work = memory.Workload(8, 1920, 128, 256)
    found = memory.plan(model, F16, work, RuntimeConfig(policy="full", streamed_layers=30), budget)
    assert found.workload.chunk == 256  # 8 chunks
    pool = sum(p.nbytes for p in found.parts if p.name == "CPU KV pool")
    moved = 8 * 30 * model.layer_bytes + pool * 7 // 2
    assert prefill_estimate_ms(found, RATES) == pytest.approx(moved / 50e9 * 1e3, rel=1e-6)
    config = RuntimeConfig(policy="infinigen")
    short, _ = best_batch(model, F16, replace(work, new_tokens=4), config, budget, RATES, host_bytes=HOST)
    long, _ = best_batch(model, F16, replace(work, new_tokens=1024), config, budget, RATES, host_bytes=HOST)
    assert short.plan.workload.chunk > long.plan.workload.chunk
    run_s = (long.prefill_ms + 1024 * long.step_ms) / 1e3
    assert long.tokens_per_s == pytest.approx(long.batch * 1024 / run_s)


def test_streaming_more_layers_for_a_larger_batch_pays_where_weights_do_not_fit():
    """FlexGen's setting, OPT-30B on a 16 GB card at 512 + 32 tokens: the fewest streamed layers leave room
    for a few rows; streaming a few more frees the GPU for many more at about the same step, and the plan
    takes the count whose largest batch decodes the most tokens/s. Each candidate fits the GPU and the host."""
    budget = 16 * 10**9 - memory.CONTEXT_BYTES
    work = memory.Workload(1, 512, 32, 4096)
    best, candidates = best_batch(opt_30b(), F16, work, RuntimeConfig(policy="full"), budget, RATES, host_bytes=HOST)
    fewest = candidates[0]
    assert best.tokens_per_s == max(c.tokens_per_s for c in candidates)
    assert best.streamed_layers > fewest.streamed_layers and best.batch >= 8 * fewest.batch
    assert best.tokens_per_s > 5 * fewest.tokens_per_s
    assert all(c.plan.fits and c.plan.host <= HOST and c.plan.workload.batch == c.batch for c in candidates)
    counts = [c.streamed_layers for c in candidates]
    assert counts == list(range(fewest.streamed_layers, 49))


def test_host_memory_bounds_the_batch():
    """Every row's KV lives in host memory beside the streamed weights: less host memory, a smaller batch."""
    budget = 48 * 10**9 - memory.CONTEXT_BYTES
    work, config = memory.Workload(1, 1920, 128, 4096), RuntimeConfig(policy="infinigen")
    roomy, _ = best_batch(opt_30b(), F16, work, config, budget, RATES, host_bytes=HOST)
    tight, _ = best_batch(opt_30b(), F16, work, config, budget, RATES, host_bytes=HOST // 2)
    assert tight.batch < roomy.batch and tight.plan.host <= HOST // 2 < roomy.plan.host


def test_weights_that_fit_stream_nothing_and_asked_layers_are_kept():
    """The 8B shape on a whole H200: no layer streams (the step reads resident weights), and the largest
    batch wins; a streamed-layer count asked is the only one tried (and slower: its bytes cross the link
    every step); where nothing fits, no candidate."""
    model, work = memory.model_of(shape_config("llama-3-8b"), torch.bfloat16), memory.Workload(1, 8192, 64, 4096)
    config = RuntimeConfig(policy="infinigen")
    best, candidates = best_batch(model, torch.bfloat16, work, config, 140 * 10**9, RATES, most=64, host_bytes=HOST)
    assert candidates[0].streamed_layers == 0 and best.streamed_layers == 0
    streamed = replace(config, streamed_layers=8)
    asked, tried = best_batch(model, torch.bfloat16, work, streamed, 140 * 10**9, RATES, most=64, host_bytes=HOST)
    assert [c.streamed_layers for c in tried] == [8] and asked.batch == best.batch == 64
    assert asked.tokens_per_s < best.tokens_per_s  # streamed bytes where nothing needed them
    assert best_batch(model, torch.bfloat16, work, config, 10**9, RATES) == (None, [])


def test_bench_auto_batch_needs_a_gpu_and_a_budget():
    """``--sizes autoxN`` parses, and off a GPU says in one line why it cannot plan; a bad pair is refused."""
    from infinigen.bench.auto_batch import AUTO, parse_sizes

    assert parse_sizes("autox1920,4x1920") == [([AUTO], [1920]), ([4], [1920])]
    result = invoke("bench", "--shape", "tiny-llama", "--sizes", "autox64", "--policy", "infinigen", "--device", "cpu")
    assert result.exit_code == 2 and "auto batch needs" in result.output and "Traceback" not in result.output
    bad = invoke("bench", "--shape", "tiny-llama", "--sizes", "autoxauto", "--device", "cpu")
    assert bad.exit_code == 2 and "BATCHxCONTEXT" in bad.output


def test_an_auto_batch_is_checked_over_the_run_it_was_planned_for():
    """The plan's tokens/s beside the measured ones: the row's prefill and 128 steps at its measured step;
    a row that did not run leaves the plan as it was."""
    from infinigen.bench.auto_batch import AUTO_NEW_TOKENS, measured_run

    plan = {"policy": "infinigen", "context": 1920, "batch": 30, "tokens_per_s_estimate": 35.0}
    row = {"policy": "infinigen", "batch": 30, "prompt_len": 1920, "prefill_s": 10.0, "ms_per_step": 500.0}
    other = row | {"policy": "hf-accelerate", "prefill_s": 1.0}
    checked = measured_run(plan, [other, row])
    assert checked["measured_tokens_per_s"] == round(30 * AUTO_NEW_TOKENS / (10.0 + AUTO_NEW_TOKENS * 0.5), 1)
    assert measured_run(plan, [row | {"ms_per_step": None, "error": "out of memory"}]) == plan


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_rates_are_measured_on_the_device():
    rates = measured_rates(torch.device("cuda"), torch.bfloat16)
    assert rates.h2d_gb_s > 1 and rates.device_gb_s > rates.h2d_gb_s and rates.matmul_tflops > 1
    assert measured_rates(torch.device("cpu"), torch.bfloat16) is None


def test_bench_table_shows_the_plans_batch_and_each_steps_bound(monkeypatch, capsys):
    """For people: the step over its bound as a column, and what the throughput plan chose under the table."""
    from rich.console import Console

    from infinigen.cli import bench, render

    monkeypatch.setattr(render, "console", Console(width=300))
    row = {"policy": "infinigen", "budget": 0.1, "batch": 37, "prompt_len": 1920, "ms_per_step": 600.0}
    plan = {"policy": "infinigen", "context": 1920, "batch": 37, "streamed_layers": 23, "rates": {}}
    report = {"pinned_h2d_gb_s": 50.0, "breakdown": [], "model": None, "shape": "opt-30b", "dtype": "float16"}
    report |= {"device": "H200", "results": [row | {"step_over_bound": 1.12}]}
    bench._print_bench(report | {"throughput_plan": [plan | {"tokens_per_s_estimate": 53.3}]})
    out = capsys.readouterr().out
    assert "step / bound" in out and "1.12" in out and "throughput plan at 1920 tokens" in out and "53.3" in out


def test_a_batch_job_streams_the_layers_of_the_most_tokens_per_second(tokenizer, monkeypatch):
    """A job whose weights exceed the budget (OPT-30B shape, 16 GB, 64 short requests): on a GPU (its rates
    stood in for here) the load streams throughput mode's layer count for the longest request, more than the
    fewest with which one row fits."""
    from infinigen.batch import runner
    from infinigen.batch.records import Request

    monkeypatch.setattr(runner, "measured_rates", lambda device, dtype: RATES)
    monkeypatch.setattr(memory, "host_available_bytes", lambda: HOST)
    requests = [Request(id=i, line=i + 1, prompt="the old house " * 100, max_new_tokens=16) for i in range(64)]
    settings, config = {"policy": "full", "gpu_memory_gb": 16.0}, shape_config("opt-30b")
    placed = runner.weights_plan(settings, requests, max_batch=64)(config, tokenizer, F16, torch.device("cpu"))
    length = len(runner.prompt_ids(tokenizer, requests[0]))
    budget = memory.budget_bytes(16.0, torch.device("cpu"))
    work = memory.Workload(1, length, 16, 4096)
    best, candidates = best_batch(opt_30b(), F16, work, RuntimeConfig(policy="full"), budget, RATES, 64)
    assert placed.streamed_layers == best.streamed_layers > candidates[0].streamed_layers
