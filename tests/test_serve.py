"""``infinigen serve``: the ``openai`` client against a server on 127.0.0.1 (a tiny random model; SmolLM2 for chat),
every answer the tokens the runtime gives the request alone; bad requests are 4xx with an error body."""

from __future__ import annotations

import contextlib
import itertools
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from conftest import invoke, tiny_model
from helpers import tiny_setup

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from infinigen.runtime import cache_for  # noqa: E402
from infinigen.runtime.cache.hooks import _ATTACHED  # noqa: E402
from infinigen.runtime.text import generate_ids  # noqa: E402
from infinigen.serve.app import make_app  # noqa: E402
from infinigen.serve.engine import Engine  # noqa: E402

PROMPTS = [
    "the old house on the corner of the street",
    "a long time ago in a small village",
    "the river ran past the mill and the",
    "she opened the door and saw",
]


@contextlib.contextmanager
def serving(engine: Engine, **options):
    """The app on a free port of 127.0.0.1 in a thread, for the block; its base URL."""
    server = uvicorn.Server(uvicorn.Config(make_app(engine, **options), host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def tiny_engine(tokenizer):
    model, artifact = tiny_setup(tokenizer, "llama", "cpu")
    return Engine(model, tokenizer, artifact, {}, "tiny")


@pytest.fixture(scope="module")
def solo_engine(tiny_engine):
    """The same model, artifact and settings, a request at a time: what a request gets alone in the server."""
    return Engine(tiny_engine.model, tiny_engine.tokenizer, tiny_engine.artifact, {}, "tiny", max_batch=1)


def solo(engine: Engine, prompt: str, new_tokens: int):
    """What ``engine`` answers ``prompt`` with nothing else waiting."""
    return engine.run(*_asked(engine, prompt, new_tokens), lambda text: None)


@pytest.fixture(scope="module")
def server(tiny_engine):
    with serving(tiny_engine) as url:
        yield url


def client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def alone(engine: Engine, prompt: str, new_tokens: int) -> str:
    """The text the runtime gives ``prompt`` decoded alone, outside the server."""
    ids = engine.tokenizer(prompt)["input_ids"]
    with cache_for(engine.model, engine.artifact) as cache:
        new, _ = generate_ids(engine.model, engine.tokenizer, [ids], cache, max_new_tokens=new_tokens)
    return engine.tokenizer.decode(new[0], skip_special_tokens=True)


def test_completions_give_the_tokens_the_runtime_gives_alone(server, tiny_engine):
    answer = client(server).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert answer.choices[0].text == alone(tiny_engine, PROMPTS[0], 8)
    assert answer.choices[0].finish_reason == "length"
    prompt_tokens = len(tiny_engine.tokenizer(PROMPTS[0])["input_ids"])
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt_tokens, 8)
    assert answer.usage.total_tokens == prompt_tokens + 8
    assert answer.usage.prompt_tokens_details.cached_tokens == 0
    assert [m.id for m in client(server).models.list().data] == ["tiny"]


def test_a_stream_is_the_same_text_in_pieces_and_ends_with_done(server, tiny_engine):
    usage = {"include_usage": True}
    pieces = client(server).completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=10, temperature=0, stream=True, stream_options=usage
    )
    chunks = list(pieces)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == alone(tiny_engine, PROMPTS[1], 10)
    assert sum(bool(c.choices and c.choices[0].text) for c in chunks) > 1  # token by token
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10  # the usage chunk, last
    with httpx.stream("POST", server + "/v1/completions", json={"model": "tiny", "prompt": "a", "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_stop_strings_end_the_text_before_them(server, tiny_engine):
    full = alone(tiny_engine, PROMPTS[2], 12)
    stop = full.split()[3]
    answer = client(server).completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=12, temperature=0, stop=stop)
    assert answer.choices[0].text == full[: full.find(stop)]
    assert answer.choices[0].finish_reason == "stop"
    streamed = client(server).completions.create(
        model="tiny", prompt=PROMPTS[2], max_tokens=12, temperature=0, stop=[stop], stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == full[: full.find(stop)]


def test_concurrent_clients_each_get_the_tokens_they_would_get_alone(server, tiny_engine):
    """Eight clients at once (batched as they wait): each gets the runtime's tokens for its prompt alone."""
    prompts = [*PROMPTS, *(p + " and the" for p in PROMPTS)]
    answers: dict[int, str] = {}

    def ask(i: int) -> None:
        reply = client(server).completions.create(model="tiny", prompt=prompts[i], max_tokens=6, temperature=0)
        answers[i] = reply.choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert answers == {i: alone(tiny_engine, p, 6) for i, p in enumerate(prompts)}


SAID = [{"role": "user", "content": "a"}]
BAD = [
    ("/v1/completions", {"model": "tiny", "prompt": "a", "n": 2}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "logprobs": 2}, 400, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": "8"}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 100000}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "stop": [1]}, 400, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "a", "tempreature": 0}, 400, "tempreature"),
    ("/v1/completions", {"model": "tiny", "prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a"}, 400, "model"),
    ("/v1/completions", {"model": "other", "prompt": "a"}, 404, "model"),
    ("/v1/completions", ["not", "an", "object"], 400, None),
    ("/v1/chat/completions", {"model": "tiny", "messages": SAID, "tools": [{}]}, 400, "tools"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": SAID}, 400, "messages"),  # no chat template
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD, ids=[f"{b[3]}-{i}" for i, b in enumerate(BAD)])
def test_bad_requests_get_a_4xx_with_an_error_body(server, path, body, status, param):
    reply = httpx.post(server + path, json=body, timeout=60)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["message"] and "Traceback" not in error["message"] and error["param"] == param


def test_bad_json_and_oversized_bodies_get_a_4xx_with_an_error_body(tiny_engine):
    with serving(tiny_engine, max_body_bytes=1000) as url:
        bad = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
        large = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "a " * 1000})
        assert large.status_code == 413 and "exceeds 1000 bytes" in large.json()["error"]["message"]


def test_a_request_the_plan_can_never_fit_is_refused_before_any_work(tiny_engine):
    small = Engine(tiny_engine.model, tiny_engine.tokenizer, tiny_engine.artifact, {"gpu_memory_gb": 0.66}, "tiny")
    with serving(small) as url:
        reply = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 4})
    assert reply.status_code == 400
    assert reply.json()["error"]["message"].startswith("does not fit: 1 x ")
    assert "of GPU memory, the budget is 0.03" in reply.json()["error"]["message"]
    assert small.metrics.generated_tokens == 0


