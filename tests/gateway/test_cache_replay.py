"""Stream ↔ non-stream: a cached answer replays as valid SSE, and a stream assembles into the same body."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.openai.chunks import StreamAssembler, replay
from gateway.openai.sse import DONE, SSEDecoder

CHAT: dict[str, Any] = {
    "id": "chatcmpl-abc",
    "object": "chat.completion",
    "created": 1700000000,
    "model": "thinkgate-tiny",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "The answer is 4.\nÜnïcödé ✓ 🚀 end",
                                 "reasoning_content": "Two plus two… is four.\n"},
         "logprobs": None, "finish_reason": "stop"},
        {"index": 1, "message": {"role": "assistant", "content": "4", "reasoning_content": ""},
         "logprobs": None, "finish_reason": "length"},
    ],
    "usage": {"prompt_tokens": 21, "completion_tokens": 17, "total_tokens": 38,
              "completion_tokens_details": {"reasoning_tokens": 9}},
}

TEXT: dict[str, Any] = {
    "id": "cmpl-1", "object": "text_completion", "created": 1, "model": "thinkgate-tiny",
    "choices": [{"index": 0, "text": "1, 2, 3, 4", "logprobs": None, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10},
}


def _frames(raw: bytes) -> list[bytes]:
    """Validate SSE framing strictly: every event is exactly one `data: ` line followed by a blank line."""
    assert raw.endswith(b"\n\n")
    events = raw[:-2].split(b"\n\n")
    for ev in events:
        assert ev.startswith(b"data: ") and b"\n" not in ev, ev
    return [ev[6:] for ev in events]


@pytest.mark.parametrize("include_usage", [True, False])
@pytest.mark.parametrize("chunk_chars", [1, 3, 16, 1000])
def test_chat_replay_is_valid_sse_and_content_is_byte_equal(include_usage: bool, chunk_chars: int) -> None:
    raw = b"".join(replay(CHAT, include_usage, chunk_chars))
    payloads = _frames(raw)
    assert payloads[-1] == b"[DONE]" and raw.endswith(DONE)
    chunks = [orjson.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-abc" for c in chunks)
    first = chunks[0]["choices"][0]
    assert first["delta"]["role"] == "assistant" and first["index"] == 0
    usage_chunks = [c for c in chunks if c.get("usage")]
    if include_usage:
        assert len(usage_chunks) == 1 and usage_chunks[0]["choices"] == [] and chunks[-1] is usage_chunks[0]
        assert usage_chunks[0]["usage"] == CHAT["usage"]
        assert all("usage" in c for c in chunks)  # OpenAI: null on the others
    else:
        assert not usage_chunks and all("usage" not in c for c in chunks)
    asm = StreamAssembler()
    for p in payloads:
        asm.feed_payload(p)
    assert asm.complete
    back = asm.result()
    for i, choice in enumerate(CHAT["choices"]):
        got = back["choices"][i]["message"]
        want = choice["message"]
        assert got["content"].encode() == want["content"].encode()
        assert got.get("reasoning_content", "").encode() == want["reasoning_content"].encode()
        assert back["choices"][i]["finish_reason"] == choice["finish_reason"]
    if include_usage:
        assert back == CHAT | {"choices": [c | {"message": {k: v for k, v in c["message"].items() if v != ""
                                                             or k == "content"}} for c in CHAT["choices"]]}


def test_completions_replay_round_trip() -> None:
    payloads = _frames(b"".join(replay(TEXT, True, 2)))
    chunks = [orjson.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    asm = StreamAssembler()
    for p in payloads:
        asm.feed_payload(p)
    assert asm.complete and asm.result() == TEXT


def test_stream_assembles_into_the_non_stream_body_and_replays_identically() -> None:
    # A stream as an upstream sends it (vLLM field name `reasoning`, a tool call in pieces, usage at the end)
    upstream = [
        {"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "m",
         "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "m",
         "choices": [{"index": 0, "delta": {"reasoning": "think "}, "finish_reason": None}]},
        {"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "m",
         "choices": [{"index": 0, "delta": {"reasoning": "more"}, "finish_reason": None}]},
        {"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "m",
         "choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]},
        {"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "m",
         "choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": None}]},
        {"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "m",
         "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "t1", "type": "function",
                                                            "function": {"name": "f", "arguments": "{\"a\""}}]},
                      "finish_reason": None}]},
        {"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "m",
         "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]},
                      "finish_reason": "tool_calls"}]},
        {"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "m", "choices": [],
         "usage": {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}},
    ]
    dec = SSEDecoder()
    raw = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in upstream) + DONE
    asm = StreamAssembler()
    # feed in awkward 7-byte pieces: the decoder must reassemble events across reads
    for i in range(0, len(raw), 7):
        for payload in dec.feed(raw[i : i + 7]):
            asm.feed_payload(payload)
    assert asm.complete and asm.deltas == 6
    body = asm.result()
    msg = body["choices"][0]["message"]
    assert msg["content"] == "Hello" and msg["reasoning"] == "think more"
    assert msg["tool_calls"] == [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]
    assert body["usage"]["completion_tokens"] == 6
    again = StreamAssembler()
    for p in _frames(b"".join(replay(body, True, 4))):
        again.feed_payload(p)
    assert again.result() == body


def test_incomplete_stream_is_not_complete() -> None:
    asm = StreamAssembler()
    asm.feed({"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
              "choices": [{"index": 0, "delta": {"content": "partial"}, "finish_reason": None}]})
    assert not asm.complete and asm.deltas == 1 and asm.text_chars() == 7
    asm.feed_payload(b"[DONE]")
    assert not asm.complete  # no finish_reason: the upstream dropped the stream


@pytest.mark.parametrize("endpoint", ["messages", "responses"])
def test_a_thought_stored_under_both_names_replays_once(endpoint: str) -> None:
    """vLLM sends one thought under both ``reasoning`` and ``reasoning_content``; the stored answer keeps both. Its
    replay carries the thought once per delta under both names (as it came), so the translated streams — which read
    either name — show it once (one chunk per name showed it twice). A chat client still assembles each name whole."""
    from gateway.anthropic.messages import MessageStream
    from gateway.openai.responses import EventStream

    thought = "Two plus two… is four.\n"
    body = {**CHAT, "choices": [{**CHAT["choices"][0], "message": {**CHAT["choices"][0]["message"],
                                                                   "reasoning": thought,
                                                                   "reasoning_content": thought}}]}
    payloads = _frames(b"".join(replay(body, True, 5)))
    chunks = [orjson.loads(p) for p in payloads[:-1]]
    assembled = StreamAssembler()
    for p in payloads:
        assembled.feed_payload(p)
    msg = assembled.result()["choices"][0]["message"]
    assert msg["reasoning"] == msg["reasoning_content"] == thought
    if endpoint == "messages":
        ms = MessageStream({"model": "m", "max_tokens": 64, "thinking": {"type": "enabled", "budget_tokens": 32}},
                           "msg_1")
        raw = ms.start() + b"".join(ms.feed(c) for c in chunks) + ms.finish()
        shown = "".join(b["thinking"] for b in ms.message["content"] if b["type"] == "thinking")
    else:
        es = EventStream({"model": "m", "input": "hi"}, "resp_1", "m")
        raw = es.start() + b"".join(es.feed(c) for c in chunks) + es.finish()
        shown = "".join(part["text"] for item in es.response["output"] if item["type"] == "reasoning"
                        for part in item["content"])
    assert shown == thought, raw
