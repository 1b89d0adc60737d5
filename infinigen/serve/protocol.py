"""Requests as the ``openai`` package sends them, checked into one ``Ask``; responses as its types read them.

Every field a client may send is named here: the ones served, and those refused where they ask for more
than is served (``n`` > 1, tools, log-probabilities, penalties), each with a 400 that names it. A field the
API does not have is refused too: a typo is not silently ignored.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from infinigen.runtime.text import Sampling


class RequestError(Exception):
    """A request the server refuses: its HTTP status (4xx), message, and the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None):
    """The OpenAI API's error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "stop", "seed", "user", "n"}
COMMON |= {"ignore_eos"}  # vLLM's: load tools (guidellm, vLLM's benchmarks) send it to get max_tokens tokens
# sent by clients with their defaults: refused only where they ask for more than that
DEFAULTS = {
    "n": 1,
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None,),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "response_format": (None, {"type": "text"}),
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "metadata": (None, {}),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
}
COMPLETION_FIELDS = COMMON | {"prompt", "logprobs", "echo", "best_of", "suffix"}
COMPLETION_FIELDS |= {"presence_penalty", "frequency_penalty", "logit_bias"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens"} | (set(DEFAULTS) - {"echo", "best_of", "suffix"})


@dataclass(frozen=True)
class Ask:
    """One request as the engine runs it."""

    chat: bool
    model: str
    prompt: str | None = None  # a completion's text
    messages: tuple[dict, ...] = ()  # a chat's, in the tokenizer's chat template
    max_tokens: int | None = None  # None: up to the model's context
    sampling: Sampling = Sampling()
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    ignore_eos: bool = False  # decode past the model's end tokens, to max_tokens
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


def parse(body: Any, chat: bool) -> Ask:
    """A request body (parsed JSON) as an ``Ask``; ``RequestError`` naming the first field at fault."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(f"unknown or unsupported field(s): {', '.join(unknown)}", unknown[0])
    for name, accepted in DEFAULTS.items():
        if name in body and body[name] not in (accepted if isinstance(accepted, tuple) else (accepted,)):
            what = "n > 1" if name == "n" else name
            raise RequestError(f"{what} is not supported by this server", name)
    model = _typed(body, "model", str, required=True)
    stream = _typed(body, "stream", bool) or False
    options = _typed(body, "stream_options", dict) or {}
    if options and not stream:
        raise RequestError("stream_options needs stream: true", "stream_options")
    limit = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _typed(body, limit, int)
    if max_tokens is not None and max_tokens < 1:
        raise RequestError(f"{limit} must be at least 1, got {max_tokens}", limit)
    temperature = _number(body, "temperature", 1.0)  # the API's default: sampling
    top_p = _number(body, "top_p", 1.0)
    if not 0 <= temperature <= 2:
        raise RequestError(f"temperature must be in [0, 2], got {temperature}", "temperature")
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}", "top_p")
    seed = _typed(body, "seed", int)
    sampling = Sampling(temperature=temperature, top_p=top_p, seed=seed)
    common = dict(model=model, max_tokens=max_tokens, sampling=sampling, stop=_stop(body.get("stop")), stream=stream)
    common["include_usage"] = bool(options.get("include_usage"))
    common["ignore_eos"] = bool(_typed(body, "ignore_eos", bool))
    if chat:
        return Ask(chat=True, messages=_messages(body.get("messages")), **common)
    return Ask(chat=False, prompt=_prompt(body.get("prompt")), **common)


def _typed(body: dict, name: str, kind: type, required: bool = False):
    value = body.get(name)
    if value is None:
        if required:
            raise RequestError(f"{name} is required", name)
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RequestError(f"{name} must be of type {kind.__name__}, got {type(value).__name__}", name)
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name} must be a number, got {type(value).__name__}", name)
    return float(value)


def _stop(value) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("stop must be a non-empty string or a list of at most 4 of them", "stop")
    return tuple(stops)


def _prompt(value) -> str:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if isinstance(value, list):
        raise RequestError("prompt must be one string (batches of prompts: one request each)", "prompt")
    if not isinstance(value, str) or not value:
        raise RequestError("prompt must be a non-empty string", "prompt")
    return value


def _messages(value) -> tuple[dict, ...]:
    if not isinstance(value, list) or not value:
        raise RequestError("messages must be a non-empty list", "messages")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a role", "messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text ones only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise RequestError(f"messages[{i}]: only text content is supported", "messages")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string", "messages")
        messages.append({"role": message["role"], "content": content})
    return tuple(messages)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def response(ask: Ask, text: str, finish_reason: str, used: dict) -> dict:
    """The whole response of a request that does not stream."""
    if ask.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        kind = "text_completion"
    base = {"id": _id(ask), "object": kind, "created": ask.created, "model": ask.model}
    return base | {"choices": [choice], "usage": used}


def chunk(ask: Ask, text: str | None, finish_reason: str | None = None, used: dict | None = None, first=False) -> dict:
    """One server-sent event's data while streaming: a piece of text, the end (``finish_reason``), or the usage."""
    if ask.chat:
        delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text is not None else {})
        choices = [{"index": 0, "delta": delta, "finish_reason": finish_reason}]
        kind = "chat.completion.chunk"
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]
        kind = "text_completion"
    base = {"id": _id(ask), "object": kind, "created": ask.created, "model": ask.model}
    if used is not None:
        return base | {"choices": [], "usage": used}
    return base | {"choices": choices} | ({"usage": None} if ask.include_usage else {})


def _id(ask: Ask) -> str:
    return ("chatcmpl-" if ask.chat else "cmpl-") + ask.id
