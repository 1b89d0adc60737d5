"""``bench --profile``: what it reads off the profiler's kernels and the allocation history."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import invoke

from infinigen.bench.profiles import allocation_site, kernel_rows, memory_report, timeline


def kernel(name: str, stream: int, ts: float, dur: float) -> dict:
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def three_steps() -> list[dict]:
    """Three 100-us steps: per step two gathers on stream 7 (at +10 and +40, 20 us each), a selection
    kernel on stream 9, a matmul on stream 1."""
    events = []
    for s in range(3):
        t = 100.0 * s
        events += [kernel("_gather_kernel", 7, t + 10, 20), kernel("_gather_kernel", 7, t + 40, 20)]
        events += [kernel("_histogram_kernel", 9, t + 5, 4), kernel("gemm", 1, t, 90)]
    return events


def test_timeline_finds_the_transfer_streams_gaps_and_roles():
    report = timeline(three_steps(), steps=3)
    assert report["gathers_per_step"] == 2
    # step 1: the last gather of step 0 ends at 60, the first of step 1 starts at 110; between them 20 us
    assert report["steps"] == [
        {"step": 1, "boundary_ms": 0.05, "gaps_inside_ms": 0.01, "gathers_ms": 0.04},
        {"step": 2, "boundary_ms": 0.05, "gaps_inside_ms": 0.01, "gathers_ms": 0.04},
    ]
    roles = {row["stream"]: (row["role"], row["kernels_per_step"], row["ms_per_step"]) for row in report["streams"]}
    assert roles == {7: ("transfer", 2, 0.04), 9: ("selection", 1, 0.004), 1: ("compute", 1, 0.09)}


def test_timeline_without_row_gathers_has_no_steps():
    events = [e for e in three_steps() if e["name"] != "_gather_kernel"]
    report = timeline(events, steps=3)
    assert report["gathers_per_step"] == 0 and report["steps"] == []
    assert {row["role"] for row in report["streams"]} == {"selection", "compute"}


def test_kernel_rows_by_time_a_step():
    rows = kernel_rows(three_steps(), steps=3)
    assert [r["kernel"] for r in rows] == ["gemm", "_gather_kernel", "_histogram_kernel"]
    assert rows[1] == {"kernel": "_gather_kernel", "ms_per_step": 0.04, "calls_per_step": 2}


def test_memory_report_groups_live_blocks_by_the_packages_line():
    frame = {"filename": "/site/infinigen/runtime/memory/reuse.py", "line": 40, "name": "grow"}
    outside = {"filename": "/site/torch/nn/functional.py", "line": 7, "name": "linear"}
    bench = {"filename": "/site/infinigen/bench/runs.py", "line": 3, "name": "forward"}
    blocks = [
        {"state": "active_allocated", "size": 3_000_000, "frames": [bench, frame]},
        {"state": "active_allocated", "size": 1_000_000, "frames": [frame]},
        {"state": "inactive", "size": 9_000_000, "frames": [frame]},  # freed: not held
        {"state": "active_allocated", "size": 2_000_000, "frames": [outside]},
        {"state": "active_allocated", "size": 5_000_000},  # before the history started (the weights)
    ]
    report = memory_report({"segments": [{"blocks": blocks}]}, live=6_000_000, peak=8_000_000, dense_kv=40_000_000)
    assert report["live_share_of_dense_kv"] == 0.15 and report["peak_gb"] == 0.008
    assert report["sites"] == [
        {"site": "runtime/memory/reuse.py:40 grow", "mb": 4.0, "share_of_dense_kv": 0.1},
        {"site": "elsewhere: functional.py:7", "mb": 2.0, "share_of_dense_kv": 0.05},
    ]
    assert allocation_site([bench]) == "elsewhere: runs.py:3"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_profiles_a_case_on_cuda():
    args = "--shape tiny-llama --device cuda --sizes 2x512 --gen-len 2 --policy dense,infinigen --budget 0.2"
    result = invoke("bench", *args.split(), "--profile", "kernels,timeline,memory", "--json")
    assert result.exit_code == 0, result.output
    profiles = {row["policy"]: row for row in json.loads(result.stdout)["profiles"]}
    assert set(profiles) == {"dense", "infinigen"}
    ours = profiles["infinigen"]
    assert ours["kernels"] and ours["timeline"]["gathers_per_step"] > 0
    assert {row["role"] for row in ours["timeline"]["streams"]} >= {"compute", "transfer"}
    assert profiles["dense"]["timeline"]["gathers_per_step"] == 0
    assert 0 < ours["memory"]["live_gb"] <= ours["memory"]["peak_gb"]
    assert any(site["site"].startswith("runtime/") for site in ours["memory"]["sites"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_profile_runs_its_case_as_the_plan_has_it():
    """Under a GPU budget the plan halves this case's prefill chunk: its profile runs it so too (its plan, its
    chunk), where the case as asked would prefill a chunk the budget cannot hold (one line: does not fit)."""
    args = "--shape tiny-llama --device cuda --sizes 4x8192 --gen-len 2 --policy infinigen --gpu-memory-gb 0.81"
    result = invoke("bench", *args.split(), "--profile", "kernels", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["results"][0]["given_up"] == "prefill chunk: 2048 tokens"
    [profile] = report["profiles"]
    assert "error" not in profile and profile["kernels"]
