"""A deterministic OpenAI-compatible upstream speaking vLLM's schema, for protocol, fault and load tests.

Run it as a real HTTP server process (the fixture ``upstream_sim`` in ``tests/fixtures_upstream.py`` does)::

    python tests/upstream_sim.py --port 8101 [--host 127.0.0.1] [--delay-ms 0] [--chunk-delay-ms 0]
                                 [--fail-mode none] [--model sim-model] [--hang-s 30]

Endpoints (shapes follow vLLM 0.32's OpenAI server, ``--reasoning-parser qwen3``):

- ``POST /v1/chat/completions`` and ``POST /v1/completions``, streamed (SSE, ``data: …``, ``data: [DONE]``)
  and not; ``n``, ``stop``, ``max_tokens``/``max_completion_tokens``, ``stream_options.include_usage``.
  Chat answers carry ``message.reasoning`` (streams: ``delta.reasoning``) and ``usage`` with
  ``completion_tokens_details.reasoning_tokens``.
- ``POST /tokenize`` ``{"prompt"}`` or ``{"messages"}`` → ``{"count", "tokens", "max_model_len"}``.
- ``GET /health``, ``GET /v1/models``.
- ``GET /sim/stats`` → process counters; ``GET /sim/requests/{tag}`` → what a tagged request did
  (``attempts``, ``status``: running|completed|cancelled|failed, last ``body`` received, ``chunks_sent``).

Determinism. A "token" is a whitespace-separated word. For a prompt text P (chat: message texts joined
with newlines; completions: the prompt):

- ``prompt_tokens`` = words(P) (+ 3 per message for chat, standing in for the chat template);
- reasoning = :func:`reasoning_words` (P): 16 + words(P) mod 16 words cycled from P, lower-cased; none when
  ``chat_template_kwargs.enable_thinking`` is false or ``reasoning_effort`` is ``none``; cut to
  ``thinking_token_budget`` words when that is >= 0;
- answer = :func:`answer_words` (P): ``"echo:"`` + the first 32 words of the last user turn (the prompt for
  completions);
- ``max_tokens`` (or ``max_completion_tokens``) caps reasoning + answer words, reasoning first
  (``finish_reason: "length"``); a ``stop`` string cuts the answer text (``finish_reason: "stop"``);
- completions put the reasoning inline: ``"<reasoning> </think> <answer>"``.

Faults, per process (``--fail-mode``) or per request (header ``x-sim-fail`` or body field
``"sim": {"fail": MODE}`` — the body field survives a gateway that passes unknown fields through):

- ``500`` / ``502`` / ``503``: answer that status with an OpenAI error body;
- ``timeout``: send nothing for ``--hang-s`` seconds (stops early when the client goes away);
- ``drop``: streams: send half the chunks, then abort the connection; non-streams: abort before answering;
- ``stall``: streams: send half the chunks, then hang;
- ``error-event``: streams: half the chunks, then a vLLM-style ``data: {"error": …}`` event and the end;
- ``no-reasoning-count``: omit ``completion_tokens_details`` from usage (reasoning text still sent);
- ``none``: no fault (overrides the process mode).

``"sim": {"fail_times": K, "tag": T}`` applies the fault only to the first K attempts of tag T (retry
tests). ``"sim": {"delay_ms", "chunk_delay_ms"}`` (or headers ``x-sim-delay-ms``, ``x-sim-chunk-delay-ms``)
set the delay before the answer (cut short, and recorded as ``cancelled``, when the client goes away) and
between stream chunks. Refused connections need no mode: point a tier
at a free port where nothing listens.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

REASONING_BASE_WORDS = 16
ANSWER_MAX_WORDS = 32
CHAT_TOKENS_PER_MESSAGE = 3
MAX_MODEL_LEN = 4096


class SimAbort(Exception):
    """Raised inside a response to make the server abort the connection (the ``drop`` fault)."""


# ---------------------------------------------------------------- deterministic content


def text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def chat_prompt(messages: list[dict[str, Any]]) -> str:
    """The prompt text of a chat request: every message's text, joined with newlines."""
    return "\n".join(text_of(m.get("content")) for m in messages)


