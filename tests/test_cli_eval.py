"""``infinigen eval``: perplexity, tasks, needles and compare from the command line, and their --output."""

from __future__ import annotations

import json

import pytest
from conftest import invoke

from infinigen.runtime.memory.plan import CUBLAS_WORKSPACE


def test_eval_ppl(prepared, tmp_path):
    folder, out = prepared("llama")
    text = tmp_path / "text.txt"
    text.write_text("the house was old and the street was narrow and the walls were thin " * 30)
    args = f"eval ppl {folder} --artifact {out} --text {text} --window 64 --prefix 32 --windows 3 --batch 2"
    result = invoke(*args.split(), "--budgets", "0.5", "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [(r["policy"], r["budget"]) for r in report["results"]] == [("dense", None), ("infinigen", 0.5)]
    assert report["windows"] == 3 and all(r["tokens_scored"] == 3 * 32 for r in report["results"])
    progress = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert progress == report["results"]  # each row on stderr as it finishes
    bad = invoke(*args.split(), "--prefix", "64", "--device", "cpu")
    assert bad.exit_code == 2 and "--prefix must be in" in bad.output
    auto = invoke(*args.replace("--batch 2", "--batch 0").split(), "--budgets", "0.5", "--device", "cpu", "--json")
    rows = json.loads(auto.stdout)["results"]  # off a GPU without a budget: every window in one batch
    assert [r["batch"] for r in rows] == [3, 3] and [r["batch"] for r in report["results"]] == [2, 2]
    assert [r["perplexity"] for r in rows] == pytest.approx([r["perplexity"] for r in report["results"]], rel=1e-4)


def test_eval_output_keeps_finished_settings_and_a_rerun_runs_only_the_missing(prepared, tmp_path, monkeypatch):
    """``eval ... --output``: each setting's row lands in the file as it finishes; a rerun with more
    settings runs only the new ones (the others read back, the same report), a row cut while written is
    dropped and run again, and a file of another run or of something else is refused in one line, unchanged."""
    import infinigen.eval.perplexity as perplexity_module

    folder, out = prepared("llama")
    text = tmp_path / "text.txt"
    text.write_text("the house was old and the street was narrow and the walls were thin " * 30)
    rows = tmp_path / "rows.jsonl"
    args = f"eval ppl {folder} --artifact {out} --text {text} --window 64 --prefix 32 --windows 2 --batch 2"
    args += f" --device cpu --json --output {rows}"
    first = invoke(*args.split(), "--policy", "dense")
    assert first.exit_code == 0, first.output
    assert len(rows.read_text().splitlines()) == 2  # the run, then dense's row
    ran = []
    real = perplexity_module.perplexity
    monkeypatch.setattr(perplexity_module, "perplexity", lambda *a, **k: ran.append(k["policy"]) or real(*a, **k))
    second = invoke(*args.split(), "--policy", "dense,infinigen", "--budget", "0.5")
    assert second.exit_code == 0, second.output and ran == ["infinigen"]
    report = json.loads(second.stdout)
    assert report["results"][0] == json.loads(first.stdout)["results"][0]  # read back, not rerun
    with open(rows, "a") as file:
        file.write('{"settings": {"policy": "full"')  # killed while writing
    third = invoke(*args.split(), "--policy", "dense,infinigen,full", "--budget", "0.5")
    assert third.exit_code == 0, third.output
    assert ran == ["infinigen", "full"] and len(rows.read_text().splitlines()) == 4
    before = rows.read_bytes()
    other = invoke(*args.split(), "--policy", "dense", "--windows", "3")
    assert other.exit_code == 2 and "holds the rows of another run (it differs in windows)" in other.output
    assert len(other.output.strip().splitlines()) == 1 and rows.read_bytes() == before
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"id": 1, "text": "a batch job\'s row"}\n')
    refused = invoke(*args.replace(str(rows), str(foreign)).split(), "--policy", "dense")
    assert refused.exit_code == 2 and "is not an evaluation's --output" in refused.output


