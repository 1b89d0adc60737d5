"""``make_app(engine)``: the OpenAI-compatible routes over an ``Engine`` (FastAPI; run by uvicorn).

``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true``: server-sent
events ending in ``data: [DONE]``), ``GET /health``, ``GET /metrics``. A request is read and admitted (its
plan made) before any response starts, so every refusal is a 4xx with the API's error body; decoding runs
on a worker thread, its text passed to the event loop as it comes. An error inside one request answers it
with a 5xx and its body (mid-stream: an error event), and the server goes on. ``run`` serves it with uvicorn:
SIGTERM (or Ctrl-C) drains it: running and waiting requests finish, new ones get a 503, the kept prompts are
written to their directory where one is given, then it exits (a second signal: at once).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from infinigen.errors import InfinigenError
from infinigen.serve.engine import Answer, Engine
from infinigen.serve.protocol import Ask, RequestError, chunk, error_body, parse, response, usage

log = logging.getLogger("infinigen.serve")  # the server's own faults, with their tracebacks, on stderr
MAX_BODY_BYTES = 16 << 20  # a 128K-token prompt is about 0.5 MB of text


def make_app(engine: Engine, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="infinigen", docs_url=None, redoc_url=None)
    app.state.engine = engine
    started = int(time.time())

    @app.middleware("http")
    async def bounded_and_counted(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body_bytes):
            reply = failed(RequestError(f"the request body exceeds {max_body_bytes} bytes", status=413))
        elif engine.draining and request.method == "POST":
            reply = failed(RequestError("the server is shutting down", status=503, kind="server_error"))
        else:
            reply = await call_next(request)
        if request.url.path.startswith("/v1/"):
            engine.metrics.answered(reply.status_code)
        return reply

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return failed(exc)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(engine.metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        model = {"id": engine.name, "object": "model", "created": started, "owned_by": "infinigen"}
        return {"object": "list", "data": [model]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(engine, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(engine, request, chat=True)

    return app


class Draining(uvicorn.Server):
    """uvicorn's server, whose first exit signal drains the engine before it stops."""

    def __init__(self, config: uvicorn.Config, engine: Engine) -> None:
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        if self.engine.draining:  # a second signal: now
            super().handle_exit(sig, frame)
            return
        self.engine.draining = True
        threading.Thread(target=self._exit_when_idle, args=(sig, frame), daemon=True).start()

    def _exit_when_idle(self, sig, frame) -> None:
        while self.engine.metrics.queued or self.engine.metrics.active:
            time.sleep(0.05)
        try:  # the kept prompts to their directory, where one is given, before the process goes
            self.engine.save_prompts()
        except InfinigenError as exc:
            log.error("kept prompts not saved: %s", exc)
        super().handle_exit(sig, frame)


def run(engine: Engine, host: str, port: int) -> None:
    """Serve ``engine`` on ``host:port`` until a signal drains it."""
    Draining(uvicorn.Config(make_app(engine), host=host, port=port, log_level="warning"), engine).run()


def failed(exc: BaseException) -> JSONResponse:
    """The error body of a refused (``RequestError``) or failed request."""
    if isinstance(exc, RequestError):
        return JSONResponse(error_body(exc.message, exc.kind, exc.param), status_code=exc.status)
    log.error("a request failed", exc_info=exc)
    if isinstance(exc, torch.OutOfMemoryError):
        torch.cuda.empty_cache()  # the failed request's blocks back to the device
        return JSONResponse(error_body("out of GPU memory in this request", "server_error"), status_code=503)
    return JSONResponse(error_body(f"{type(exc).__name__}: {exc}", "server_error"), status_code=500)


async def serve(engine: Engine, request: Request, chat: bool):
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return failed(RequestError("the request body is not valid JSON"))
    try:
        ask = parse(body, chat)
        admitted = await run_in_threadpool(engine.admit, ask)
    except RequestError as exc:
        return failed(exc)
    if ask.stream:
        return StreamingResponse(streamed(engine, ask, admitted), media_type="text/event-stream")
    gone = threading.Event()
    watch = asyncio.create_task(_watch(request, gone))
    try:
        answer: Answer = await run_in_threadpool(engine.run, ask, admitted, lambda text: None, gone.is_set)
    except Exception as exc:
        return failed(exc)
    finally:
        watch.cancel()
    return response(ask, answer.text, answer.finish_reason, _usage(answer))


async def _watch(request: Request, gone: threading.Event) -> None:
    """Sets ``gone`` once the client of a request that does not stream disconnects."""
    while not gone.is_set():
        if await request.is_disconnected():
            gone.set()
        await asyncio.sleep(0.1)


async def streamed(engine: Engine, ask: Ask, admitted: tuple) -> AsyncIterator[str]:
    """The server-sent events of a streamed request; a client gone ends its decoding at the next step."""
    loop, pieces, gone = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()

    def on_text(text: str) -> None:
        loop.call_soon_threadsafe(pieces.put_nowait, text)

    def decoded():
        try:
            return engine.run(ask, admitted, on_text, gone.is_set)
        finally:
            loop.call_soon_threadsafe(pieces.put_nowait, None)

    work = asyncio.ensure_future(run_in_threadpool(decoded))
    try:
        if ask.chat:  # the first chunk names the role, as OpenAI's does
            yield _event(chunk(ask, "", first=True))
        while (text := await pieces.get()) is not None:
            yield _event(chunk(ask, text))
        try:
            answer = await work
        except Exception as exc:
            yield _event(json.loads(failed(exc).body))
            return
        yield _event(chunk(ask, None, answer.finish_reason))
        if ask.include_usage:
            yield _event(chunk(ask, None, used=_usage(answer)))
        yield "data: [DONE]\n\n"
    finally:
        gone.set()  # a client that left: the decoding stops at its next step (its cache closed, memory freed)


def _event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _usage(answer: Answer) -> dict:
    return usage(answer.prompt_tokens, answer.completion_tokens, answer.cached_tokens)
