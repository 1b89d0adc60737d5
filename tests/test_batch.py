"""Batch jobs (``infinigen.batch``, ``infinigen generate --input``): requests parsed line by line (a bad
line is an error row, never the job's end), batches by the memory plan, results appended a batch at a
time, and a job stopped anywhere (Ctrl-C, ``kill -9``) continued to exactly an uninterrupted run's rows."""

from __future__ import annotations

import gc
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import invoke, tiny_model
from helpers import tiny_setup

from infinigen.artifacts import open_artifact
from infinigen.batch import Job, Work, read_requests, run_job
from infinigen.batch.records import append_rows, read_done
from infinigen.errors import InfinigenError
from infinigen.models import load_model
from infinigen.runtime import InfinigenCache

WORDS = ("the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "away", "from", "its", "home", "to", "big")


def write_requests(path: Path, count: int, seed: int = 0, longest: int = 80) -> list[dict]:
    """``count`` prompts of mixed lengths; every fifth asks for 3 new tokens."""
    rng = random.Random(seed)
    records = [
        {"id": f"r{i}", "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, longest)))}
        | ({"max_new_tokens": 3} if i % 5 == 0 else {})
        for i in range(count)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def results(path: Path) -> dict:
    """Each id's row without its timing statistics (they differ from run to run)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    ids = [row["id"] if row["id"] is not None else ("line", row["line"]) for row in rows]
    assert len(ids) == len(set(ids)), "every id once"
    return {key: {k: v for k, v in row.items() if k != "stats"} for key, row in zip(ids, rows, strict=True)}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"prompt": "hi"}', "needs an id"),
        ('{"id": true, "prompt": "hi"}', "needs an id"),
        ('{"id": 1, "prompt": "hi", "temperature": 1}', "unknown field 'temperature'"),
        ('{"id": 1, "prompt": "hi", "messages": []}', "exactly one of prompt and messages"),
        ('{"id": 1}', "exactly one of prompt and messages"),
        ('{"id": 1, "prompt": "  "}', "the prompt is empty"),
        ('{"id": 1, "prompt": 3}', "not a string"),
        ('{"id": 1, "messages": [{"role": "user"}]}', "messages must be"),
        ('{"id": 1, "messages": []}', "messages must be"),
        ('{"id": 1, "prompt": "hi", "max_new_tokens": 0}', "max_new_tokens must be"),
        ('{"id": 1, "prompt": "hi", "max_new_tokens": "8"}', "max_new_tokens must be"),
    ],
)
def test_a_bad_line_is_an_error_row_of_its_own(tmp_path, line, message):
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "ok", "prompt": "hi", "max_new_tokens": 2}\n\n' + line + "\n")
    requests, bad = read_requests(path)
    assert [(r.id, r.prompt, r.max_new_tokens) for r in requests] == [("ok", "hi", 2)]
    assert len(bad) == 1 and bad[0].line == 3 and message in bad[0].error


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n', "id 1 on lines 1 and 2: ids must be unique"),
        ('{"id": "a", "prompt": "a"}\n{"id": "a", "prompt": ""}\n', "id 'a' on lines 1 and 2"),
        ("\n\n", "holds no request"),
    ],
)
def test_files_refused_before_anything_runs(tmp_path, content, message):
    path = tmp_path / "in.jsonl"
    path.write_text(content)
    with pytest.raises(InfinigenError, match=message):
        read_requests(path)
    with pytest.raises(InfinigenError, match="cannot read"):
        read_requests(tmp_path / "missing.jsonl")


def test_output_cut_back_to_its_last_whole_line(tmp_path):
    """A run killed while writing leaves a part of a line: the next run cuts it (that row is redone)."""
    path = tmp_path / "out.jsonl"
    append_rows(path, [{"id": "a", "text": "x"}, {"id": None, "line": 4, "error": "not JSON"}])
    with open(path, "a") as file:
        file.write('{"id": "b", "te')
    assert read_done(path) == ({"a"}, {4})
    assert path.read_text().count("\n") == 2 and path.read_text().endswith("\n")
    path.write_text("something else\n")
    with pytest.raises(InfinigenError, match="not a result of infinigen"):
        read_done(path)


@pytest.fixture
def job(tokenizer):
    return Job.of(tiny_model("llama"), tokenizer, None, {"policy": "full"}, max_new_tokens=6, max_batch=4)


def test_a_job_writes_every_request_once_as_decoded_alone(job, tmp_path):
    """Every request gets one row; greedy rows equal the request decoded alone (padding changes nothing);
    a prompt too long for the model and a bad line are error rows and the job goes on; a rerun has
    nothing left to do."""
    records = write_requests(tmp_path / "in.jsonl", 10)
    with open(tmp_path / "in.jsonl", "a") as file:
        file.write(json.dumps({"id": "long", "prompt": "the " * 600}) + "\nnot json\n")
    requests, bad = read_requests(tmp_path / "in.jsonl")
    batches = []
    report = run_job(job, Work(requests, bad, tmp_path / "out.jsonl"), on_batch=lambda p: batches.append(p.written))
    got = results(tmp_path / "out.jsonl")
    assert report.written == len(got) == 12 and report.errors == 2 and len(batches) == report.batches == 3
    assert "exceeds the model's context of 512 tokens" in got["long"]["error"]
    assert "not JSON" in got[("line", 12)]["error"]
    for record in records[:4]:
        alone = tmp_path / f"alone-{record['id']}.jsonl"
        alone_requests = [r for r in requests if r.id == record["id"]]
        run_job(job, Work(alone_requests, [], alone))
        assert results(alone)[record["id"]] == got[record["id"]]
        row, limit = got[record["id"]], record.get("max_new_tokens", 6)
        assert row["tokens"] == limit if row["finish_reason"] == "length" else row["tokens"] <= limit
    again = run_job(job, Work(requests, bad, tmp_path / "out.jsonl"))
    assert again.written == 0 and again.done_before == 12


def test_batches_follow_the_memory_plan(job, tmp_path, monkeypatch):
    """Longest prompts first; a batch grows while the plan admits one more row: under a GPU budget, or
    host memory, that admits fewer rows, more batches of fewer rows."""
    from infinigen.batch.runner import batch_plan, form_batches, prepare
    from infinigen.runtime.memory import plan as memory

    write_requests(tmp_path / "in.jsonl", 12)
    requests, _ = read_requests(tmp_path / "in.jsonl")
    prepared, _ = prepare(job.planner, requests)
    batches, unfit = form_batches(job.planner, prepared)
    lengths = [len(p.ids) for batch in batches for p in batch]
    assert lengths == sorted(lengths, reverse=True) and [len(b) for b in batches] == [4, 4, 4] and not unfit
    # a budget for two of the longest rows (16-bit rows: the default 8-bit ones fall back to them where short)
    planner = replace(job.planner, settings=job.planner.settings | {"kv_bits": 16})
    two = batch_plan(planner, batches[0][:2]).needed_gpu
    small = replace(planner, budget=two)
    tight, unfit = form_batches(small, prepared)
    assert len(tight[0]) == 2 and all(batch_plan(small, b).fits for b in tight) and not unfit
    assert [p for b in tight for p in b] == [p for b in batches for p in b]  # the same order, cut finer
    host = batch_plan(job.planner, batches[0][:2]).host  # host memory for two of the longest rows' pools
    monkeypatch.setattr(memory, "host_available_bytes", lambda: host)
    assert len(form_batches(job.planner, prepared)[0][0]) == 2
    monkeypatch.undo()
    half_gb = Job.of(job.model, job.planner.tokenizer, None, {"gpu_memory_gb": 0.5})
    none_fit, unfit = form_batches(half_gb.planner, prepared)
    assert not none_fit and len(unfit) == 12 and "the weights alone do not fit" in unfit[0][1]


def test_a_job_stopped_between_batches_continues_to_the_same_rows(job, tmp_path):
    write_requests(tmp_path / "in.jsonl", 14)
    requests, bad = read_requests(tmp_path / "in.jsonl")
    run_job(job, Work(requests, bad, tmp_path / "whole.jsonl"))
    calls = []
    first = run_job(job, Work(requests, bad, tmp_path / "out.jsonl"), stop=lambda: calls.append(1) or len(calls) > 2)
    assert first.interrupted and first.batches == 2 and first.written == 8
    second = run_job(job, Work(requests, bad, tmp_path / "out.jsonl"))
    assert not second.interrupted and second.done_before == 8 and second.written == 6
    assert results(tmp_path / "out.jsonl") == results(tmp_path / "whole.jsonl")


def test_requests_sharing_a_prefix_compute_it_once(tokenizer, tmp_path):
    """Questions about one document: one group, the document computed once; each row's tokens those of the
    request run alone, its cached tokens the shared prefix; a rerun missing a row gives it back unchanged;
    with prompt_cache_gb 0, no group."""
    from infinigen.batch.runner import form_batches, prepare

    document = " ".join(WORDS[i % len(WORDS)] for i in range(0, 210, 3))
    questions = ["where is the cat", "who ran away from home", "what sat on the mat"]
    records = [{"id": f"q{i}", "prompt": f"{document} {q}?"} for i, q in enumerate(questions)]
    records += [{"id": "other", "prompt": "a dog ran far"}, {"id": "more", "prompt": "the big mat sat away"}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    requests, _ = read_requests(tmp_path / "in.jsonl")
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")

    def job(**settings):
        settings = {"policy": "infinigen", "budget": 0.5} | settings
        return Job.of(model, tokenizer, artifact, settings, max_new_tokens=5, max_batch=4, prefill_chunk=32)

    grouping = job()
    prepared, _ = prepare(grouping.planner, requests)
    batches, _ = form_batches(grouping.planner, prepared)
    group = next(batch for batch in batches if batch[0].prefix)
    ids = [p.ids for p in group]
    common = next(i for i in range(len(ids[0])) if len({row[i] for row in ids}) > 1)
    assert [p.request.id for p in group] == ["q0", "q1", "q2"] and {p.prefix for p in group} == {common}
    report = run_job(grouping, Work(requests, [], tmp_path / "out.jsonl"))
    got = {row["id"]: row for row in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert report.cached == 3 * common and [got[f"q{i}"]["stats"]["cached_tokens"] for i in range(3)] == [common] * 3
    for record in records[:3]:
        alone = tmp_path / f"alone-{record['id']}.jsonl"
        run_job(job(prompt_cache_gb=0), Work([r for r in requests if r.id == record["id"]], [], alone))
        assert results(alone)[record["id"]] == results(tmp_path / "out.jsonl")[record["id"]]
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    (tmp_path / "cut.jsonl").write_text("".join(line + "\n" for line in lines if '"q1"' not in line))
    again = run_job(grouping, Work(requests, [], tmp_path / "cut.jsonl"))
    assert again.written == 1 and results(tmp_path / "cut.jsonl") == results(tmp_path / "out.jsonl")
    off = job(prompt_cache_gb=0)
    assert not any(p.prefix for b in form_batches(off.planner, prepare(off.planner, requests)[0])[0] for p in b)


def test_a_group_forms_on_a_gpu_only_where_the_estimates_say_it_pays(job, tokenizer, tmp_path):
    """With a GPU's rates: where a step costs far more than a prompt token's prefill, rows stay batched; where
    the prefill is the cost, the prefix is computed once."""
    from infinigen.batch.runner import form_batches, prepare
    from infinigen.runtime.memory.throughput import DeviceRates

    document = " ".join(WORDS[i % len(WORDS)] for i in range(0, 210, 3))
    records = [{"id": f"q{i}", "prompt": f"{document} {q}?"} for i, q in enumerate(["where", "who ran", "what"])]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    requests, _ = read_requests(tmp_path / "in.jsonl")
    steps_cost = DeviceRates(h2d_gb_s=1e6, device_gb_s=1e-3, matmul_tflops=1e6)  # reading weights: each step
    prefill_costs = DeviceRates(h2d_gb_s=1e6, device_gb_s=1e6, matmul_tflops=1e-6)  # multiply-adds: each token
    for rates, grouped in ((steps_cost, False), (prefill_costs, True)):
        planner = replace(job.planner, prefill_chunk=32, rates=rates)
        batches, _ = form_batches(planner, prepare(planner, requests)[0])
        assert [bool(b[0].prefix) for b in batches] == [grouped] and len(batches[0]) == 3


def job_command(folder: Path, tmp_path: Path, output: str) -> list[str]:
    return [
        sys.executable, "-m", "infinigen", "generate", str(folder), "--policy", "full",
        "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / output),
        "--max-new-tokens", "6", "--max-batch", "4", "--device", "cpu",
    ]  # fmt: skip


def started(command: list[str], output: Path, lines: int) -> subprocess.Popen:
    """The command running, once ``output`` has at least ``lines`` lines."""
    env = os.environ | {"PYTHONPATH": str(Path(__file__).parents[1])}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (output.exists() and output.read_text().count("\n") >= lines):
        assert process.poll() is None, process.stderr.read()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return process


def test_kill_9_at_a_random_batch_and_a_rerun_give_the_uninterrupted_rows(checkpoint, tmp_path):
    folder = checkpoint("llama")
    write_requests(tmp_path / "in.jsonl", 60)
    subprocess.run(job_command(folder, tmp_path, "whole.jsonl"), check=True, capture_output=True)
    process = started(job_command(folder, tmp_path, "out.jsonl"), tmp_path / "out.jsonl", random.randint(1, 50))
    process.send_signal(signal.SIGKILL)
    process.wait()
    killed = (tmp_path / "out.jsonl").read_text().count("\n")
    assert 0 < killed < 60
    subprocess.run(job_command(folder, tmp_path, "out.jsonl"), check=True, capture_output=True)
    assert results(tmp_path / "out.jsonl") == results(tmp_path / "whole.jsonl")


def test_ctrl_c_ends_after_the_current_batch(checkpoint, tmp_path):
    folder = checkpoint("llama")
    write_requests(tmp_path / "in.jsonl", 60)
    process = started(job_command(folder, tmp_path, "out.jsonl"), tmp_path / "out.jsonl", 4)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    written = (tmp_path / "out.jsonl").read_text().count("\n")
    assert process.returncode == 130 and "the same command continues" in stderr
    assert written % 4 == 0 and written < 60  # whole batches only
    subprocess.run(job_command(folder, tmp_path, "out.jsonl"), check=True, capture_output=True)
    assert len(results(tmp_path / "out.jsonl")) == 60


def test_cli_refusals_are_one_line(checkpoint, tmp_path):
    folder = checkpoint("llama")
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n')
    cases = [
        (["--input", str(tmp_path / "in.jsonl")], "--input needs --output"),
        (["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "in.jsonl")], "must not be the --input"),
        (["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o"), "--prompt", "x"], "takes no"),
        (["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o")], "ids must be unique"),
    ]
    for args, message in cases:
        result = invoke("generate", str(folder), *args)
        assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_a_ray_job_writes_one_process_rows_and_continues(checkpoint, tmp_path):
    """On a local Ray cluster of two CPU workers (each loading the model once), the driver forms the
    batches from the config and tokenizer alone: a job stopped after its first batch continues, with one
    of its workers killed on the way (Ray restarts it and retries its batch), to one process's rows. The
    driver runs in a process of its own, as the command line's does, and ends cleanly: Ray once ended it
    with exit code 1 when a job left early kept Ray Data's executor running past ``ray.shutdown``."""
    pytest.importorskip("ray.data")
    folder = checkpoint("llama")
    scenario = f"from test_batch import ray_scenario; ray_scenario({str(folder)!r}, {str(tmp_path)!r})"
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    done = subprocess.run([sys.executable, "-c", scenario], capture_output=True, text=True, env=env, timeout=600)
    assert (tmp_path / "scenario-passed").exists(), done.stderr[-3000:]  # every check of the job passed
    assert done.returncode == 0, done.stderr[-3000:]  # a job left early ended its process no more


def ray_scenario(folder: str, tmp: str) -> None:
    """The Ray test's driver (``test_a_ray_job_writes_one_process_rows_and_continues``)."""
    from infinigen.batch.distributed import Cluster, Loading, driver_planner, run_on_ray
    from infinigen.runtime.text import Sampling

    tmp_path = Path(tmp)
    write_requests(tmp_path / "in.jsonl", 24)
    document = " ".join(WORDS[i % len(WORDS)] for i in range(0, 210, 3))  # three questions: one group
    with open(tmp_path / "in.jsonl", "a") as file:
        file.write("not json\n")
        for i, question in enumerate(WORDS[:3]):
            file.write(json.dumps({"id": f"q{i}", "prompt": f"{document} {question}?"}) + "\n")
    requests, bad = read_requests(tmp_path / "in.jsonl")
    options = {"max_new_tokens": 6, "max_batch": 4, "prefill_chunk": 32}
    loaded = load_model(str(folder), device="cpu")
    one = Job.of(loaded.model, loaded.tokenizer, None, {"policy": "full"}, **options)
    run_job(one, Work(requests, bad, tmp_path / "one.jsonl"))
    loading = Loading(str(folder), None, "cpu", None)
    planner = driver_planner(loading, {"policy": "full"}, **options)
    cluster = Cluster(workers=2)
    work = Work(requests, bad, tmp_path / "ray.jsonl")
    first = run_on_ray(cluster, loading, planner, Sampling(), work, stop=lambda: True)
    assert first.interrupted and first.batches == 1 and first.written == 1 + 4  # the bad line, one batch
    killed: list[int] = []
    killer = threading.Thread(target=kill_a_worker, args=(killed,))
    killer.start()
    second = run_on_ray(cluster, loading, planner, Sampling(), work)
    killer.join()
    assert not second.interrupted and second.done_before == 5 and second.written == 23 and killed
    assert results(tmp_path / "ray.jsonl") == results(tmp_path / "one.jsonl")  # the killed worker's work redone
    served = [json.loads(line)["stats"]["cached_tokens"] for line in (tmp_path / "ray.jsonl").read_text().splitlines()
              if line.startswith('{"id": "q')]  # fmt: skip
    assert len(served) == 3 and min(served) > 32  # the group's prefix served on the workers
    (tmp_path / "scenario-passed").touch()


def kill_a_worker(killed: list[int], seconds: float = 120) -> None:
    """SIGKILL the first of the job's Ray actors to appear (found by its process title)."""
    deadline = time.monotonic() + seconds
    while not killed and time.monotonic() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"MapWorker" in command:
                os.kill(int(pid), signal.SIGKILL)
                killed.append(int(pid))
                return
        time.sleep(0.05)


def test_the_gpu_benchmark_script_runs_on_the_cpu(checkpoint, tmp_path):
    """benchmarks/batch_gpu.py (the GPU throughput comparison) end to end on a tiny model: every mode runs
    the same requests and reports its tokens per second; transformers' sample runs every other of its batches."""
    folder = checkpoint("llama")
    rng = random.Random(0)
    (tmp_path / "book.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(2000)))
    script = Path(__file__).parents[1] / "benchmarks" / "batch_gpu.py"
    command = [sys.executable, str(script), "--model", str(folder), "--text", str(tmp_path / "book.txt")]
    command += ["--prompts", "10", "--min-tokens", "16", "--max-tokens", "100", "--new-tokens", "4", "--device", "cpu"]
    command += ["--max-batch", "4", "--transformers-every", "2"]
    env = os.environ | {"PYTHONPATH": str(Path(__file__).parents[1])}
    subprocess.run([*command, "--out", str(tmp_path / "report.json")], check=True, capture_output=True, env=env)
    modes = json.loads((tmp_path / "report.json").read_text())["modes"]
    assert set(modes) == {"plan", "batches of 8", "transformers"}
    assert all(0 < m["generated_tokens"] <= 40 and m["tokens_per_s"] > 0 for m in modes.values())
    assert modes["plan"]["batches"] == 3 and modes["batches of 8"]["batches"] == 2
    assert modes["transformers"]["batches_formed"] == 3 and modes["transformers"]["batches"] == 2
    assert modes["transformers"]["generated_tokens"] < modes["plan"]["generated_tokens"]
    plan = modes["plan"]
    assert plan["prefill_seconds"] > 0 and plan["decode_seconds"] > 0 and plan["largest_peak_gpu_gb"] is None


@pytest.mark.parametrize("policy", ["full", "infinigen"])
def test_a_finished_batch_frees_its_cache_at_once(prepared, tokenizer, tmp_path, policy, device):
    """Each batch's cache is gone when its batch ends, with no garbage collection: a reference cycle would
    keep its GPU buffers until Python's next full collection (which GPU memory does not trigger), and a
    long job's later batches would run out of memory (each SmolLM2 batch on the H200 left its cache behind)."""
    folder, artifact = prepared("llama")
    model = load_model(str(folder), device=device).model
    job = Job.of(model, tokenizer, open_artifact(artifact, model), {"policy": policy}, max_new_tokens=4, max_batch=2)
    write_requests(tmp_path / "in.jsonl", 6)
    requests, bad = read_requests(tmp_path / "in.jsonl")
    gc.collect()
    gc.disable()
    try:
        report = run_job(job, Work(requests, bad, tmp_path / "out.jsonl"))
        alive = [o for o in gc.get_objects() if isinstance(o, InfinigenCache)]
    finally:
        gc.enable()
    assert report.batches == 3 and report.errors == 0 and alive == []


def test_a_batch_out_of_memory_runs_again_in_halves(job, tmp_path, monkeypatch):
    """A batch that runs out of device memory (the plan's miss: it admitted the batch) is run again as two
    halves, down to single rows, rather than lost as error rows; the rows equal an unsplit run's and say
    so, and the report counts them."""
    from infinigen.batch import runner
    from infinigen.errors import OutOfMemory

    write_requests(tmp_path / "in.jsonl", 8)
    requests, bad = read_requests(tmp_path / "in.jsonl")
    run_job(job, Work(requests, bad, tmp_path / "whole.jsonl"))
    decode = runner.generate_ids

    def at_most_one_row(model, tokenizer, prompts, *args, **kwargs):
        if len(prompts) > 1:
            raise OutOfMemory("out of cuda:0 memory")
        return decode(model, tokenizer, prompts, *args, **kwargs)

    monkeypatch.setattr(runner, "generate_ids", at_most_one_row)
    report = run_job(job, Work(requests, bad, tmp_path / "split.jsonl"))
    assert report.errors == 0 and report.split == report.written == 8 and report.batches == 2
    assert results(tmp_path / "split.jsonl") == results(tmp_path / "whole.jsonl")
    stats = [json.loads(line)["stats"] for line in (tmp_path / "split.jsonl").read_text().splitlines()]
    assert all(s["split_from"] in (2, 4) and s["batch"] == 1 for s in stats)