def test_an_error_inside_one_request_answers_it_and_the_next_one_succeeds(server, tiny_engine, monkeypatch):
    original = tiny_engine._generate
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return original(*args, **kwargs)

    monkeypatch.setattr(tiny_engine, "_generate", failing)
    reply = httpx.post(server + "/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 2}, timeout=60)
    assert reply.status_code == 500 and reply.json()["error"]["message"] == "RuntimeError: injected"
    again = httpx.post(server + "/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 2}, timeout=60)
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 2


def test_a_client_gone_mid_stream_stops_its_decoding_and_frees_its_cache(server, tiny_engine):
    before = tiny_engine.metrics.generated_tokens
    body = {"model": "tiny", "prompt": PROMPTS[3], "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=60) as reply:
        lines = reply.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 60
    while tiny_engine.metrics.active or _ATTACHED.get(tiny_engine.model) is not None:  # its cache closed
        assert time.monotonic() < deadline, "the stream's decoding went on after its client left"
        time.sleep(0.05)
    assert tiny_engine.metrics.generated_tokens - before < 400
    after = client(server).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3, temperature=0)
    assert after.choices[0].text == alone(tiny_engine, PROMPTS[0], 3)


def test_metrics_and_health(server):
    client(server).completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3, temperature=0)
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    text = httpx.get(server + "/metrics").text
    for name in (
        "infinigen_requests_waiting 0",
        "infinigen_requests_running 0",
        'infinigen_requests_total{status="2xx"}',
        "infinigen_time_to_first_token_seconds_count",
        'infinigen_inter_token_latency_seconds_bucket{le="+Inf"}',
        "infinigen_last_planned_peak_gpu_bytes",
        "infinigen_last_planned_host_bytes",
    ):
        assert name in text
    generated = next(line for line in text.splitlines() if line.startswith("infinigen_generated_tokens_total"))
    assert int(generated.split()[1]) >= 3


def test_chat_through_the_tokenizers_template(smollm2, smollm2_artifact):
    engine = Engine(smollm2.model, smollm2.tokenizer, smollm2_artifact, {}, "smollm2-135m")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with serving(engine) as url:
        answer = client(url).chat.completions.create(
            model="smollm2-135m", messages=messages, max_completion_tokens=8, temperature=0
        )
        pieces = client(url).chat.completions.create(
            model="smollm2-135m", messages=messages, max_tokens=8, temperature=0, stream=True
        )
        streamed = [c.choices[0].delta for c in pieces if c.choices]
    text = smollm2.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = smollm2.tokenizer(text, add_special_tokens=False)["input_ids"]
    with cache_for(smollm2.model, smollm2_artifact) as cache:
        new, _ = generate_ids(smollm2.model, smollm2.tokenizer, [ids], cache, max_new_tokens=8)
    expected = smollm2.tokenizer.decode(new[0], skip_special_tokens=True)
    assert answer.choices[0].message.content == expected and answer.choices[0].message.role == "assistant"
    assert streamed[0].role == "assistant" and "".join(d.content or "" for d in streamed) == expected
    assert answer.usage.prompt_tokens == len(ids)


def test_serve_refuses_bad_command_lines_in_one_line():
    result = invoke("serve", "--port", "70000")
    assert result.exit_code == 2 and "--port must be in 1..65535" in result.output
    result = invoke("serve", "--artifact", "missing-artifact-folder/")
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    result = invoke("serve", "--prompt-cache-dir", "prompts/", "--prompt-cache-gb", "0")
    assert result.exit_code == 2 and "--prompt-cache-dir needs" in result.output


def test_sigterm_drains_the_running_request_refuses_new_ones_and_exits(prepared):
    """The real command line in its own process: a stream running when SIGTERM comes ends whole; a request
    sent while it drains gets a 503 with an error body; the kept prompt is written to its directory; then the
    server exits, without a traceback."""
    folder, artifact = prepared("llama")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "infinigen", "serve", str(folder), "--artifact", str(artifact)]
    prompts = folder.parent / "prompts"  # where the kept prompts go as it drains
    command += ["--port", str(port), "--served-name", "tiny", "--device", "cpu", "--prompt-cache-dir", str(prompts)]
    command += ["--prefill-chunk", "16"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()[-2000:]
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        document = " ".join(PROMPTS * 2)  # over one prefill chunk: kept
        body = {"model": "tiny", "prompt": document, "max_tokens": 300, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as reply:
            lines = reply.iter_lines()
            first = next(lines)
            process.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "a"}, timeout=30)
            rest = [first, *(line for line in lines if line)]
        assert refused.status_code == 503 and refused.json()["error"]["message"] == "the server is shutting down"
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: ") :])["choices"][0]["finish_reason"] == "length"
        # uvicorn re-raises the signal it drained for once it is done (exits as SIGTERM's default would)
        assert process.wait(60) in (0, -signal.SIGTERM)
        assert "Traceback" not in process.stderr.read()
        (written,) = prompts.glob("*.prompt")
        assert invoke("inspect", str(written)).exit_code == 0
    finally:
        if process.poll() is None:
            process.kill()


