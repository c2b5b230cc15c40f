"""``GET /v1/models`` (``auto`` with its routing settings, then every tier with its ``thinkgate`` card; to an
Anthropic client — ``anthropic-version`` sent, ``x-api-key`` taken — Anthropic's model page),
``GET /v1/models/{id}`` (one of those cards) and
``POST /admin/router/reload`` (admin key: load the router file now; it is also watched and reloaded)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from gateway.anthropic.messages import error_body
from gateway.api.common import json_response as _json
from gateway.auth.keys import KeyInfo
from gateway.config import Settings, TierConfig
from gateway.errors import GatewayError, InvalidRequest, PermissionDenied, UnknownModel
from gateway.pipeline.proxy import Proxy
from gateway.pipeline.routing import AUTO, Routing
from router.persistence import RouterFileError


def _tier_card(t: TierConfig, created: int) -> dict[str, Any]:
    # Prices as decimal strings: exact, as configured (USD per 1M tokens).
    return {
        "id": t.name,
        "object": "model",
        "created": created,
        "owned_by": "thinkgate",
        "thinkgate": {
            "upstream_model": t.model,
            "thinking_budget": t.thinking_budget,
            # the budgets the tier's model follows (null: any); a budget asked outside is served at the nearest end
            "thinking_budget_range": list(t.thinking_budget_range) if t.thinking_budget_range else None,
            "budget_mode": t.budget_mode,
            "enable_thinking": t.enable_thinking,
            "max_tokens": t.max_tokens,
            "embeddings": t.embeddings,
            "prices": {
                "input_usd_per_mtok": str(t.prices.input_usd_per_mtok),
                "cached_input_usd_per_mtok": str(t.prices.cached_input_usd_per_mtok),
                "output_usd_per_mtok": str(t.prices.output_usd_per_mtok),
            },
        },
    }


def anthropic_client(request: Request) -> bool:
    """True for a request from an Anthropic client: its SDKs send ``anthropic-version`` on every call."""
    return "anthropic-version" in request.headers


def _anthropic_card(name: str, created: int) -> dict[str, Any]:
    """Anthropic's ``ModelInfo`` (``type``, ``id``, ``display_name``, ``created_at`` as RFC 3339)."""
    return {"type": "model", "id": name, "display_name": name,
            "created_at": datetime.fromtimestamp(created, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}


def _visible(settings: Settings, key: KeyInfo) -> list[TierConfig]:
    """The tiers ``key`` may ask for: a key that refuses other tiers sees only its ``allowed_tiers`` (as a
    LiteLLM key sees only its models); one that downgrades sees them all (any of them answers it)."""
    if key.allowed_tiers is None or key.on_disallowed_tier == "downgrade":
        return list(settings.tiers)
    allowed = set(key.allowed_tiers)
    return [t for t in settings.tiers if t.name in allowed]


def _card_tier(tiers: list[TierConfig], model_id: str) -> TierConfig | None:
    """The tier of card ``model_id`` among ``tiers`` (None: ``auto``); raises UnknownModel (404)."""
    if model_id == AUTO:
        return None
    found = next((t for t in tiers if t.name == model_id), None)
    if found is None:
        raise UnknownModel(f"the model {model_id!r} does not exist or is not available to this key "
                           f"(models: auto, {', '.join(t.name for t in tiers)})", param="model")
    return found


def _authorization(request: Request) -> str | None:
    """The credentials: ``Authorization``, or an Anthropic client's ``x-api-key`` (as ``/v1/messages`` takes it)."""
    h = request.headers
    if anthropic_client(request) and not h.get("authorization") and h.get("x-api-key"):
        return f"Bearer {h['x-api-key']}"
    return h.get("authorization")


def _shaped(request: Request, exc: GatewayError) -> Response:
    """``exc`` in Anthropic's error shape to an Anthropic client (its SDK raises NotFoundError, …); else raised
    for the app's handler (OpenAI's shape)."""
    if not anthropic_client(request):
        raise exc
    return Response(error_body(exc), status_code=exc.status, media_type="application/json", headers=exc.headers)


def _status(request: Request, routing: Routing, key: KeyInfo) -> dict[str, Any] | None:
    """The router service's info plus ``learning`` (automatic retraining's status, None when off). Files are named
    by name and content digest; their full paths only to the admin key (any key reads this list, and a path tells
    a client the server's directory layout)."""
    if routing.service is None:
        return None
    trigger = getattr(request.app.state, "retrain", None)
    admin = key.is_admin
    return {**routing.service.info(with_path=admin),
            "learning": trigger.status(with_paths=admin) if trigger is not None else None}


def attach(app: FastAPI, settings: Settings, proxy: Proxy, routing: Routing, created: int) -> None:
    """Add ``/v1/models`` and ``/admin/router/reload`` to ``app``; ``created`` stamps the model cards (s)."""

    def auto_card(request: Request, key: KeyInfo) -> dict[str, Any]:
        return {
            "id": AUTO,
            "object": "model",
            "created": created,
            "owned_by": "thinkgate",
            "thinkgate": {
                "router": routing.scorer.name,
                "router_status": _status(request, routing, key),
                "routed_tiers": settings.routing.routed_tiers,
                "thresholds": routing.thresholds,
                "effort_tiers": settings.routing.effort_tiers,
            },
        }

    def visible(key: KeyInfo) -> list[TierConfig]:
        return _visible(settings, key)

    async def key_of(request: Request) -> KeyInfo:
        return await proxy.keys.authenticate(_authorization(request))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """The model list: OpenAI's ``{"object": "list", "data": [cards]}``, or — to an Anthropic client
        (``anthropic-version`` sent: its SDK's ``models.list``) — Anthropic's page of ``ModelInfo``."""
        try:
            key = await key_of(request)
        except GatewayError as exc:
            return _shaped(request, exc)
        names = [AUTO, *(t.name for t in visible(key))]
        if anthropic_client(request):
            data = [_anthropic_card(n, created) for n in names]
            return _json({"data": data, "has_more": False, "first_id": names[0], "last_id": names[-1]})
        return _json({"object": "list",
                      "data": [auto_card(request, key), *(_tier_card(t, created) for t in visible(key))]})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        """One model card (``client.models.retrieve``): ``auto`` or a tier the key may ask for; 404
        ``model_not_found`` otherwise (Anthropic's card and ``not_found_error`` to an Anthropic client)."""
        try:
            key = await key_of(request)
            found = _card_tier(visible(key), model_id)
        except GatewayError as exc:
            return _shaped(request, exc)
        if anthropic_client(request):
            return _json(_anthropic_card(model_id, created))
        return _json(auto_card(request, key) if found is None else _tier_card(found, created))

    @app.post("/admin/router/reload")
    async def reload_router(request: Request) -> Response:
        key = await proxy.keys.authenticate(request.headers.get("authorization"))
        if not key.is_admin:
            raise PermissionDenied("reloading the router needs the admin key")
        svc = routing.service
        if svc is None:
            raise InvalidRequest("no router file is configured (routing.router_path is null)")
        try:
            await asyncio.to_thread(svc.reload)
        except RouterFileError as exc:  # the router in service (if any) is kept
            err = {"message": str(exc), "type": "invalid_request_error", "code": "router_reload_failed"}
            return _json({"error": err, "router": svc.info()}, 422)
        return _json({"status": "reloaded", "router": svc.info()})
