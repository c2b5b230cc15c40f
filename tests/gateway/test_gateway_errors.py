"""Bad input and auth: every refusal is OpenAI-shaped JSON with the documented status, never a traceback."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import openai
import pytest

from gateway.errors import GatewayError
from tests.fixtures.upstream import TEST_KEY, GatewayServer, sim_settings

MESSAGES = [{"role": "user", "content": "hi"}]
AUTH = {"authorization": f"Bearer {TEST_KEY}"}


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in r.text
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param


def post(gateway: Any, body: bytes | dict[str, Any], path: str = "/v1/chat/completions",
         headers: dict[str, str] | None = None) -> httpx.Response:
    h = {"content-type": "application/json", **(AUTH if headers is None else headers)}
    content = body if isinstance(body, bytes) else httpx.Request("POST", "/", json=body).content
    return httpx.post(gateway.url + path, content=content, headers=h, timeout=10)


def test_malformed_json(gateway: Any) -> None:
    assert_openai_error(post(gateway, b'{"model": "auto", "messages": [}'), 400, "invalid_json")
    assert_openai_error(post(gateway, b"[1, 2]"), 400, "invalid_json")
    assert_openai_error(post(gateway, b""), 400, "invalid_json")
    # nested deeper than the gateway can encode again (a pass-through field 600 levels deep, a list 1,000 deep):
    # a 400, not a 500 from wherever the body was next encoded or walked — on every JSON endpoint
    deep = b'{"model": "auto", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": ' + \
        b'{"a": ' * 600 + b"1" + b"}" * 600 + b"}"
    deep_list = b'{"model": "auto", "messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 1000 + \
        b"]" * 1000 + b"}"
    for body in (deep, deep_list):
        for path in ("/v1/chat/completions", "/v1/responses"):
            assert_openai_error(post(gateway, body, path), 400, "invalid_json")
        assert post(gateway, body, "/v1/messages").status_code == 400  # Anthropic's error shape there
    ok = b'{"model": "auto", "messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 100 + b"]" * 100 + b"}"
    assert post(gateway, ok).status_code != 400  # a hundred levels are still a body


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", "hot"), ("n", 0), ("n", 1.5), ("max_tokens", -1), ("stream", "yes"), ("stop", [1, 2]),
     ("max_completion_tokens", "many"), ("model", 42), ("stream_options", 1)],
)
def test_wrong_types_through_sdk(openai_client: openai.OpenAI, field: str, value: Any) -> None:
    kwargs: dict[str, Any] = {"model": "auto", "messages": MESSAGES, field: value}
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(**kwargs)
    assert info.value.status_code == 400
    assert info.value.param == field  # type: ignore[attr-defined]
    assert info.value.type == "invalid_request_error"  # type: ignore[attr-defined]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_options_need_a_stream(gateway: Any, path: str) -> None:
    # OpenAI's and vLLM's rule: stream_options on a non-streamed request is a 400, not silently dropped
    body: dict[str, Any] = {"model": "auto", "stream_options": {"include_usage": True},
                            **({"messages": MESSAGES} if "chat" in path else {"prompt": "hi"})}
    for stream in (None, False):
        r = post(gateway, body if stream is None else {**body, "stream": stream}, path)
        assert_openai_error(r, 400, param="stream_options")
        assert "only allowed when 'stream' is enabled" in r.json()["error"]["message"]
    assert post(gateway, {**body, "stream_options": None}, path).status_code == 200
    assert post(gateway, {**body, "stream_options": {}}, path).status_code == 200  # empty: vLLM accepts it too


@pytest.mark.parametrize("messages", [[], "hello", [{"content": "no role"}], [{"role": "user", "content": 5}],
                                      # no content (OpenAI's 400; it was answered and billed as an empty prompt)
                                      [{"role": "user"}], [{"role": "system", "content": None}],
                                      [{"role": "user", "content": [{"type": "text"}]}]])
def test_bad_messages(gateway: Any, messages: Any) -> None:
    r = post(gateway, {"model": "auto", "messages": messages})
    assert_openai_error(r, 400)
    assert r.json()["error"]["param"].startswith("messages")


def test_an_assistant_turn_may_carry_only_tool_calls(gateway: Any) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    r = post(gateway, {"model": "auto", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}]})
    assert r.status_code == 200, r.text


def test_bad_prompt_on_completions(gateway: Any) -> None:
    assert_openai_error(post(gateway, {"model": "auto"}, "/v1/completions"), 400, param="prompt")
    assert_openai_error(post(gateway, {"model": "auto", "prompt": [1, "a"]}, "/v1/completions"), 400, param="prompt")


def test_unknown_model_and_effort(openai_client: openai.OpenAI, gateway: Any) -> None:
    # 404, as OpenAI and vLLM answer an unknown model: the SDK raises NotFoundError
    with pytest.raises(openai.NotFoundError) as nf:
        openai_client.chat.completions.create(model="gpt-17", messages=MESSAGES)  # type: ignore[arg-type]
    assert nf.value.code == "model_not_found" and nf.value.param == "model"  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model="auto", messages=MESSAGES,
                                              reasoning_effort="ludicrous")  # type: ignore[arg-type]
    assert info.value.param == "reasoning_effort"  # type: ignore[attr-defined]
    r = post(gateway, {"model": "auto", "messages": MESSAGES}, headers={**AUTH, "x-thinkgate-tier": "nope"})
    assert_openai_error(r, 404, "model_not_found")


#: one body per generation endpoint, with ``reasoning_effort`` at its top level (Responses and Messages pass the
#: field on to the chat body they build, as any field they do not translate)
EFFORT_BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": MESSAGES},
    "/v1/completions": {"prompt": "hi"},
    "/v1/responses": {"input": "hi"},
    "/v1/messages": {"messages": MESSAGES, "max_tokens": 16},
}


@pytest.mark.parametrize("path", list(EFFORT_BODIES))
@pytest.mark.parametrize("how", ["auto", "model", "header"])
def test_an_unknown_reasoning_effort_is_refused_whatever_the_model(gateway: Any, upstream_sim: Any, path: str,
                                                                   how: str) -> None:
    """``reasoning_effort: "ultra"`` was a 400 under ``model: auto`` and sent upstream when a tier was named (by
    model or by header): now the same 400 either way, OpenAI-shaped (Anthropic's shape on /v1/messages), and
    nothing reaches the upstream."""
    body = {"model": "short" if how == "model" else "auto", **EFFORT_BODIES[path], "reasoning_effort": "ultra"}
    headers = {**AUTH, "x-thinkgate-tier": "short"} if how == "header" else None
    before = upstream_sim.stats()["requests"]
    r = post(gateway, body, path, headers=headers)
    if path == "/v1/messages":
        assert r.status_code == 400, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
        assert "reasoning_effort" in r.json()["error"]["message"]
    else:
        assert_openai_error(r, 400, code="invalid_value", param="reasoning_effort")
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert "'ultra'" in r.json()["error"]["message"]
    assert upstream_sim.stats()["requests"] == before


def test_a_known_reasoning_effort_on_a_named_tier_is_passed_on(gateway: Any, upstream_sim: Any) -> None:
    """Every effort ``routing.effort_tiers`` names still reaches a named tier as sent (it does not pick the tier)."""
    for effort in ("none", "minimal", "low", "medium", "high", "xhigh", "max"):
        t = uuid.uuid4().hex
        r = post(gateway, {"model": "short", "messages": MESSAGES, "reasoning_effort": effort, "sim": {"tag": t}})
        assert r.status_code == 200 and r.headers["x-thinkgate-tier"] == "short", r.text
        assert upstream_sim.tag(t)["body"]["reasoning_effort"] == effort


def test_one_model_card_is_served_by_id(openai_client: openai.OpenAI) -> None:
    """``client.models.retrieve`` (``GET /v1/models/{id}``): the card ``/v1/models`` lists, or 404."""
    listed = {m.id: m for m in openai_client.models.list()}
    for model_id in ("auto", "short", "long"):
        got = openai_client.models.retrieve(model_id)
        assert got.id == model_id and got.model_dump() == listed[model_id].model_dump()
    with pytest.raises(openai.NotFoundError) as nf:
        openai_client.models.retrieve("gpt-17")
    assert nf.value.code == "model_not_found"  # type: ignore[attr-defined]


def test_body_over_limit_is_413(gateway: Any, openai_client: openai.OpenAI) -> None:
    limit = gateway.settings.server.max_body_bytes
    big = [{"role": "user", "content": "x" * (limit + 10)}]
    assert_openai_error(post(gateway, {"model": "auto", "messages": big}), 413, "request_too_large")
    with pytest.raises(openai.APIStatusError) as info:
        openai_client.chat.completions.create(model="auto", messages=big)  # type: ignore[arg-type]
    assert info.value.status_code == 413


def test_body_over_limit_without_content_length(gateway: Any) -> None:
    limit = gateway.settings.server.max_body_bytes

    def chunks() -> Any:
        yield b'{"model": "auto", "messages": [{"role": "user", "content": "'
        for _ in range(limit // 1000 + 2):
            yield b"y" * 1000
        yield b'"}]}'

    r = httpx.post(gateway.url + "/v1/chat/completions", content=chunks(), headers=AUTH, timeout=10)
    assert_openai_error(r, 413, "request_too_large")


def test_missing_and_unknown_key(gateway: Any) -> None:
    assert_openai_error(post(gateway, {"model": "auto", "messages": MESSAGES}, headers={}), 401, "missing_api_key")
    assert_openai_error(
        post(gateway, {"model": "auto", "messages": MESSAGES}, headers={"authorization": "Basic abc"}), 401
    )
    r = httpx.get(gateway.url + "/v1/models", timeout=5)
    assert_openai_error(r, 401)
    bad = openai.OpenAI(base_url=gateway.base_url, api_key="tg-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.chat.completions.create(model="auto", messages=MESSAGES)  # type: ignore[arg-type]
    assert info.value.code == "invalid_api_key"  # type: ignore[attr-defined]
    # what to check, not only "invalid API key": a key made on another Redis / prefix is the usual new-user cause
    message = post(gateway, {"model": "auto", "messages": MESSAGES},
                   headers={"authorization": "Bearer tg-wrong"}).json()["error"]["message"]
    assert message.startswith("invalid API key: ") and "revoked" in message and "another Redis" in message, message
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_unknown_route_and_method(gateway: Any) -> None:
    assert_openai_error(httpx.get(gateway.url + "/v1/nothing", headers=AUTH, timeout=5), 404, "not_found")
    assert_openai_error(httpx.get(gateway.url + "/v1/chat/completions", headers=AUTH, timeout=5), 405)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_a_405_names_the_allowed_methods(gateway: Any, path: str) -> None:
    # RFC 9110 §15.5.6: a 405 MUST carry Allow; Starlette's HTTPException has it, the error handler dropped it
    for method in ("GET", "PUT"):
        r = httpx.request(method, gateway.url + path, headers=AUTH, timeout=5)
        assert r.status_code == 405 and r.headers["content-type"].startswith("application/json"), r.text
        assert "POST" in r.headers.get("allow", ""), dict(r.headers)


def test_unexpected_error_is_openai_shaped_500(upstream_sim: Any, redis_url: str) -> None:
    gw = GatewayServer(sim_settings(upstream_sim.base_url, redis_url))

    @gw.app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret internals")

    with gw:
        r = httpx.get(gw.url + "/boom", timeout=5)
    assert_openai_error(r, 500, "internal_error")
    assert "secret internals" not in r.text


def test_a_generation_route_maps_errors_as_the_framework_does(upstream_sim: Any, redis_url: str) -> None:
    """The generation endpoints skip Starlette's middleware (gateway.api.asgi): their errors still come out
    OpenAI-shaped — a GatewayError with its status and code, anything else a 500 that hides its text — and their
    path's other methods still answer 405."""
    gw = GatewayServer(sim_settings(upstream_sim.base_url, redis_url))

    async def boom(_: Any) -> None:
        raise RuntimeError("secret internals")

    async def refused(_: Any) -> None:
        raise GatewayError("no capacity", status=503, code="no_capacity")

    gw.app.add_hot_route("/v1/boom", boom, ["POST"])
    gw.app.add_hot_route("/v1/refused", refused, ["POST"])
    with gw:
        r = httpx.post(gw.url + "/v1/boom", json={}, timeout=5)
        assert_openai_error(r, 500, "internal_error")
        assert "secret internals" not in r.text
        assert_openai_error(httpx.post(gw.url + "/v1/refused", json={}, timeout=5), 503, "no_capacity")
        assert_openai_error(httpx.get(gw.url + "/v1/boom", timeout=5), 405)


def test_cors_when_configured(upstream_sim: Any, redis_url: str) -> None:
    """``server.cors_allow_origins``: a browser's preflight is answered and the gateway's headers are exposed, on the
    generation endpoints too (their direct dispatch would skip the middleware); other origins get no CORS
    headers. Off by default (the module's ``gateway`` fixture: a preflight is a 405)."""
    settings = sim_settings(upstream_sim.base_url, redis_url,
                            server={"host": "127.0.0.1", "port": 0, "cors_allow_origins": ["https://app.example"]})
    with GatewayServer(settings) as gw:
        pre = httpx.options(gw.url + "/v1/chat/completions", timeout=10, headers={
            "origin": "https://app.example", "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example"
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=30,
                       headers={"origin": "https://app.example", "authorization": f"Bearer {TEST_KEY}"},
                       json={"model": "short", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        exposed = r.headers["access-control-expose-headers"].lower()
        assert "x-request-id" in exposed and "x-thinkgate-tier" in exposed and "x-should-retry" in exposed
        other = httpx.post(gw.url + "/v1/chat/completions", timeout=30,
                           headers={"origin": "https://evil.example", "authorization": f"Bearer {TEST_KEY}"},
                           json={"model": "short", "messages": [{"role": "user", "content": "hi"}]})
        assert "access-control-allow-origin" not in other.headers


def test_no_cors_by_default(gateway: Any) -> None:
    pre = httpx.options(gateway.url + "/v1/chat/completions", timeout=10, headers={
        "origin": "https://app.example", "access-control-request-method": "POST"})
    assert pre.status_code == 405 and "access-control-allow-origin" not in pre.headers


def test_openai_paths_without_v1(gateway: Any) -> None:
    # a client whose base URL lacks /v1 (LiteLLM serves both): the same endpoints, the same answers
    c = openai.OpenAI(base_url=gateway.url, api_key=TEST_KEY, max_retries=0, timeout=30)
    r = c.chat.completions.with_raw_response.create(model="short", messages=MESSAGES)
    assert r.headers["x-thinkgate-tier"] == "short" and r.parse().choices[0].message.content
    assert next(m.id for m in c.models.list()) == "auto"
    assert c.models.retrieve("short").id == "short"
    streamed = list(c.chat.completions.create(model="short", messages=MESSAGES, stream=True))
    assert streamed and streamed[-1].choices[0].finish_reason is not None
    assert httpx.get(gateway.url + "/no-such-path", timeout=10).status_code == 404