def test_a_kept_prompt_serves_the_next_question_with_the_cold_tokens(tiny_engine):
    model, tokenizer, artifact = tiny_engine.model, tiny_engine.tokenizer, tiny_engine.artifact
    kept = Engine(model, tokenizer, artifact, {"prompt_cache_gb": 1, "block_tokens": 16}, "tiny", prefill_chunk=16)
    document = " ".join(PROMPTS * 2)
    questions = [document + " where is it", document + " who is she"]
    length = len(tokenizer(document)["input_ids"])
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
            assert answer.usage.prompt_tokens_details.cached_tokens == (0 if i == 0 else length // 16 * 16)
        metrics = httpx.get(url + "/metrics").text
    assert f"infinigen_prompt_tokens_cached_total {length // 16 * 16}" in metrics
    assert "infinigen_kept_prompts 2" in metrics


def _asked(engine: Engine, prompt: str, max_tokens: int, **fields) -> tuple:
    from infinigen.serve.protocol import parse

    ask = parse({"model": engine.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields}, False)
    return ask, engine.admit(ask)


def _in_threads(engine: Engine, requests: list[tuple], first_blocks: bool = True) -> list:
    """``engine.run`` for each (ask, admitted, on_text, stopped) in its own thread, the first started alone and
    running before the others arrive (so that they wait together); each one's answer or error."""
    results: list = [None] * len(requests)

    def run(i: int) -> None:
        try:
            results[i] = engine.run(*requests[i])
        except Exception as exc:  # noqa: BLE001 (the test reads it)
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    threads[0].start()
    deadline = time.monotonic() + 60
    while first_blocks and not engine.metrics.active:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for thread in threads[1:]:
        thread.start()
    for thread in threads:
        thread.join(300)
    return results


def test_waiting_requests_are_batched_and_each_gets_its_tokens_alone(tiny_engine, solo_engine):
    """Eight requests of different prompts and lengths arriving while one runs decode in batches the plan
    admits, each ending at its own max_tokens with the tokens it gets alone."""
    prompts = [PROMPTS[i % 4] + " and" * i for i in range(8)]
    lengths = [40] + [3 + i for i in range(1, 8)]
    before = (tiny_engine.metrics.batches, tiny_engine.metrics.batched_rows)
    asked = [_asked(tiny_engine, p, n) for p, n in zip(prompts, lengths, strict=True)]
    answers = _in_threads(tiny_engine, [(ask, admitted, lambda text: None) for ask, admitted in asked])
    batches = tiny_engine.metrics.batches - before[0]
    assert tiny_engine.metrics.batched_rows - before[1] == 8 and batches == 2, "the seven waiting ones together"
    for answer, prompt, n in zip(answers, prompts, lengths, strict=True):
        assert answer == solo(solo_engine, prompt, n)
    assert answers[0].completion_tokens == 40 and answers[7].completion_tokens == 10, "each to its own length"
    assert tiny_engine.metrics.queued == tiny_engine.metrics.active == 0


def test_a_row_whose_client_leaves_stops_and_its_batch_mates_go_on(tiny_engine, solo_engine):
    asked = itertools.count()  # the leaving client's stopped(): asked as its batch forms, then at every step
    first = _asked(tiny_engine, PROMPTS[0], 30)
    leaving = _asked(tiny_engine, PROMPTS[1], 30)
    staying = _asked(tiny_engine, PROMPTS[2], 12)
    requests = [(*first, lambda text: None), (*leaving, lambda text: None, lambda: next(asked) >= 3)]
    requests.append((*staying, lambda text: None))
    answers = _in_threads(tiny_engine, requests)
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
    requests = [(*_asked(tiny_engine, p, n), lambda text: None) for p, n in [(PROMPTS[0], 20), (poison, 4)]]
    requests += [(*_asked(tiny_engine, p, 5), lambda text: None) for p in PROMPTS[1:3]]
    answers = _in_threads(tiny_engine, requests)
    assert sizes == [1, 3, 1, 1, 1], "the failed batch's rows again alone"
    assert isinstance(answers[1], RuntimeError)
    for answer, (ask, _, _) in zip(answers, requests, strict=True):
        if ask.prompt != poison:
            assert answer == solo(solo_engine, ask.prompt, ask.max_tokens)


def test_with_kept_prompts_long_requests_run_alone_and_are_kept_short_ones_batch(tiny_engine):
    """Over one prefill chunk a request runs alone (so that its prompt is kept whole for the next question);
    shorter ones share batches."""
    model, tokenizer, artifact = tiny_engine.model, tiny_engine.tokenizer, tiny_engine.artifact
    kept = Engine(model, tokenizer, artifact, {"prompt_cache_gb": 1, "block_tokens": 16}, "tiny", prefill_chunk=16)
    long = [" ".join(PROMPTS[i:] + PROMPTS[:i]) for i in range(3)]  # 30-odd tokens each
    requests = [(*_asked(kept, p, 12), lambda text: None) for p in [PROMPTS[0], *long, *PROMPTS[1:]]]
    answers = _in_threads(kept, requests)
    assert all(a.completion_tokens for a in answers)
    assert kept.metrics.batches == 5 and kept.metrics.batched_rows == 7, "three long ones alone, three short together"
    assert len(kept.prompts) == 3


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
    asked = document + " who is she"
    warm = solo(second, asked, 6)
    assert warm.cached_tokens > 0 and warm.text == solo(cold, asked, 6).text
    second.prompts.clear()
    second.save_prompts()
    assert not path.exists() and (tmp_path / "damaged.prompt").exists(), "what the cache no longer holds goes"


def test_streamed_text_detokenised_incrementally_is_the_whole_decode(smollm2):
    """Each token's piece comes from decoding a few tokens, yet the pieces make the whole answer's decode:
    accents, a character split over several tokens, a stop string found across pieces."""
    from infinigen.serve.engine import Tokens

    tokenizer = smollm2.tokenizer
    text = "Ça coûte 12 €, naïve café 🙂 über straße — ok. The end"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces: list[str] = []
    tokens = Tokens(tokenizer, (), pieces.append, set(), limit=len(ids) + 1)
    for token in ids:
        tokens.put(token)
    tokens.end()
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == tokens.text
    assert len(pieces) > len(ids) // 2 and not any("\ufffd" in piece for piece in pieces)
    stopped: list[str] = []
    tokens = Tokens(tokenizer, ("ok.",), stopped.append, set(), limit=len(ids) + 1)
    for token in ids:
        tokens.put(token)
    assert tokens.finish_reason == "stop" and "".join(stopped) == text[: text.index("ok.")]


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
    answers = _in_threads(paged, [(*_asked(paged, p, 8), lambda text: None) for p in prompts])
    assert paged.metrics.batches == 3, "the first alone, the next two of 9 tokens together, the 6 apart"
    assert answers == [solo(one, p, 8) for p in prompts]
