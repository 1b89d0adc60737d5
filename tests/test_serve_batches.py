"""``infinigen serve``'s scheduling: waiting requests batched under the memory plan, each with the answer it
gets alone; kept prompts across requests and restarts; Ray Serve's replicas."""

from __future__ import annotations

import itertools
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest
from conftest import tiny_model

pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from serving import PROMPTS, alone, asked, client, in_threads, serving, solo  # noqa: E402

from infinigen.serve.engine import Engine  # noqa: E402


def test_kept_prompts_more_than_the_host_has_are_refused_in_one_line(tiny_engine, monkeypatch):
    """A prompt cache larger than the host memory free now is refused before any request; the default is half of
    it, and one that fits is the budget asked."""
    from infinigen.errors import InfinigenError
    from infinigen.runtime.memory import plan as memory

    monkeypatch.setattr(memory, "host_available_bytes", lambda: 8_000_000_000)
    model, tokenizer, artifact = tiny_engine.model, tiny_engine.tokenizer, tiny_engine.artifact
    refused = r"prompt_cache_gb 9 is more than the host memory available now \(8.0 GB\)"
    with pytest.raises(InfinigenError, match=refused):
        Engine(model, tokenizer, artifact, {"prompt_cache_gb": 9}, "tiny")
    assert Engine(model, tokenizer, artifact, {"prompt_cache_gb": 4}, "tiny").prompts.budget == 4_000_000_000
    assert Engine(model, tokenizer, artifact, {}, "tiny").prompts.budget == 4_000_000_000


def test_a_limited_cpu_pool_serves_long_prompts_without_keeping_them(tiny_engine):
    """--cpu-pool-gb rewrites its slots, so no prompt is kept (each request is computed whole), and a prompt over
    one prefill chunk is answered as it is alone."""
    settings = {"cpu_pool_gb": 0.001, "block_tokens": 16}
    model, tokenizer, artifact = tiny_engine.model, tiny_engine.tokenizer, tiny_engine.artifact
    limited = Engine(model, tokenizer, artifact, settings, "tiny", prefill_chunk=16)
    document = " ".join(PROMPTS * 2)
    assert limited.prompts is None
    answer = solo(limited, document, 4)
    assert answer.cached_tokens == 0 and answer.text == alone(limited, document, 4, **settings)


def test_a_kept_prompt_serves_the_next_question_with_the_cold_tokens(tiny_engine):
    model, tokenizer, artifact = tiny_engine.model, tiny_engine.tokenizer, tiny_engine.artifact
    kept = Engine(model, tokenizer, artifact, {"prompt_cache_gb": 1, "block_tokens": 16}, "tiny", prefill_chunk=16)
    document = " ".join(PROMPTS * 2)
    questions = [document + " where is it", document + " who is she"]
    first, second = (tokenizer(q)["input_ids"] for q in questions)
    common = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)  # the document and more
    assert common >= len(tokenizer(document)["input_ids"])
    with serving(kept) as url:
        for i, prompt in enumerate(questions):
            answer = client(url).completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
            cold = Engine(
                model, tokenizer, artifact, {"prompt_cache_gb": 1, "block_tokens": 16}, "tiny", prefill_chunk=16
            )  # nothing kept
            with serving(cold) as cold_url:
                alone = client(cold_url).completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
            assert answer.choices[0].text == alone.choices[0].text
            assert alone.usage.prompt_tokens_details.cached_tokens == 0
            assert answer.usage.prompt_tokens_details.cached_tokens == (0 if i == 0 else common)
        metrics = httpx.get(url + "/metrics").text
    assert f"infinigen_prompt_tokens_cached_total {common}" in metrics
    assert "infinigen_kept_prompts 2" in metrics


