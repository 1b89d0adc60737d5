"""``infinigen bench`` through typer's test runner: sweeps, breakdowns, real weights, plots."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import invoke
from rich.console import Console
from typer.testing import CliRunner

import infinigen.bench.runs
from infinigen.cli import app, render

runner = CliRunner()


def bench(args: str):
    return invoke("bench", *["--shape", "tiny-llama", "--device", "cpu", "--dtype", "float32"], *args.split())


def strict_json(text: str):
    """A --json report, refusing NaN and infinities (not JSON: other tools reject them)."""

    def refuse(constant: str):
        raise ValueError(f"{constant} in a JSON report")

    return json.loads(text, parse_constant=refuse)


def test_bench_tiny_on_cpu(monkeypatch):
    """A tiny benchmark run produces one row per policy and budget (no timing assertions)."""
    result = bench(
        "--batch 2 --prompt-len 64 --gen-len 2 --policies dense,full,infinigen --budgets 0.2,0.5 --breakdown --json"
    )
    assert result.exit_code == 0, result.output
    report = strict_json(result.stdout)
    assert report["pinned_h2d_gb_s"] is None  # no host->device link on CPU
    assert report["matmul_tflop_s"] > 0 and report["device_gb_s"] > 0  # the CPU's own
    for row in report["results"]:  # bound by the CPU's work: nothing crosses a link
        assert row["step_bus_ms"] == 0 and row["step_bound_ms"] == row["step_compute_ms"] > 0
        assert row["step_over_bound"] == pytest.approx(row["ms_per_step"] / row["step_bound_ms"], rel=0.01)
        assert row["prefill_tflop_s"] > 0
    splits = [(b["policy"], b["budget"], b["batch"], b["prompt_len"]) for b in report["breakdown"]]
    assert splits == [("full", None, 2, 64), ("infinigen", 0.2, 2, 64), ("infinigen", 0.5, 2, 64)]  # as the results
    assert all(b["compute_only_ms"] > 0 and b["transfer_only_ms"] > 0 for b in report["breakdown"])
    assert all(b["without_selection_ms"] > 0 and b["selection_share"] < 1 for b in report["breakdown"])
    for b in report["breakdown"]:  # the step's saving without selecting, per offloaded layer (2 of 4 here)
        saving = b["step_ms"] - b["without_selection_ms"]  # both rounded to 0.01 ms
        assert b["selection_ms_per_layer"] == pytest.approx(saving / 2, abs=0.006)
    rows = {(r["policy"], r["budget"]): r for r in report["results"]}
    assert set(rows) == {("dense", None), ("full", None), ("infinigen", 0.2), ("infinigen", 0.5)}
    assert rows[("full", None)]["fraction_fetched"] == 1.0
    assert 0 < rows[("infinigen", 0.2)]["fraction_fetched"] < rows[("infinigen", 0.5)]["fraction_fetched"] <= 0.51
    progress = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert progress == report["results"]  # each row on stderr as it finishes: a cut-off run keeps them
    monkeypatch.setattr(render, "console", Console(width=400))  # no cell folded over lines
    table = bench("--batch 1 --prompt-len 32 --gen-len 1 --policies full")
    assert table.exit_code == 0 and "tiny-llama float32 on cpu" in table.stdout
    assert "ms/step" in table.stdout and "peak GPU GB" not in table.stdout  # no GPU: its column left out


def test_bench_sweeps_and_plots(tmp_path):
    plot = tmp_path / "bench.png"
    result = bench(f"--batch 1,2 --prompt-len 32,48 --gen-len 1 --policies full,h2o,int4 --plot {plot} --json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["results"]
    assert sorted({(r["batch"], r["prompt_len"]) for r in rows}) == [(1, 32), (1, 48), (2, 32), (2, 48)]
    assert len(rows) == 12 and plot.read_bytes()[:4] == b"\x89PNG"
    replot = tmp_path / "again.png"
    report = tmp_path / "report.json"
    report.write_text(result.stdout)
    assert invoke("plot", str(report), "--out", str(replot)).exit_code == 0 and replot.exists()


def test_bench_real_model_with_its_artifact_text_and_repeats(checkpoint, tmp_path):
    """--model runs real weights with their artifact (the budget alone sets the count; an alpha given
    is reported per row), on prompts cut from --text; --repeat keeps the median of its runs."""
    from infinigen.bench.runs import prompt_ids

    folder, out, text = checkpoint("qwen2"), tmp_path / "skewed", tmp_path / "book.txt"
    assert invoke("prepare", str(folder), "--out", str(out), "--tokens", "64", "--device", "cpu").exit_code == 0
    text.write_text("the old house on the corner of the street stood there for a hundred years " * 20)
    args = ["bench", "--model", str(folder), "--artifact", str(out), "--text", str(text), "--device", "cpu"]
    args += ["--dtype", "float32", "--batch", "2", "--prompt-len", "48", "--gen-len", "2", "--repeat", "3"]
    result = invoke(*args, "--policies", "dense,infinigen", "--budgets", "0.5", "--json")
    assert result.exit_code == 0, result.output
    report = strict_json(result.stdout)
    assert report["model"] == str(folder) and report["shape"] is None
    dense, infinigen = report["results"]
    assert dense["alpha"] is None and infinigen["alpha"] is None
    assert 0.5 <= infinigen["fraction_fetched"] <= 0.5 + 1 / 48
    runs = infinigen["ms_per_step_runs"]
    assert len(runs) == 3 and runs == sorted(runs) and infinigen["ms_per_step"] == runs[1]
    assert len(infinigen["prefill_s_runs"]) == 3 and infinigen["prefill_s"] in infinigen["prefill_s_runs"]
    # the prompts: consecutive slices of the text, row after row, wrapping where it is short
    ids = torch.arange(5)
    assert prompt_ids(2, 3, 99, ids).tolist() == [[0, 1, 2], [3, 4, 0]]
    assert prompt_ids(2, 3, 99).tolist() == prompt_ids(2, 3, 99).tolist()  # random, seeded
    given = invoke(*args, "--policies", "infinigen", "--budgets", "0.5", "--alpha", "4", "--repeat", "1", "--json")
    assert given.exit_code == 0 and strict_json(given.stdout)["results"][0]["alpha"] == 4


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("--shape tiny-llama --text book.txt", "--artifact and --text go with --model"),
        ("--model {folder} --ratio 0.3", "with --model the artifact sets it"),
        ("--model {folder} --policies infinigen", "speculating policies need the model's artifact"),
        ("--shape tiny-llama --repeat 0", "--repeat and --gen-len must be at least 1"),
        (
            "--shape tiny-llama --sizes 2x",
            "--sizes takes comma-separated BATCHxCONTEXT pairs (8x16384, autox1920), got '2x'",
        ),
        ("--model {folder} --layers 2", "--layers goes with --shape"),
        ("--shape tiny-llama --layers 1", "--layers must be at least 2, got 1"),
        ("--shape tiny-llama --reserve-host-gb -1", "--reserve-host-gb must be at least 0, got -1.0"),
        ("--shape tiny-llama --profile timeline", "--profile needs a CUDA device"),
        (
            "--shape tiny-llama --profile disk",
            "--profile takes kernels, timeline, memory (comma-separated), got 'disk'",
        ),
    ],
)
def test_bench_refuses_bad_combinations(checkpoint, args, message):
    folder = checkpoint("llama")
    argv = ["bench", *args.format(folder=folder).split(), "--device", "cpu", "--dtype", "float32"]
    result = runner.invoke(app, [*argv, "--prompt-len", "32", "--gen-len", "1"])
    assert result.exit_code != 0 and message in " ".join(result.output.split())


def test_bench_sizes_pairs_fewer_layers_and_a_baseline_that_refuses():
    """--sizes runs each batch x context pair, not their product; --layers builds that many layers of
    the shape's size; transformers' offloaded cache, which needs CUDA, gives its error as its row."""
    result = bench("--sizes 2x48,1x64 --layers 3 --gen-len 1 --policies full,hf-offloaded --json")
    assert result.exit_code == 0, result.output
    report = strict_json(result.stdout)
    assert report["layers"] == 3
    rows = report["results"]
    assert [(r["policy"], r["batch"], r["prompt_len"]) for r in rows] == [
        ("full", 2, 48),
        ("hf-offloaded", 2, 48),
        ("full", 1, 64),
        ("hf-offloaded", 1, 64),
    ]
    assert all(r["ms_per_step"] > 0 and "error" not in r for r in rows[::2])
    assert all(r["error"] and "\n" not in r["error"] and "ms_per_step" not in r for r in rows[1::2])


def test_bench_hf_accelerate_runs_transformers_with_accelerates_offloading():
    """``hf-accelerate``: ``DynamicCache`` under accelerate's hooks (the weights it maps to the host brought in at
    each forward; without a budget, none): a row with its step time, and the model left as found for the
    cases after it."""
    result = bench("--batch 1 --prompt-len 32 --layers 3 --gen-len 1 --policies hf-accelerate,dense --json")
    assert result.exit_code == 0, result.output
    rows = {r["policy"]: r for r in strict_json(result.stdout)["results"]}
    assert rows["hf-accelerate"]["ms_per_step"] > 0 and rows["hf-accelerate"]["accelerate_host_modules"] == 0
    assert rows["dense"]["ms_per_step"] > 0 and "error" not in rows["dense"]


def test_bench_hf_accelerate_offloaded_puts_transformers_offloaded_cache_under_accelerates_offloading(monkeypatch):
    """``hf-accelerate-offloaded``: accelerate's weight offloading with ``DynamicCache(offloading=True)``, which
    needs CUDA: on the CPU its error is its row, and the model is left as found for the case after it; its KV
    in host memory is checked against the host's, as ``hf-offloaded``'s."""
    policies = "--policies hf-accelerate-offloaded,dense --json"
    result = bench(f"--batch 1 --prompt-len 32 --layers 3 --gen-len 1 {policies}")
    assert result.exit_code == 0, result.output
    rows = {r["policy"]: r for r in strict_json(result.stdout)["results"]}
    offloaded = rows["hf-accelerate-offloaded"]
    assert offloaded["error"] and "\n" not in offloaded["error"] and "ms_per_step" not in offloaded
    assert rows["dense"]["ms_per_step"] > 0 and "error" not in rows["dense"]
    from infinigen.runtime.memory import plan as memory

    monkeypatch.setattr(memory, "host_available_bytes", lambda: 1000)
    result = bench(f"--batch 1 --prompt-len 32 --layers 3 --gen-len 1 {policies}")
    error = json.loads(result.stdout)["results"][0]["error"]
    assert error.startswith("does not fit in host memory: its KV needs"), error


def test_bench_baselines_and_cases_over_the_hosts_memory_are_rows(monkeypatch):
    """A case whose KV would not fit in the host memory available (ours: its CPU pool; transformers'
    offloaded cache: its host KV) is an error row, not a process the host's out-of-memory killer ends."""
    from infinigen.runtime.memory import plan as memory

    monkeypatch.setattr(memory, "host_available_bytes", lambda: 1000)
    result = bench("--batch 1 --prompt-len 32 --layers 3 --gen-len 1 --policies dense,full,hf-offloaded --json")
    assert result.exit_code == 0, result.output
    rows = {r["policy"]: r for r in json.loads(result.stdout)["results"]}
    assert rows["dense"]["ms_per_step"] > 0  # no CPU pool
    assert rows["full"]["error"].startswith("does not fit in host memory: 1 x 32 tokens")
    assert rows["hf-offloaded"]["error"].startswith("does not fit in host memory: its KV needs")


