"""The server tests' helpers: an app on 127.0.0.1 in a thread, the openai client, what a request gets alone."""

from __future__ import annotations

import contextlib
import threading
import time

import openai
import uvicorn

from infinigen.runtime import cache_for
from infinigen.runtime.text import generate_ids
from infinigen.serve.app import make_app
from infinigen.serve.engine import Engine
from infinigen.serve.protocol import parse

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


def solo(engine: Engine, prompt: str, new_tokens: int):
    """What ``engine`` answers ``prompt`` with nothing else waiting."""
    return engine.run(*asked(engine, prompt, new_tokens), lambda text: None)


def client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def alone(engine: Engine, prompt: str, new_tokens: int, **settings) -> str:
    """The text the runtime gives ``prompt`` decoded alone with ``settings``, outside the server."""
    ids = engine.tokenizer(prompt)["input_ids"]
    with cache_for(engine.model, engine.artifact, **settings) as cache:
        new, _ = generate_ids(engine.model, engine.tokenizer, [ids], cache, max_new_tokens=new_tokens)
    return engine.tokenizer.decode(new[0], skip_special_tokens=True)


def asked(engine: Engine, prompt: str, max_tokens: int, **fields) -> tuple:
    """A greedy completion request for ``engine``, parsed and admitted."""
    ask = parse({"model": engine.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields}, False)
    return ask, engine.admit(ask)


def in_threads(engine: Engine, requests: list[tuple], first_blocks: bool = True) -> list:
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