def test_waiting_requests_are_batched_and_each_gets_its_tokens_alone(tiny_engine, solo_engine):
    """Eight requests of different prompts and lengths arriving while one runs decode in batches the plan
    admits, each ending at its own max_tokens with the tokens it gets alone."""
    prompts = [PROMPTS[i % 4] + " and" * i for i in range(8)]
    lengths = [40] + [3 + i for i in range(1, 8)]
    before = (tiny_engine.metrics.batches, tiny_engine.metrics.batched_rows)
    admitted = [asked(tiny_engine, p, n) for p, n in zip(prompts, lengths, strict=True)]
    answers = in_threads(tiny_engine, [(ask, plan, lambda text: None) for ask, plan in admitted])
    batches = tiny_engine.metrics.batches - before[0]
    assert tiny_engine.metrics.batched_rows - before[1] == 8 and batches == 2, "the seven waiting ones together"
    for answer, prompt, n in zip(answers, prompts, lengths, strict=True):
        assert answer == solo(solo_engine, prompt, n)
    assert answers[0].completion_tokens == 40 and answers[7].completion_tokens == 10, "each to its own length"
    assert tiny_engine.metrics.queued == tiny_engine.metrics.active == 0


def test_a_row_whose_client_leaves_stops_and_its_batch_mates_go_on(tiny_engine, solo_engine):
    calls = itertools.count()  # the leaving client's stopped(): asked as its batch forms, then at every step
    first = asked(tiny_engine, PROMPTS[0], 30)
    leaving = asked(tiny_engine, PROMPTS[1], 30)
    staying = asked(tiny_engine, PROMPTS[2], 12)
    requests = [(*first, lambda text: None), (*leaving, lambda text: None, lambda: next(calls) >= 3)]
    requests.append((*staying, lambda text: None))
    answers = in_threads(tiny_engine, requests)
    assert answers[1].completion_tokens == 3, "gone once asked after its third token"
    assert answers[2] == solo(solo_engine, PROMPTS[2], 12)


def test_a_failing_batch_runs_its_rows_again_alone_and_only_the_one_at_fault_fails(
    tiny_engine, solo_engine, monkeypatch
):
    original, poison = tiny_engine._generate, "poison " + PROMPTS[3]
    sizes = []

    def failing(batch, *args, **kwargs):
        sizes.append(len(batch))
        if any(r.ask.prompt == poison for r in batch):
            raise RuntimeError("injected")
        return original(batch, *args, **kwargs)

    monkeypatch.setattr(tiny_engine, "_generate", failing)
    requests = [(*asked(tiny_engine, p, n), lambda text: None) for p, n in [(PROMPTS[0], 20), (poison, 4)]]
    requests += [(*asked(tiny_engine, p, 5), lambda text: None) for p in PROMPTS[1:3]]
    answers = in_threads(tiny_engine, requests)
    assert sizes == [1, 3, 1, 1, 1], "the failed batch's rows again alone"
    assert isinstance(answers[1], RuntimeError)
    for answer, (ask, _, _) in zip(answers, requests, strict=True):
        if ask.prompt != poison:
            assert answer == solo(solo_engine, ask.prompt, ask.max_tokens)


def test_with_kept_prompts_long_and_short_requests_batch_each_served_and_kept_as_alone(tiny_engine):
    """Where prompts are kept a batch prefills a row at a time: long and short requests share batches, each with the
    answer it gets alone and its prompt kept, and the next questions about the long ones are served in one batch."""
    model, tokenizer, artifact = tiny_engine.model, tiny_engine.tokenizer, tiny_engine.artifact
    settings = {"prompt_cache_gb": 1, "block_tokens": 16}
    kept = Engine(model, tokenizer, artifact, settings, "tiny", prefill_chunk=16)
    long = [" ".join(PROMPTS[i:] + PROMPTS[:i]) for i in range(3)]  # 30-odd tokens each
    rounds = [[PROMPTS[0], *long, *PROMPTS[1:]], [PROMPTS[0], *(document + " where is it" for document in long)]]
    for prompts, batches, rows in zip(rounds, (2, 4), (7, 11), strict=True):
        answers = in_threads(kept, [(*asked(kept, p, 12), lambda text: None) for p in prompts])
        assert (kept.metrics.batches, kept.metrics.batched_rows) == (batches, rows), "the waiting ones together"
        for prompt, answer in zip(prompts, answers, strict=True):
            cold = solo(Engine(model, tokenizer, artifact, settings, "tiny", prefill_chunk=16), prompt, 12)
            assert answer.text == cold.text and cold.cached_tokens == 0
    assert [a.cached_tokens for a in answers[1:]] == [len(tokenizer(d)["input_ids"]) for d in long]
    assert all(a.completion_tokens for a in answers)