def test_bench_runtime_sweeps_multiply_only_the_policies_they_change():
    args = "--batch 1 --prompt-len 32 --gen-len 1 --policies dense,full,infinigen --budgets 0.5"
    sweeps = "--ratio 0.3,0.5 --partial-key-bits 8,16 --lookahead-from input,attention --attention-lookahead-layers 0,1"
    result = bench(f"{args} {sweeps} --json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["results"]
    fields = ("policy", "ratio", "partial_key_bits", "lookahead_from", "attention_lookahead_layers")
    keys = [tuple(r[f] for f in fields) for r in rows]
    lookahead = [(s, n) for s in ("input", "attention") for n in (0, 1)]
    assert keys[:5] == [("dense", None, None, None, None)] + [("full", None, None, s, n) for s, n in lookahead]
    assert sorted(keys[5:]) == sorted(
        ("infinigen", r, b, s, n) for r in (0.3, 0.5) for b in (8, 16) for s, n in lookahead
    )
    assert all(r["fraction_fetched"] == rows[-1]["fraction_fetched"] for r in rows[5:])


def test_bench_row_reuse_sweep():
    """--reuse-rows off,on runs budgeted policies both ways: the same fraction attended, fewer bytes
    moved with reuse; other policies once."""
    result = bench(
        "--batch 2 --prompt-len 96 --gen-len 4 --policies full,infinigen,h2o --budgets 0.3 --reuse-rows off,on --json"
    )
    assert result.exit_code == 0, result.output
    rows = {(r["policy"], r["reuse_rows"]): r for r in json.loads(result.stdout)["results"]}
    assert set(rows) == {("full", None), ("infinigen", "off"), ("infinigen", "on"), ("h2o", "off"), ("h2o", "on")}
    assert rows["full", None]["reuse"] is None and rows["h2o", "on"]["reuse"] == "on (asked)"
    for policy in ("infinigen", "h2o"):
        plain, reusing = rows[policy, "off"], rows[policy, "on"]
        assert reusing["fraction_fetched"] == pytest.approx(plain["fraction_fetched"], abs=1e-3)
        assert reusing["h2d_mb_per_step"] < plain["h2d_mb_per_step"]
    wrong = bench("--batch 1 --prompt-len 32 --gen-len 1 --policies infinigen --reuse-rows maybe")
    assert wrong.exit_code != 0 and "--reuse-rows takes auto, on, off" in wrong.output


def test_bench_graphs_sweep_covers_our_caches_only():
    args = "--batch 1 --prompt-len 32 --gen-len 2 --policies hf-dynamic,full --graphs step,selection,off --json"
    result = bench(args)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["results"]
    assert [(r["policy"], r["graphs"]) for r in rows] == [
        ("hf-dynamic", None),
        ("full", "step"),
        ("full", "selection"),
        ("full", "off"),
    ]
    assert len({r["fraction_fetched"] for r in rows[1:]}) == 1
    wrong = bench("--batch 1 --prompt-len 32 --gen-len 1 --policies full --graphs whole")
    assert wrong.exit_code != 0 and "--graphs takes step, selection, off" in wrong.output


def test_bench_micro_on_cpu(tmp_path):
    plot = tmp_path / "micro.png"
    result = bench(f"--micro --micro-contexts 64,128 --plot {plot} --json")
    assert result.exit_code == 0, result.output
    report = strict_json(result.stdout)
    assert report["pinned_h2d_gb_s"] is None  # no pinned copy to compare with on CPU
    assert all(r["share_of_bulk"] is None for r in report["gather"])
    assert [(r["context"], r["fraction"]) for r in report["gather"][:2]] == [(64, 0.01), (64, 0.02)]
    assert len(report["gather"]) == 10 and all(r["ms"] > 0 and r["bytes"] > 0 for r in report["gather"])
    assert [r["context"] for r in report["speculation"]] == [64, 128]
    assert all(r["speculation_ms"] > 0 and r["dense_layer_ms"] > 0 for r in report["speculation"])
    assert plot.read_bytes()[:4] == b"\x89PNG"
    saved, replot = tmp_path / "micro.json", tmp_path / "again.png"
    saved.write_text(result.stdout)
    assert invoke("plot", str(saved), "--out", str(replot)).exit_code == 0 and replot.read_bytes()[:4] == b"\x89PNG"


def test_bench_goes_on_past_a_case_that_does_not_fit(monkeypatch):
    """A sweep reaches sizes where dense decoding does not fit the GPU: that case becomes a row with
    its error, and the cases after it still run."""
    real_run_case = infinigen.bench.runs.run_case

    def run_case(model, artifact, case, text_ids=None):
        if case.policy == "dense" and case.batch == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")
        return real_run_case(model, artifact, case, text_ids)

    monkeypatch.setattr(infinigen.bench.runs, "run_case", run_case)
    result = bench("--batch 1,2 --prompt-len 32 --gen-len 1 --policies dense,full --breakdown --json")
    assert result.exit_code == 0, result.output
    report = strict_json(result.stdout)
    rows = {(r["policy"], r["batch"]): r for r in report["results"]}
    assert rows[("dense", 2)]["error"] == "out of GPU memory allocating 64.00 GiB"
    assert "ms_per_step" not in rows[("dense", 2)]
    assert all("error" not in row and row["ms_per_step"] > 0 for key, row in rows.items() if key != ("dense", 2))
    assert [b["batch"] for b in report["breakdown"]] == [1, 2]  # full's breakdown at both batches
    monkeypatch.setattr(render, "console", Console(width=400))  # no cell folded over lines
    table = bench("--batch 2 --prompt-len 32 --gen-len 1 --policies full,dense")
    assert table.exit_code == 0 and "out of GPU memory" in table.stdout


def test_the_warm_up_runs_the_first_case_the_plan_accepts_ours_first(monkeypatch):
    """The untimed warm-up (a process's one-time work) takes the first case the plan accepts, ours before
    transformers' caches: a refused first case must not leave the next one paying it in its timed run."""
    import infinigen.bench.sweep

    ran, real_run_case, real_planned = [], infinigen.bench.runs.run_case, infinigen.bench.sweep.planned_case

    def run_case(model, artifact, case, text_ids=None):
        ran.append((case.policy, case.gen_len))
        return real_run_case(model, artifact, case, text_ids)

    def planned_case(model, case, budget):
        if case.policy == "dense":
            return case, {"policy": "dense", "error": "does not fit"}, {}
        return real_planned(model, case, budget)

    monkeypatch.setattr(infinigen.bench.runs, "run_case", run_case)
    monkeypatch.setattr(infinigen.bench.sweep, "planned_case", planned_case)
    result = bench("--batch 1 --prompt-len 32 --gen-len 3 --policies dense,hf-dynamic,full --json")
    assert result.exit_code == 0, result.output
    assert ran == [("full", 2), ("hf-dynamic", 3), ("full", 3)]  # the warm-up, then the sweep's order
    assert strict_json(result.stdout)["results"][0]["error"] == "does not fit"


def test_bench_plot_picks_the_sweeps_of_a_joined_report():
    """A context sweep at batch 1 joined with a batch sweep at 8K plots both sweeps."""
    from infinigen.bench.plots import widest_sweep

    rows = [{"batch": 1, "prompt_len": n} for n in (8192, 32768, 131072)]
    rows += [{"batch": b, "prompt_len": 8192} for b in (4, 8, 16, 32)]
    assert widest_sweep(rows, "batch", "prompt_len") == 1
    assert widest_sweep(rows, "prompt_len", "batch") == 8192


def test_bench_sweeps_kv_bits_and_reports_the_bytes_moved():
    """``--kv-bits 16,8``: a row per format for the offloading policies (one for dense), 8-bit rows
    moving head_dim bytes per K or V where float32 rows move 4 * head_dim (tiny-llama: 16)."""
    result = bench("--batch 1 --prompt-len 256 --gen-len 2 --policies dense,full --kv-bits 16,8 --json")
    assert result.exit_code == 0, result.output
    rows = strict_json(result.stdout)["results"]
    assert [(r["policy"], r.get("kv_bits")) for r in rows] == [("dense", None), ("full", 16), ("full", 8)]
    assert rows[2]["h2d_mb_per_step"] == pytest.approx(rows[1]["h2d_mb_per_step"] * 16 / 64, abs=1e-3)  # MB, 3 places
    micro = strict_json(bench("--micro --micro-contexts 64 --kv-bits 16,8 --json").stdout)["gather"]
    assert [r["kv_bits"] for r in micro] == [16] * 5 + [8] * 5
    assert [r["bytes"] * 16 for r in micro[:5]] == [r["bytes"] * 64 for r in micro[5:]]


def test_bench_counts_a_steps_bytes_alone_and_bounds_the_step():
    """``h2d_mb_per_step`` is the decode steps' own (a chunked prefill's re-reads of earlier chunks apart):
    ``full`` moves every cached row of its 2 offloaded layers, 2 KV heads of 128-byte float32 rows, at 256 to
    260 cached tokens over its 5 steps; the step's bound is those bytes and the streamed weights' at the
    link's rate, or the device work where that is longer (``bench.bounds``)."""
    from infinigen.bench.bounds import ChipRates, with_bound

    for chunk in ("64", "0"):
        result = bench(
            f"--batch 1 --prompt-len 256 --gen-len 2 --policies full --kv-bits 16 --prefill-chunk {chunk} --json"
        )
        row = strict_json(result.stdout)["results"][0]
        assert row["h2d_mb_per_step"] == pytest.approx(2 * 2 * 128 * 258 / 1e6, abs=1e-3)
        assert row["kv_bits"] == row["kv_bits_applied"] == 16
    row = {"ms_per_step": 30.0, "device_mb_per_step": 100.0, "step_gflop": 1.0, "prefill_tflop": 2.0, "prefill_s": 4.0}
    crossing = {"h2d_mb_per_step": 500.0, "streamed_weights_mb_per_step": 500.0}
    bounded = with_bound(row | crossing, ChipRates(matmul_tflop_s=100.0, memory_gb_s=1000.0, bus_gb_s=50.0))
    assert bounded["step_compute_ms"] == 0.1 and bounded["step_bus_ms"] == 20.0  # 100 MB at 1,000 GB/s; 1 GB at 50
    assert bounded["step_bound_ms"] == 20.0 and bounded["step_over_bound"] == 1.5 and bounded["prefill_tflop_s"] == 0.5
    computing = with_bound(row | crossing, ChipRates(matmul_tflop_s=0.5, memory_gb_s=10.0, bus_gb_s=None))
    assert computing["step_bound_ms"] == 10.0 and computing["step_over_bound"] == 3.0  # the reads, not the 2 ms of FLOP
    assert with_bound({"error": "out of memory"}, ChipRates(1.0, 1.0, 1.0)) == {"error": "out of memory"}


def test_the_bounds_arithmetic_by_hand():
    """A tiny Llama (hidden 64, 4 layers, 4 heads of 16, 2 KV heads, MLP 128, vocab 512, untied), bf16: 148,032
    decoder weights (layers 4 x 36,992, the final norm 64) besides the embedding table and the head (32,768 each)."""
    from transformers import AutoConfig

    from infinigen.bench.bounds import _causal_pairs, prefill_flop, step_work
    from infinigen.runtime.memory import plan as memory

    config = AutoConfig.for_model(
        "llama", hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=512, tie_word_embeddings=False,
    )  # fmt: skip
    model = memory.model_of(config, torch.bfloat16)
    assert model.weight_bytes == 2 * (148_032 + 2 * 32_768)
    # 2 rows at 100 tokens, layer 0 dense, 3 offloaded attending a quarter: 100 + 3 x 25 keys a row
    work = step_work(model, torch.bfloat16, batch=2, tokens=100, dense_layers=1, fraction=0.25)
    read = 2 * (148_032 + 32_768) + 2 * 175 * 2 * 16 * 2 * 2  # weights but the table; K and V of 2 heads of 16
    flop = 2 * 2 * (148_032 + 32_768) + 4 * 2 * 175 * 4 * 16  # every weight and the head; q·k, p·v of 4 heads
    assert work == pytest.approx({"device_mb_per_step": read / 1e6, "step_gflop": flop / 1e9})
    every = step_work(model, torch.bfloat16, batch=2, tokens=100, dense_layers=None, fraction=0.25)
    assert every["device_mb_per_step"] == pytest.approx((2 * 180_800 + 2 * 400 * 2 * 16 * 2 * 2) / 1e6)  # all KV
    causal = 4 * 2 * (4 * 5050) * 4 * 16  # 100 x 101 / 2 pairs a layer
    assert prefill_flop(model, torch.bfloat16, 2, 100) == pytest.approx(2 * 2 * 100 * 148_032 + causal + 2 * 2 * 32_768)
    assert _causal_pairs(10, 4) == 1 + 2 + 3 + 4 * 7 and _causal_pairs(3, 4) == 6


def test_bench_reserves_host_memory_before_its_cases(monkeypatch):
    """--reserve-host-gb pins while the model loads and is ready before the first case: the pools'
    blocks are carved from it (the reservation is this test's own)."""
    from infinigen.runtime.memory import host_memory

    monkeypatch.setattr(host_memory, "_reserved", host_memory.defaultdict(list))
    carved = []
    carve = host_memory._carve
    monkeypatch.setattr(host_memory, "_carve", lambda *args: carved.append(carve(*args)) or carved[-1])
    result = bench("--batch 1 --prompt-len 64 --gen-len 1 --policies infinigen --reserve-host-gb 0.01 --json")
    assert result.exit_code == 0, result.output
    report = strict_json(result.stdout)
    assert report["host_reserve_gb"] == 0.01 and report["host_reserved_s"] >= report["load_s"] >= 0
    assert carved and all(block is not None for block in carved)