def last_user(messages: list[dict[str, Any]]) -> str:
    return next((text_of(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")


def reasoning_words(prompt: str) -> list[str]:
    """The full (unbudgeted) thought for ``prompt``: 16 + words mod 16 words cycled from the prompt."""
    words = [w.lower() for w in prompt.split()] or ["hmm"]
    n = REASONING_BASE_WORDS + len(prompt.split()) % 16
    return [words[i % len(words)] for i in range(n)]


def answer_words(user_text: str) -> list[str]:
    """The answer for a last user turn: ``echo:`` followed by its first 32 words."""
    return ["echo:", *user_text.split()[:ANSWER_MAX_WORDS]]


def prompt_tokens(body: dict[str, Any]) -> int:
    if isinstance(body.get("messages"), list):
        msgs = body["messages"]
        return len(chat_prompt(msgs).split()) + CHAT_TOKENS_PER_MESSAGE * len(msgs)
    return len(completion_prompt(body).split())


def completion_prompt(body: dict[str, Any]) -> str:
    p = body.get("prompt")
    if isinstance(p, list):
        return " ".join(str(x) for x in p)
    return str(p or "")


@dataclass
class Generation:
    """One choice's output: reasoning words, answer text, finish reason and token counts."""

    reasoning: list[str]
    answer: list[str]
    finish_reason: str

    @property
    def answer_text(self) -> str:
        return " ".join(self.answer)

    @property
    def completion_tokens(self) -> int:
        return len(self.reasoning) + len(self.answer)


def generate(body: dict[str, Any], chat: bool) -> Generation:
    """Apply the request's thinking switch, thinking budget, max_tokens and stop to the fixed output."""
    if chat:
        prompt, user = chat_prompt(body["messages"]), last_user(body["messages"])
    else:
        prompt = user = completion_prompt(body)
    thinking = (body.get("chat_template_kwargs") or {}).get("enable_thinking", True) is not False
    thinking = thinking and body.get("reasoning_effort") != "none"
    reasoning = reasoning_words(prompt) if thinking else []
    budget = body.get("thinking_token_budget")
    if isinstance(budget, int) and budget >= 0:
        reasoning = reasoning[:budget]
    answer = answer_words(user)
    finish = "stop"
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if isinstance(limit, int):
        if len(reasoning) >= limit:
            reasoning, answer, finish = reasoning[:limit], [], "length"
        elif len(reasoning) + len(answer) > limit:
            answer, finish = answer[: limit - len(reasoning)], "length"
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    text = " ".join(answer)
    cut = min((i for s in stops if s and (i := text.find(s)) >= 0), default=-1)
    if cut >= 0:
        answer, finish = text[:cut].split(), "stop"
    return Generation(reasoning, answer, finish)


def usage_of(body: dict[str, Any], gens: list[Generation], chat: bool, with_count: bool) -> dict[str, Any]:
    completion = sum(g.completion_tokens for g in gens)
    if not chat:  # completions carry the "</think>" word inline
        completion += sum(1 for g in gens if g.reasoning)
    prompt = prompt_tokens(body)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None,
    }
    if with_count:
        usage["completion_tokens_details"] = {"reasoning_tokens": sum(len(g.reasoning) for g in gens)}
    return usage


# ---------------------------------------------------------------- bookkeeping


@dataclass
class TagRecord:
    attempts: int = 0
    status: str = "running"
    chunks_sent: int = 0
    body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class SimState:
    model: str
    delay_ms: float
    chunk_delay_ms: float
    fail_mode: str
    hang_s: float
    counters: dict[str, int] = field(
        default_factory=lambda: {"requests": 0, "completed": 0, "cancelled": 0, "failed": 0, "tokenize": 0}
    )
    tags: dict[str, TagRecord] = field(default_factory=dict)


@dataclass
class Call:
    """The per-request view: the parsed body, the effective fault and delays, and its tag record."""

    body: dict[str, Any]
    fail: str
    delay_ms: float
    chunk_delay_ms: float
    tag: TagRecord | None

    def mark(self, state: SimState, status: str) -> None:
        state.counters[status] += 1
        if self.tag is not None:
            self.tag.status = status


def _error(status: int, message: str) -> Response:
    err = {"error": {"message": message, "type": "server_error", "param": None, "code": status}}
    return Response(orjson.dumps(err), status_code=status, media_type="application/json")


def make_app(state: SimState) -> Starlette:
    """The simulator's ASGI app over ``state`` (exposed for in-process use; the tests run it as a process)."""

    async def parse(request: Request) -> Call | Response:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            return _error(400, "invalid JSON")
        if not isinstance(body, dict):
            return _error(400, "body must be an object")
        state.counters["requests"] += 1
        sim = body.get("sim") if isinstance(body.get("sim"), dict) else {}
        h = request.headers
        fail = str(sim.get("fail") or h.get("x-sim-fail") or state.fail_mode)
        tag = None
        if sim.get("tag"):
            tag = state.tags.setdefault(str(sim["tag"]), TagRecord())
            tag.attempts += 1
            tag.status = "running"
            tag.body = body
            tag.headers = {k: v for k, v in h.items() if k.lower() != "authorization"}
            if isinstance(sim.get("fail_times"), int) and tag.attempts > sim["fail_times"]:
                fail = "none"
        delay = float(sim.get("delay_ms") or h.get("x-sim-delay-ms") or state.delay_ms)
        chunk_delay = float(sim.get("chunk_delay_ms") or h.get("x-sim-chunk-delay-ms") or state.chunk_delay_ms)
        return Call(body, fail, delay, chunk_delay, tag)

    async def pause(request: Request, seconds: float) -> bool:
        """Sleep ``seconds``; False as soon as the client has gone away (checked every 50 ms)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if await request.is_disconnected():
                return False
            await asyncio.sleep(min(0.05, left))
        return True

    async def hang(request: Request, call: Call) -> Response:
        if not await pause(request, state.hang_s):
            call.mark(state, "cancelled")
            return Response(b"", status_code=499)
        call.mark(state, "failed")
        return _error(504, "simulated hang ended")

    async def generation(request: Request, chat: bool) -> Response:
        parsed = await parse(request)
        if isinstance(parsed, Response):
            return parsed
        call = parsed
        if call.delay_ms > 0 and not await pause(request, call.delay_ms / 1000):
            call.mark(state, "cancelled")
            return Response(b"", status_code=499)
        if call.fail in ("500", "502", "503"):
            call.mark(state, "failed")
            return _error(int(call.fail), f"simulated upstream failure {call.fail}")
        if call.fail == "timeout":
            return await hang(request, call)
        body = call.body
        n = body.get("n") if isinstance(body.get("n"), int) else 1
        gens = [generate(body, chat)] * n
        stream = body.get("stream") is True
        if stream:
            return StreamingResponse(stream_events(request, call, gens, chat), media_type="text/event-stream")
        if call.fail == "drop":
            call.mark(state, "failed")
            return StreamingResponse(abort_after_headers(), media_type="application/json")
        with_count = call.fail != "no-reasoning-count"
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        choices: list[dict[str, Any]] = []
        for i, g in enumerate(gens):
            if chat:
                msg = {"role": "assistant", "content": g.answer_text, "reasoning": " ".join(g.reasoning) or None,
                       "tool_calls": []}
                choices.append({"index": i, "message": msg, "logprobs": None, "finish_reason": g.finish_reason,
                                "stop_reason": None})
            else:
                text = f"{' '.join(g.reasoning)} </think> {g.answer_text}" if g.reasoning else g.answer_text
                choices.append({"index": i, "text": text, "logprobs": None, "finish_reason": g.finish_reason,
                                "stop_reason": None, "prompt_logprobs": None})
        out = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model") or state.model,
            "choices": choices,
            "usage": usage_of(body, gens, chat, with_count and chat),
        }
        call.mark(state, "completed")
        return Response(orjson.dumps(out), media_type="application/json")

    async def stream_events(request: Request, call: Call, gens: list[Generation], chat: bool) -> AsyncIterator[bytes]:
        body = call.body
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        model = body.get("model") or state.model
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            c: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
            if usage is not None:
                c["usage"] = usage
            return b"data: " + orjson.dumps(c) + b"\n\n"

        events: list[bytes] = []
        for i, g in enumerate(gens):
            if chat:
                events.append(chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None}]))
                for j, w in enumerate(g.reasoning):
                    events.append(chunk([{"index": i, "delta": {"reasoning": (" " if j else "") + w},
                                          "logprobs": None, "finish_reason": None}]))
                for j, w in enumerate(g.answer):
                    events.append(chunk([{"index": i, "delta": {"content": (" " if j else "") + w},
                                          "logprobs": None, "finish_reason": None}]))
                events.append(chunk([{"index": i, "delta": {"content": ""}, "logprobs": None,
                                      "finish_reason": g.finish_reason, "stop_reason": None}]))
            else:
                words = [*g.reasoning, "</think>", *g.answer] if g.reasoning else g.answer
                for j, w in enumerate(words):
                    events.append(chunk([{"index": i, "text": (" " if j else "") + w, "logprobs": None,
                                          "finish_reason": None, "stop_reason": None}]))
                events.append(chunk([{"index": i, "text": "", "logprobs": None, "finish_reason": g.finish_reason,
                                      "stop_reason": None}]))
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append(chunk([], usage_of(body, gens, chat, chat and call.fail != "no-reasoning-count")))
        events.append(b"data: [DONE]\n\n")
        half = len(events) // 2
        done = False
        try:
            for k, ev in enumerate(events):
                if k == half and call.fail in ("drop", "stall", "error-event"):
                    if call.fail == "drop":
                        call.mark(state, "failed")
                        done = True
                        raise SimAbort("simulated mid-stream drop")
                    if call.fail == "error-event":
                        err = {"error": {"message": "simulated engine error", "type": "InternalServerError",
                                         "param": None, "code": 500}}
                        yield b"data: " + orjson.dumps(err) + b"\n\n"
                        call.mark(state, "failed")
                        done = True
                        return
                    await asyncio.sleep(state.hang_s)
                if k and call.chunk_delay_ms > 0:
                    await asyncio.sleep(call.chunk_delay_ms / 1000)
                yield ev
                if call.tag is not None:
                    call.tag.chunks_sent += 1
            call.mark(state, "completed")
            done = True
        finally:
            # Cancelled (client went away) or closed early: count it once.
            if not done and (call.tag is None or call.tag.status == "running"):
                call.mark(state, "cancelled")

    async def abort_after_headers() -> AsyncIterator[bytes]:
        # Raising once the response has started makes uvicorn close the connection mid-answer.
        raise SimAbort("simulated connection drop")
        yield b""  # pragma: no cover  (makes this an async generator)

    async def chat_completions(request: Request) -> Response:
        return await generation(request, chat=True)

    async def completions(request: Request) -> Response:
        return await generation(request, chat=False)

    async def tokenize(request: Request) -> Response:
        body = orjson.loads(await request.body())
        state.counters["tokenize"] += 1
        if isinstance(body.get("messages"), list):
            count = prompt_tokens(body)
        else:
            count = len(str(body.get("prompt", "")).split())
        return Response(orjson.dumps({"count": count, "max_model_len": MAX_MODEL_LEN, "tokens": list(range(count))}),
                        media_type="application/json")

    async def health(_: Request) -> Response:
        return Response(b"", status_code=200)

    async def models(_: Request) -> Response:
        data = {"object": "list", "data": [{"id": state.model, "object": "model", "created": 0, "owned_by": "sim",
                                            "max_model_len": MAX_MODEL_LEN}]}
        return Response(orjson.dumps(data), media_type="application/json")

    async def stats(_: Request) -> Response:
        return Response(orjson.dumps(state.counters), media_type="application/json")

    async def tag_record(request: Request) -> Response:
        rec = state.tags.get(request.path_params["tag"])
        if rec is None:
            return _error(404, "unknown tag")
        return Response(orjson.dumps(rec.__dict__), media_type="application/json")

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/health", health),
            Route("/v1/models", models),
            Route("/sim/stats", stats),
            Route("/sim/requests/{tag}", tag_record),
        ]
    )


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", default="sim-model")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="delay before every answer")
    ap.add_argument("--chunk-delay-ms", type=float, default=0.0, help="delay between stream chunks")
    ap.add_argument("--fail-mode", default="none",
                    choices=["none", "500", "502", "503", "timeout", "drop", "stall", "error-event",
                             "no-reasoning-count"])
    ap.add_argument("--hang-s", type=float, default=30.0, help="how long 'timeout'/'stall' hang")
    args = ap.parse_args()
    state = SimState(args.model, args.delay_ms, args.chunk_delay_ms, args.fail_mode, args.hang_s)
    uvicorn.run(make_app(state), host=args.host, port=args.port, log_level="critical", access_log=False)


if __name__ == "__main__":
    main()