def test_kept_prompts_written_at_shutdown_serve_the_next_server_with_the_cold_tokens(tiny_engine, tmp_path):
    """``save_prompts`` writes what the cache keeps; a server started on that directory keeps those of its model
    (another model's file is left alone, a damaged one skipped with a line) and answers from them as cold."""
    model, tokenizer, artifact = tiny_engine.model, tiny_engine.tokenizer, tiny_engine.artifact
    settings, document = {"prompt_cache_gb": 1, "block_tokens": 16}, " ".join(PROMPTS * 2)
    first = Engine(model, tokenizer, artifact, settings, "tiny", prefill_chunk=16, prompt_dir=tmp_path)
    solo(first, document + " where is it", 6)
    assert first.save_prompts() == 1 and first.save_prompts() == 0, "each written once"
    (path,) = tmp_path.glob("*.prompt")
    (tmp_path / "damaged.prompt").write_bytes(path.read_bytes()[:-9])
    other = Engine(tiny_model("llama", seed=1), tokenizer, None, settings, "x", prefill_chunk=16, prompt_dir=tmp_path)
    assert len(other.prompts) == 0 and other.save_prompts() == 0 and path.exists(), "not another model's"
    second = Engine(model, tokenizer, artifact, settings, "tiny", prefill_chunk=16, prompt_dir=tmp_path)
    assert len(second.prompts) == 1
    cold = Engine(model, tokenizer, artifact, settings, "tiny", prefill_chunk=16)
    question = document + " who is she"
    warm = solo(second, question, 6)
    assert warm.cached_tokens > 0 and warm.text == solo(cold, question, 6).text
    second.prompts.clear()
    second.save_prompts()
    assert not path.exists() and (tmp_path / "damaged.prompt").exists(), "what the cache no longer holds goes"


def test_ray_serve_replicas_give_the_answers_one_server_gives(prepared, tokenizer):
    """``serve --ray``: a local Ray cluster, two replicas each loading the model and artifact once, behind Ray
    Serve's proxy: the openai client's answers (plain and streamed) are those one engine gives alone; SIGTERM
    stops it."""
    pytest.importorskip("ray.serve")
    folder, artifact = prepared("llama")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "infinigen", "serve", str(folder), "--artifact", str(artifact), "--ray"]
    command += ["--ray-replicas", "2", "--port", str(port), "--served-name", "tiny", "--device", "cpu"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().startswith("serving on Ray: 2 replicas"), process.stderr.read()[-3000:]
        one = Engine.load(str(folder), str(artifact), {}, "tiny", device="cpu", max_batch=1)
        answers: dict[int, tuple] = {}

        def ask(i: int) -> None:
            reply = client(f"http://127.0.0.1:{port}").completions.create(
                model="tiny", prompt=PROMPTS[i], max_tokens=6, temperature=0
            )
            streamed = client(f"http://127.0.0.1:{port}").completions.create(
                model="tiny", prompt=PROMPTS[i], max_tokens=6, temperature=0, stream=True
            )
            answers[i] = (reply.choices[0].text, "".join(c.choices[0].text for c in streamed if c.choices))

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        expected = {i: (solo(one, p, 6).text,) * 2 for i, p in enumerate(PROMPTS)}
        assert answers == expected
        process.send_signal(signal.SIGTERM)
        assert process.wait(120) == 0
    finally:
        if process.poll() is None:
            process.kill()


def test_a_paged_policy_batches_only_prompts_of_one_length(tiny_engine):
    """Quest keeps state per page of slots, which padding would shift: waiting prompts of another length than
    the batch's first run apart, and every answer is the one it gets alone."""
    model, tokenizer, artifact = tiny_engine.model, tiny_engine.tokenizer, tiny_engine.artifact
    settings = {"policy": "quest", "prompt_cache_gb": 0}
    paged = Engine(model, tokenizer, artifact, settings, "tiny")
    one = Engine(model, tokenizer, artifact, settings, "tiny", max_batch=1)
    prompts = [PROMPTS[0], PROMPTS[1] + " and", PROMPTS[3], PROMPTS[2] + " and"]
    assert [len(tokenizer(p)["input_ids"]) for p in prompts] == [9, 9, 6, 9]
    answers = in_threads(paged, [(*asked(paged, p, 8), lambda text: None) for p in prompts])
    assert paged.metrics.batches == 3, "the first alone, the next two of 9 tokens together, the 6 apart"
    assert answers == [solo(one, p, 8) for p in prompts]
