"""``POST /v1/embeddings``: passed through to a tier marked ``embeddings: true``, metered on input tokens.

The tier: ``model`` naming such a tier, or ``auto`` / any other model name → the first tier marked for
embeddings (route reason ``forced``: configuration, not the router, picks it). No tier marked → 404
``model_not_found``; naming a tier not marked → 404. The body goes to the tier's ``/embeddings`` with
``model`` = the tier's upstream model, everything else as sent (``encoding_format``, ``dimensions``, …).
Same keys, limits and budget reservation as chat (estimate: the input's bytes, no completion); the usage event
(``endpoint: embeddings``) takes ``usage.prompt_tokens`` from the upstream and prices them at the tier's input
price. Errors are OpenAI-shaped.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

import anyio
import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.api.asgi import Gateway
from gateway.api.http import read_body, route_headers
from gateway.config import TierConfig
from gateway.errors import GatewayError, InvalidRequest, UnknownModel, UpstreamError
from gateway.ledger.record import UsageRecord
from gateway.openai.usage import estimate_prompt
from gateway.pipeline import request as schemas
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.proxy import Proxy
from gateway.pipeline.relay import CLIENT_CLOSED
from gateway.pipeline.routing import RouteDecision

LABEL: Final = "embeddings"


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def validate(body: dict[str, Any]) -> None:
    """``model`` a non-empty string; ``input`` a string, an array of strings, token ids, or arrays of token ids."""
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise InvalidRequest("'model' is required", param="model")
    v = body.get("input")
    ok = (isinstance(v, str) or (isinstance(v, list) and bool(v) and (
        all(isinstance(s, str) for s in v) or _is_ids(v) or all(_is_ids(p) for p in v))))
    if not ok:
        raise InvalidRequest("'input' must be a string, an array of strings, or token ids", param="input")


def token_ids(v: Any) -> int | None:
    """How many token ids an ``input`` of ids carries (a list of ids, or a list of such lists); None for text."""
    if isinstance(v, list) and v and not isinstance(v[0], str):
        return sum(len(p) for p in v) if isinstance(v[0], list) else len(v)
    return None


def estimate_body(body: dict[str, Any]) -> dict[str, Any]:
    """The body the budget estimate reads: the input as a prompt (one byte per token id), no completion."""
    v = body["input"]
    ids = token_ids(v)
    return {"prompt": " " * ids if ids is not None else v, "max_tokens": 1}


class EmbeddingsAPI:
    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.tiers = [t for t in proxy.settings.tiers if t.embeddings]

    def tier_for(self, model: str) -> TierConfig:
        named = next((t for t in self.proxy.settings.tiers if t.name == model), None)
        if named is not None and not named.embeddings:
            raise UnknownModel(f"tier {model!r} does not serve embeddings (tiers that do: "
                               f"{[t.name for t in self.tiers]})", param="model")
        if named is not None:
            return named
        if not self.tiers:
            raise UnknownModel("no tier serves embeddings (mark one with 'embeddings: true')", param="model")
        return self.tiers[0]

    async def handle(self, request: Request) -> Response:
        proxy = self.proxy
        # refused before any upstream call (a bad key or body, an unknown model, a limit): audited, as on chat
        with proxy.auditing(UsageRecord(endpoint=LABEL)) as record:
            key = await proxy.keys.authenticate(request.headers.get("authorization"))
            record.key_id, record.tags = key.id, key.tags
            body = schemas.parse_json_object(await read_body(request, proxy.max_body))
            record.requested_model = body.get("model")
            validate(body)
            tier = self.tier_for(body["model"])
        route = RouteDecision(tier, "forced")
        try:
            admitted = await proxy.accounting.admit(key, estimate_body(body), record, [tier])
        except GatewayError as exc:
            proxy.refused(record, exc, route)
            raise
        ex = Exchange(record, route, proxy.usage_sinks, proxy.accounting)
        try:
            try:
                resp = await proxy.upstreams.open(tier, "/embeddings", orjson.dumps({**body, "model": tier.model}),
                                                  stream=False)
                data = orjson.loads(resp.content)
            except orjson.JSONDecodeError:
                raise UpstreamError(f"upstream of tier {tier.name!r} sent an invalid JSON answer") from None
            except GatewayError as exc:
                await ex.close(exc.status, exc.code)
                exc.headers.setdefault("x-request-id", record.request_id)  # matches the usage event
                raise
            record.mark_first_byte()
            usage = data.get("usage") if isinstance(data, dict) else None
            if not record.set_usage(usage if isinstance(usage, dict) else None, completion=False):
                # no usage to meter (or none to trust): the input estimated, not billed at 0
                ids = token_ids(body.get("input"))
                record.prompt_tokens = ids if ids is not None else estimate_prompt(body.get("input"))
                record.usage_source = "counted"
            await ex.close(200)
            headers = route_headers(ex.route, record.request_id)
            if admitted.rate is not None:
                headers |= admitted.rate.headers()
            return Response(resp.content, media_type="application/json", headers=headers)
        except BaseException as exc:
            cancelled = isinstance(exc, asyncio.CancelledError | anyio.get_cancelled_exc_class())
            with anyio.CancelScope(shield=True):
                await ex.abandon(CLIENT_CLOSED if cancelled else 502 if isinstance(exc, UpstreamError) else 500,
                                 "client_disconnected" if cancelled else "upstream_error")
            raise


def attach(app: Gateway, proxy: Proxy) -> EmbeddingsAPI:
    """Add ``POST /v1/embeddings`` to ``app``."""
    api = EmbeddingsAPI(proxy)
    app.add_hot_route("/v1/embeddings", api.handle, ["POST"])
    return api