def test_eval_tasks_jsonl(prepared, tmp_path, monkeypatch):
    folder, out = prepared("llama")
    data = tmp_path / "toy.jsonl"
    rows = [
        {"context": f"the house was old and the street {i}", "choices": [" was", " the"], "label": i % 2}
        for i in range(4)
    ]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(row) + "\n" for row in rows[:3]))
    args = f"eval tasks {folder} --artifact {out} --data {data} --shots 2 --limit 3 --budgets 0.5,1 --kv-bits 16"
    args += " --device cpu"
    result = invoke(*args.split(), "--data", str(other), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert all(set(r["tasks"]) == {"toy", "other"} for r in report["results"])
    assert [(r["policy"], r["budget"]) for r in report["results"]] == [
        ("dense", None),
        ("infinigen", 0.5),
        ("infinigen", 1.0),
    ]
    toy = [r["tasks"]["toy"] for r in report["results"]]
    assert all(t["examples"] == 3 and 0 <= t["acc"] <= 1 for t in toy) and toy[0]["acc"] == toy[2]["acc"]
    assert all(len(t["hits"]) == 3 and t["hits"].count("1") / 3 == pytest.approx(t["acc"], abs=1e-4) for t in toy)
    assert toy[0]["hits"] == toy[2]["hits"]  # dense and infinigen at budget 1: the same examples right
    assert "paired" not in report["results"][0]  # the first row is the reference of the others
    progress = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    expected = [(r["policy"], name, r["tasks"][name]["hits"]) for r in report["results"] for name in ("toy", "other")]
    assert [(p["policy"], p["task"], p["hits"]) for p in progress] == expected  # a cut-off run keeps them
    same = report["results"][2]["paired"]
    assert same["reference"] == {"policy": "dense", "budget": None} and same["tasks"]["toy"]["difference"] == 0
    assert same["all_examples"] == {"difference": 0.0, "standard_error": 0.0, "better": 0, "worse": 0}
    assert report["results"][1]["average"]["fraction_fetched"] == toy[1]["fraction_fetched"] > 0
    assert toy[1]["fraction_bytes"] == toy[1]["fraction_fetched"]  # infinigen moves 16-bit rows
    for row, task in zip(report["results"], toy, strict=True):
        # the plan's cuBLAS workspaces (compute, capture and a speculating policy's selection streams); the
        # rest is each task's largest group's
        cublas = (3 if row["policy"] == "infinigen" else 2) * CUBLAS_WORKSPACE / 1e9
        assert cublas < task["memory_plan"]["planned_peak_gpu_gb"] < cublas + 0.01
    saved, png = tmp_path / "tasks.json", tmp_path / "tasks.png"
    saved.write_text(result.stdout)
    assert invoke("plot", str(saved), "--out", str(png)).exit_code == 0 and png.read_bytes()[:4] == b"\x89PNG"
    saved.write_text(json.dumps({"model": "x"}))
    not_a_report = invoke("plot", str(saved), "--out", str(png))
    assert not_a_report.exit_code == 2 and "is not a report" in not_a_report.output
    kept = ("--data", str(other), "--json", "--output", str(tmp_path / "tasks.jsonl"))
    assert invoke(*args.split(), *kept).exit_code == 0
    with monkeypatch.context() as scoring:  # the rerun reads every setting back: nothing is scored again
        scoring.setattr("infinigen.eval.tasks.task_accuracy", lambda *a, **k: pytest.fail("scored again"))
        again = invoke(*args.split(), *kept)
    assert again.exit_code == 0 and json.loads(again.stdout)["results"] == report["results"]
    table = invoke(*args.split()).stdout
    assert "Δ acc" in table and "+0.00 ±" in table  # infinigen at budget 1 against dense (80 columns wrap)
    assert "Δ acc" not in invoke(*args.split(), "--policies", "dense").stdout  # nothing to pair with
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    missing = invoke(*f"eval tasks {folder} --tasks copa --device cpu".split())
    assert missing.exit_code == 2 and "pip install" in missing.output and "Traceback" not in missing.output


def test_eval_needle(prepared, tmp_path, monkeypatch):
    folder, out = prepared("qwen3")
    text, other = tmp_path / "book.txt", tmp_path / "other.txt"
    text.write_text("The house was old. The street was narrow, and the walls were thin. " * 60)
    other.write_text("A boat came in. The sea was calm and grey. " * 40)
    args = f"eval needle {folder} --artifact {out} --text {text} --device cpu"
    asked = ("--lengths", "96,128", "--depths", "0,1", "--budgets", "0.5", "--trials", "2", "--json")
    result = invoke(*args.split(), *asked, "--output", str(tmp_path / "needle.jsonl"))
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    with monkeypatch.context() as answering:  # --output: a rerun reads every setting back
        answering.setattr("infinigen.eval.needle.needle_accuracy", lambda *a, **k: pytest.fail("answered again"))
        again = invoke(*args.split(), *asked, "--output", str(tmp_path / "needle.jsonl"))
    assert again.exit_code == 0 and json.loads(again.stdout)["results"] == report["results"]
    assert [(r["policy"], r["budget"]) for r in report["results"]] == [("dense", None), ("infinigen", 0.5)]
    assert all(len(r["cells"]) == 4 and len(r["answers"]) == 8 for r in report["results"])
    saved, png = tmp_path / "needle.json", tmp_path / "needle.png"
    saved.write_text(result.stdout)
    assert invoke("plot", str(saved), "--out", str(png)).exit_code == 0 and png.read_bytes()[:4] == b"\x89PNG"
    streamed = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    cell = ("length", "depth", "trial", "correct")
    assert sorted((a["policy"], *(a[k] for k in cell)) for a in streamed) == sorted(
        (r["policy"], *(a[k] for k in cell)) for r in report["results"] for a in r["answers"]
    )  # each answer on stderr as it comes (a passage's deepest needle first: kept prompts serve the next)
    few = invoke(*args.split(), "--lengths", "128", "--depths", "0", "--trials", "9", "--policies", "dense", "--json")
    more = invoke(*args.split(), "--text", str(other), "--lengths", "128", "--depths", "0", "--trials", "9", "--json")
    assert few.exit_code == 2 and "too few for 9 trials" in few.output
    assert more.exit_code == 0 and json.loads(more.stdout)["texts"] == [str(text), str(other)]
    table = " ".join(invoke(*args.split(), "--lengths", "96", "--depths", "0.5", "--policies", "full").stdout.split())
    assert "needle in" in table and "fraction fetched" in table and "cached" in table  # a title wraps
    batched = invoke(*args.split(), *asked[:-1], "--policies", "infinigen", "--batch", "0", "--json")
    (row,) = json.loads(batched.stdout)["results"]  # every prompt of a length at once: as one at a time
    assert batched.exit_code == 0 and row["batch"] == 4 and row["cells"] == report["results"][1]["cells"]
    negative = invoke(*args.split(), "--batch", "-1")
    assert negative.exit_code == 2 and "--batch >= 0" in negative.output
    too_long = invoke(*args.split(), "--lengths", "600")
    assert too_long.exit_code == 2 and "exceeds the model's context of 512" in too_long.output
    bad = invoke(*args.split(), "--depths", "half")
    assert bad.exit_code == 2 and "--depths takes comma-separated float values" in bad.output


def test_eval_compare(tmp_path):
    def report(path, *rows):
        results = [{"policy": p, "budget": b, "tasks": {"t": {"hits": t}, "u": {"hits": u}}} for p, b, t, u in rows]
        path.write_text(json.dumps({"results": results}))
        return str(path)

    first = report(tmp_path / "a.json", ("dense", 1.0, "1100", "10"), ("infinigen", 0.2, "1010", "11"))
    second = report(tmp_path / "b.json", ("h2o", 0.2, "0100", "10"))
    result = invoke("eval", "compare", first, second, "--json")
    assert result.exit_code == 0, result.output
    compared = json.loads(result.stdout)
    assert compared["reference"] == "dense@1" and compared["examples"] == 6 and compared["acc"] == 0.5
    infinigen, h2o = compared["rows"]
    assert infinigen["vs_reference"]["difference"] == 16.67 and infinigen["changed"] == 50.0  # 3 of 6 changed
    assert h2o["vs_reference"]["difference"] == -16.67 and h2o["changed"] == 16.67
    (pair,) = compared["pairs"]
    assert pair["rows"] == ["infinigen@0.2", "h2o@0.2"]
    assert pair["acc"]["difference"] == 33.33 and pair["changed"]["difference"] == 33.33
    table = invoke("eval", "compare", first, second, "--reference", "h2o@0.2").stdout
    assert "dense@1" in table and "answers" in table
    unknown = invoke("eval", "compare", first, "--reference", "quest@0.2")
    assert unknown.exit_code == 2 and "none of the rows: dense@1, infinigen@0.2" in unknown.output
    again = report(tmp_path / "later.json", ("infinigen", 0.2, "1100", "11"))
    both = json.loads(invoke("eval", "compare", first, again, "--reference", "dense@1", "--json").stdout)
    assert [r["row"] for r in both["rows"]] == ["infinigen@0.2 (a)", "infinigen@0.2 (later)"]  # each names its report
    assert both["rows"][1]["changed"] == 16.67
    twice = invoke(
        "eval", "compare", report(tmp_path / "d.json", ("h2o", 0.2, "0100", "10"), ("h2o", 0.2, "0000", "10"))
    )
    assert twice.exit_code == 2 and "one report holds h2o@0.2 (d) more than once" in twice.output
    short = report(tmp_path / "c.json", ("int4", 1.0, "110", "10"))
    assert "do not cover the same tasks and examples" in invoke("eval", "compare", first, short).output
    (tmp_path / "bench.json").write_text(json.dumps({"shape": "x", "results": [{"policy": "full"}]}))
    other = invoke("eval", "compare", first, str(tmp_path / "bench.json"))
    assert other.exit_code == 2 and "per-example hits" in other.output and "Traceback" not in other.output


def test_eval_ppl_prefix_defaults_to_half_the_window(prepared, tmp_path):
    folder, out = prepared("llama")
    text = tmp_path / "text.txt"
    text.write_text("the house was old and the street was narrow and the walls were thin " * 30)
    args = f"eval ppl {folder} --text {text} --window 48 --windows 1 --batch 1 --policy dense --device cpu --json"
    result = invoke(*args.split())
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["prefix"] == 24 and report["results"][0]["tokens_scored"] == 24
