"""An OpenAI-compatible upstream that answers with recorded reasoning-model outputs (trace replay).

Run it as its own process on loopback (the bench and the tests do)::

    python -m bench.traces.replay_upstream --traces DIR --dataset frames --model Qwen3-14B --setting no_think \
        --port 8101
    python -m bench.traces.replay_upstream --traces DIR --dataset frames --ladder Qwen3-14B:no_think,exd0 --port 8101

It serves every (model, setting) it is given under the model name ``MODEL:SETTING`` (one process serves a
whole ladder; with a single pair the bare ``MODEL`` is accepted too). The recordings are
``DIR/<dataset>/<MODEL>__<SETTING>.jsonl.gz`` (fields ``id``, ``question``, ``response``, ``thought``,
``reasoning_tokens``, ``completion_tokens``; see ``data/traces/README.md``).

``POST /v1/chat/completions`` (vLLM's schema). The **last user message** (string content, or the text parts of
a list) is looked up among the recorded questions after whitespace normalisation (runs of whitespace → one
space, ends stripped); the system prompt and earlier turns are ignored, and so are sampling fields,
``max_tokens`` and thinking switches (a recording is served as recorded, never regenerated or cut). A hit answers

- ``message.content`` = the recorded ``response``; ``message.reasoning`` = the recorded ``thought`` (vLLM's
  field) when it is non-empty, else absent;
- ``finish_reason: "stop"`` (the recordings carry no finish reason);
- ``usage.completion_tokens`` = the recorded ``completion_tokens``;
  ``usage.completion_tokens_details.reasoning_tokens`` = the recorded ``reasoning_tokens`` (the details object
  is left out where the provider reported none — the gateway then counts the reasoning text itself);
  ``usage.prompt_tokens`` = an **estimate** (no tokenizer for these models here): per message
  ⌈characters / 4⌉ + 4, plus 3 for the reply's priming — OpenAI's rule of thumb of ~4 characters per token and
  its cookbook's per-message overhead for chat formats.

With ``stream: true`` the same answer goes out as SSE (``data: {chunk}\\n\\n`` … ``data: [DONE]\\n\\n``): a role
chunk, the thought in ``delta.reasoning`` pieces, the answer in ``delta.content`` pieces (``--chunk-chars``
characters each), a finish chunk, and — when ``stream_options.include_usage`` — a last chunk with
``choices: []`` and the ``usage`` above.

Errors are OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``): an unknown question or model
is **404** (``question_not_recorded`` / ``model_not_found``) — never a made-up answer; a bad body is 400.
Also ``GET /health``, ``GET /v1/models`` and ``GET /replay/stats`` (hits, misses, streams: process counters).
"""

from __future__ import annotations

import argparse
import hashlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from router.jsonl import read_jsonl
from router.window import message_text

CHARS_PER_TOKEN = 4
TOKENS_PER_MESSAGE = 4
REPLY_PRIMING_TOKENS = 3
CHUNK_CHARS = 16


def normalize(text: str) -> str:
    """The lookup form of a question: runs of whitespace become one space, ends stripped."""
    return " ".join(text.split())


def estimate_prompt_tokens(messages: list[dict[str, Any]]) -> int:
    """Prompt tokens of a chat request without a tokenizer: Σ (⌈chars/4⌉ + 4) over messages, + 3."""
    total = REPLY_PRIMING_TOKENS
    for m in messages:
        text = message_text(m.get("content"))
        total += -(-len(text) // CHARS_PER_TOKEN) + TOKENS_PER_MESSAGE
    return total


@dataclass(frozen=True)
class Recorded:
    """One recorded answer: question id, answer text, thought (may be empty), token counts."""

    qid: str
    response: str
    thought: str
    completion_tokens: int
    reasoning_tokens: int | None


def load_recordings(traces: Path, dataset: str, model: str, setting: str) -> dict[str, Recorded]:
    """``{normalised question: Recorded}`` of one trace file. Raises FileNotFoundError naming the file.

    Two recorded rows with the same normalised question keep the first by file order (none do in the shipped
    traces)."""
    path = Path(traces) / dataset / f"{model}__{setting}.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(f"no recording for {model}:{setting} in {dataset}: {path} does not exist")
    out: dict[str, Recorded] = {}
    for row in read_jsonl(path):
        q = normalize(str(row["question"]))
        rt = row.get("reasoning_tokens")
        out.setdefault(q, Recorded(str(row["id"]), str(row.get("response") or ""), str(row.get("thought") or ""),
                                   int(row.get("completion_tokens") or 0), None if rt is None else int(rt)))
    return out


@dataclass
class ReplayState:
    """What the server serves: ``{served model name: {normalised question: Recorded}}`` and counters."""

    dataset: str
    models: dict[str, dict[str, Recorded]]
    chunk_chars: int = CHUNK_CHARS
    aliases: dict[str, str] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=lambda: {"requests": 0, "hits": 0, "misses": 0, "streams": 0})

    def lookup_model(self, name: Any) -> str | None:
        if isinstance(name, str):
            if name in self.models:
                return name
            return self.aliases.get(name)
        return None


