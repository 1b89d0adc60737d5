"""Streamed weights in the memory plan (``runtime.memory.streaming``): the last resort's choice of streamed
layers and prefill chunk by the bytes a run moves, and a loaded model's streamed layers planned as its
config's."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_model
from test_plan import BF16, parts

from infinigen.bench.shapes import shape_config
from infinigen.runtime.config import RuntimeConfig
from infinigen.runtime.memory import plan as memory
from infinigen.runtime.memory import streaming
from infinigen.runtime.memory.throughput import step_floor_ms


@pytest.mark.parametrize("policy, slots", [("infinigen", 3), ("dense", 2)])
def test_weights_stream_as_the_last_resort_and_as_few_as_fit(policy, slots):
    """Where nothing else fits, the plan streams weights: its settings at the fewest decoder layers with which
    they fit, moving no more bytes over the run than the most shed settings at theirs; a streamed layer's
    weights leave the GPU for host memory, and the slots hold the running layer, one kept ahead for a
    speculation that reads the next layer (policies that select a layer ahead) and the one being copied."""
    model = memory.model_of(shape_config("llama-3-8b"), BF16)
    layer = (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096) * 2  # q, o; k, v; the MLP; 2 norms
    assert model.layer_bytes == layer
    work = memory.Workload(1, 32768, 8, 4096)
    budget = 12 * 10**9
    assert not memory.plan(model, BF16, work, RuntimeConfig(policy=policy, streamed_layers=0), budget).fits
    found = memory.plan(model, BF16, work, RuntimeConfig(policy=policy), budget)
    n = found.config.streamed_layers
    assert found.fits and 0 < n < 32 and found.shed[-1] == f"weights: {n} decoder layers streamed from host memory"
    got = parts(found)
    assert got["weights"] == model.weight_bytes - n * layer and got["weights: streaming slots"] == slots * layer
    assert got["weights: streamed layers"] == n * layer  # in host memory
    unstreamed = replace(found, config=replace(found.config, streamed_layers=0))
    crossing = step_floor_ms(found, model, BF16, 50.0) - step_floor_ms(unstreamed, model, BF16, 50.0)
    assert crossing == pytest.approx(n * layer / 50e9 * 1e3)  # a step's floor: the streamed weights cross too
    fewer = replace(found.config, streamed_layers=n - 1)
    assert not replace(found, parts=tuple(memory.plan_parts(model, BF16, found.workload, fewer, found.reuse))).fits
    most_shed = RuntimeConfig(policy=policy, dense_layers=0, reuse_rows="off")
    shed = memory.plan(model, BF16, replace(work, prefill_chunk=256), most_shed, budget)
    assert streaming.run_bytes(found) <= streaming.run_bytes(shed) * (1 + streaming.TOLERANCE)
    asked = RuntimeConfig(policy=policy, streamed_layers=n + 3)  # a count asked for is kept, not varied
    kept = memory.plan(model, BF16, work, asked, budget)
    assert kept.config.streamed_layers == n + 3 and not any(s.startswith("weights") for s in kept.shed)


def test_the_last_resort_keeps_the_most_asked_setting_of_about_the_fewest_bytes():
    """``streaming.least_moved``: each candidate at the fewest streamed layers with which it fits (bisected),
    the fewest bytes over the run (a small chunk streams every layer once per forward; a later chunk re-reads
    half the pool), the most asked of those within the tolerance, None where nothing fits fully streamed."""
    need = {"whole": 10, "halves": 10, "tiny chunks": 8, "never": 99}  # the streamed layers each needs to fit
    chunks = {"whole": 64, "halves": 32, "tiny chunks": 1, "never": 64}
    calls = []

    def planned(name: str, n: int):
        calls.append(name)
        work = memory.Workload(1, 64, new_tokens=100, prefill_chunk=chunks[name])
        return SimpleNamespace(
            name=name,
            fits=n >= need[name],
            workload=work,
            config=RuntimeConfig(streamed_layers=n),
            model=SimpleNamespace(layer_bytes=1),
            parts=[memory.Part("CPU KV pool", "host", 4)],
        )

    # whole: 10 layers x (1 forward + 100 steps) = 1,010 bytes; halves 10 x 102 + 4 // 2 = 1,022 (1.2% more);
    # tiny chunks: 8 x (64 + 100) + 4 x 63 // 2 = 1,438
    found = streaming.least_moved([("tiny chunks",), ("never",), ("whole",)], planned, 32)
    assert (found.name, found.config.streamed_layers, streaming.run_bytes(found)) == ("whole", 10, 1010)
    assert calls.count("whole") <= 8  # a bisection, not a walk over 32 counts
    assert streaming.least_moved([("halves",), ("whole",)], planned, 32).name == "halves"
    assert streaming.run_bytes(streaming.least_moved([("tiny chunks",)], planned, 32)) == 1438
    assert streaming.least_moved([("never",)], planned, 32) is None


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_a_loaded_model_plans_its_streamed_layers_as_its_config_does(arch):
    """``plan_for`` (bench's and eval's runs of a loaded model) counts a streamed layer's slot from the
    loaded layers, as ``model_of`` does from the config: a run that streams layers is planned without
    their weights on the GPU, the slots held instead."""
    model = tiny_model(arch).to(torch.bfloat16)
    from_config = memory.model_of(model.config, BF16)
    assert memory.loaded_model(model).layer_bytes == from_config.layer_bytes > 0
    work, settings = memory.Workload(1, 64, 8), RuntimeConfig(streamed_layers=2)
    assert parts(memory.plan_for(model, settings, work, None)) == parts(
        memory.plan(from_config, BF16, work, settings, None)
    )
