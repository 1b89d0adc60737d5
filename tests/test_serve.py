"""``infinigen serve``: the ``openai`` client against a server on 127.0.0.1 (a tiny random model; SmolLM2 for chat),
every answer the tokens the runtime gives the request alone; bad requests are 4xx with an error body. Batching,
kept prompts and Ray Serve: test_serve_batches.py."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from conftest import invoke

pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from serving import PROMPTS, alone, client, serving  # noqa: E402

from infinigen.runtime import cache_for  # noqa: E402
from infinigen.runtime.cache.hooks import _ATTACHED  # noqa: E402
from infinigen.runtime.text import generate_ids  # noqa: E402
from infinigen.serve.engine import Engine  # noqa: E402


@pytest.fixture(scope="module")
def server(tiny_engine):
    with serving(tiny_engine) as url:
        yield url


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


def test_ignore_eos_decodes_past_the_end_tokens_to_max_tokens(server, tiny_engine, monkeypatch):
    """vLLM's ``ignore_eos``, which load tools send for answers of a set length: an end token the model gives
    ends the answer without it, and with the field the answer goes on to ``max_tokens``."""
    ids = tiny_engine.tokenizer(PROMPTS[3])["input_ids"]
    with cache_for(tiny_engine.model, tiny_engine.artifact) as cache:
        new, _ = generate_ids(tiny_engine.model, tiny_engine.tokenizer, [ids], cache, max_new_tokens=8)
    tokens = new[0].tolist()
    end = next(i for i in range(1, 8) if tokens[i] not in tokens[:i])  # a token given first at step ``end``
    monkeypatch.setattr(tiny_engine, "ends", {tokens[end]})  # an end token
    asked = dict(model="tiny", prompt=PROMPTS[3], max_tokens=8, temperature=0)
    ended = client(server).completions.create(**asked)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == end
    assert ended.choices[0].text == tiny_engine.tokenizer.decode(tokens[:end], skip_special_tokens=True)
    whole = client(server).completions.create(**asked, extra_body={"ignore_eos": True})
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 8
    assert whole.choices[0].text == tiny_engine.tokenizer.decode(tokens, skip_special_tokens=True)


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
    ("/v1/completions", {"model": "tiny", "prompt": "a", "ignore_eos": "yes"}, 400, "ignore_eos"),
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