def build_state(traces: Path, dataset: str, pairs: list[tuple[str, str]],
                chunk_chars: int = CHUNK_CHARS) -> ReplayState:
    """Load every (model, setting) pair; served names ``MODEL:SETTING`` (a lone pair also answers to ``MODEL``)."""
    models = {f"{m}:{s}": load_recordings(traces, dataset, m, s) for m, s in pairs}
    aliases = {pairs[0][0]: f"{pairs[0][0]}:{pairs[0][1]}"} if len(pairs) == 1 else {}
    return ReplayState(dataset, models, chunk_chars, aliases)


def error(status: int, message: str, code: str, param: str | None = None,
          kind: str = "invalid_request_error") -> Response:
    """An OpenAI-shaped error response."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def usage_of(rec: Recorded, prompt_tokens: int) -> dict[str, Any]:
    """The usage object of one recorded answer (see the module doc)."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": rec.completion_tokens,
        "total_tokens": prompt_tokens + rec.completion_tokens,
    }
    if rec.reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": rec.reasoning_tokens}
    return usage


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def _recorded(state: ReplayState, body: Any) -> tuple[str, Recorded, list[dict[str, Any]]] | Response:
    """``(served model, recorded answer, message dicts)`` of a chat request body, or the error response (400: no
    messages or no user message; 404: unknown model, question not recorded)."""
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return error(400, "'messages' must be a list", "invalid_request", "messages")
    model = state.lookup_model(body.get("model"))
    if model is None:
        return error(404, f"model {body.get('model')!r} is not served here (served: {sorted(state.models)})",
                     "model_not_found", "model")
    msgs = [m for m in body["messages"] if isinstance(m, dict)]
    user = next((message_text(m.get("content")) for m in reversed(msgs) if m.get("role") == "user"), None)
    if user is None:
        return error(400, "no user message to look up", "invalid_request", "messages")
    rec = state.models[model].get(normalize(user))
    if rec is None:
        state.counters["misses"] += 1
        return error(404, f"question not in the recorded traces of {model} ({state.dataset}): "
                          f"{normalize(user)[:80]!r}", "question_not_recorded", "messages")
    return model, rec, msgs


async def stream_chunks(rid: str, model: str, rec: Recorded, usage: dict[str, Any], want_usage: bool,
                        chunk_chars: int) -> AsyncIterator[bytes]:
    """The SSE frames of a recorded answer: role, thought then response in ``chunk_chars`` pieces, the stop
    chunk, the usage chunk (``want_usage``) and ``[DONE]``."""
    created = int(time.time())

    def chunk(choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> bytes:
        c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": choices, **(extra or {})}
        return b"data: " + orjson.dumps(c) + b"\n\n"

    def delta(d: dict[str, Any], finish: str | None = None) -> list[dict[str, Any]]:
        return [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}]

    yield chunk(delta({"role": "assistant", "content": ""}))
    for p in pieces(rec.thought, chunk_chars):
        yield chunk(delta({"reasoning": p}))
    for p in pieces(rec.response, chunk_chars):
        yield chunk(delta({"content": p}))
    yield chunk(delta({}, "stop"))
    if want_usage:
        yield chunk([], {"usage": usage})
    yield b"data: [DONE]\n\n"


def make_app(state: ReplayState) -> Starlette:
    """The replay server's ASGI app over ``state``."""

    async def chat(request: Request) -> Response:
        state.counters["requests"] += 1
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            return error(400, "request body is not valid JSON", "invalid_json")
        found = _recorded(state, body)
        if isinstance(found, Response):
            return found
        model, rec, msgs = found
        state.counters["hits"] += 1
        rid = "chatcmpl-" + hashlib.sha256(f"{model}/{rec.qid}/{time.time_ns()}".encode()).hexdigest()[:24]
        usage = usage_of(rec, estimate_prompt_tokens(msgs))
        if body.get("stream") is True:
            state.counters["streams"] += 1
            want_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(stream_chunks(rid, model, rec, usage, want_usage, state.chunk_chars),
                                     media_type="text/event-stream")
        message: dict[str, Any] = {"role": "assistant", "content": rec.response, "tool_calls": []}
        if rec.thought:
            message["reasoning"] = rec.thought
        out = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
               "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "stop",
                            "stop_reason": None}],
               "usage": usage}
        return Response(orjson.dumps(out), media_type="application/json")

    async def health(_: Request) -> Response:
        return Response(b"", status_code=200)

    async def models(_: Request) -> Response:
        data = {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "trace-replay"}
                                           for m in state.models]}
        return Response(orjson.dumps(data), media_type="application/json")

    async def stats(_: Request) -> Response:
        return Response(orjson.dumps(state.counters), media_type="application/json")

    async def not_found(_: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        return error(status, "no such endpoint on the trace-replay upstream", "not_found")

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/health", health),
            Route("/v1/models", models),
            Route("/replay/stats", stats),
        ],
        exception_handlers={404: not_found, 405: not_found},
    )


def parse_pairs(ladders: list[str], model: str | None, settings: list[str]) -> list[tuple[str, str]]:
    """(model, setting) pairs from ``--ladder M:S1,S2`` (repeatable) and ``--model M --setting S[,S2]``."""
    pairs: list[tuple[str, str]] = []
    for spec in ladders:
        m, sep, rest = spec.partition(":")
        if not sep or not m.strip() or not rest.strip():
            raise ValueError(f"--ladder must look like MODEL:SETTING1,SETTING2, got {spec!r}")
        pairs += [(m.strip(), s.strip()) for s in rest.split(",") if s.strip()]
    if settings and not model:
        raise ValueError("--setting needs --model")
    if model:
        if not settings:
            raise ValueError("--model needs --setting")
        pairs += [(model, s.strip()) for spec in settings for s in spec.split(",") if s.strip()]
    if not pairs:
        raise ValueError("give --ladder MODEL:S1,S2 or --model M --setting S")
    return list(dict.fromkeys(pairs))


class ReplayProcess:
    """The replay upstream as a subprocess on a free loopback port (for the bench and the tests).

    ``root`` is ``http://127.0.0.1:PORT``, ``base_url`` the OpenAI base (``…/v1``); ``stats()`` reads the
    counters. Use as a context manager: it waits for ``/health`` (``timeout_s``) and terminates on exit.
    Raises RuntimeError when the process exits first (its stderr says why: a missing trace file, say)."""

    def __init__(self, traces: Path, dataset: str, pairs: list[tuple[str, str]], *, timeout_s: float = 60.0,
                 python: str | None = None) -> None:
        import sys

        from tests.fixtures.ports import Lease

        self._lease = Lease()  # the port is this process's while the object lives (tests.fixtures.ports)
        self.port = self._lease.port
        self.root = f"http://127.0.0.1:{self.port}"
        self.base_url = self.root + "/v1"
        flags = [a for m, s in pairs for a in ("--ladder", f"{m}:{s}")]
        # resolved here: the process runs in the repository (cwd below), where a path relative to the caller's
        # directory names nothing ("--traces ../data/traces" from a subdirectory: "no recording for …")
        self.cmd = [python or sys.executable, "-m", "bench.traces.replay_upstream",
                    "--traces", str(Path(traces).resolve()), "--dataset", dataset, "--port", str(self.port), *flags]
        self.timeout_s = timeout_s
        self.proc: Any = None

    def __enter__(self) -> ReplayProcess:
        import subprocess
        import tempfile

        import httpx

        repo = Path(__file__).resolve().parents[2]
        self._err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(self.cmd, cwd=repo, stdout=subprocess.DEVNULL, stderr=self._err)
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self.proc.poll() is not None:
                self._err.seek(0)
                msg = self._err.read().decode(errors="replace")[-2000:]
                self._err.close()
                raise RuntimeError(f"replay upstream exited with {self.proc.returncode}: {msg}")
            try:
                if httpx.get(self.root + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"replay upstream did not answer within {self.timeout_s} s")
            time.sleep(0.1)

    def stats(self) -> dict[str, int]:
        import httpx

        return httpx.get(self.root + "/replay/stats", timeout=5).json()

    def __exit__(self, *_: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._err.close()


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--traces", type=Path, required=True, help="traces folder (DIR/<dataset>/M__S.jsonl.gz)")
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--model")
    ap.add_argument("--setting", action="append", default=[], help="with --model; repeatable or comma list")
    ap.add_argument("--ladder", action="append", default=[], help="MODEL:S1,S2 (repeatable)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--chunk-chars", type=int, default=CHUNK_CHARS, help="characters per streamed delta")
    args = ap.parse_args(argv)
    try:
        pairs = parse_pairs(args.ladder, args.model, args.setting)
        state = build_state(args.traces, args.dataset, pairs, max(1, args.chunk_chars))
    except (ValueError, FileNotFoundError) as exc:
        ap.error(str(exc))
    uvicorn.run(make_app(state), host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
