"""``GET /dashboard``: the cost dashboard, for the admin key, through a login form and a session cookie.

Routes:

- ``GET /dashboard`` — the page (server-rendered HTML; its script and style are package data under
  ``static/``, served by ``GET /dashboard/static/{name}``: no CDN). Without a valid session: the login form.
- ``POST /dashboard/login`` — form field ``key`` (``application/x-www-form-urlencoded``, never a query
  string): an admin key sets the session cookie (:mod:`gateway.api.dashboard.session`) and redirects (303) to
  ``/dashboard``; an unknown key answers 401, a non-admin key 403 (the form again, with the reason). The key is
  never logged, never put in a URL, never stored in the cookie (which names the key id and a keyed tag of the
  key's digest: :func:`admin_credential` — a rotated or removed admin key ends its sessions).
- ``POST /dashboard/logout`` — ends the session.
- ``GET /dashboard/data`` — the JSON the page polls (:mod:`gateway.api.dashboard.data`); ``since`` / ``until``
  as for ``GET /v1/usage``. 401 without a session; 503 ``{"redis": "unreachable"}`` while Redis is down.

Who is admin: the admin key (``auth.admin_key_sha256``). On embedded defaults — no key configured, so
``thinkgate serve`` registers the development key of ``auth.dev_key_file`` as the only key — the
development key opens the dashboard too (as it reads ``/metrics`` and every key's ``GET /v1/usage``: it is the
operator's); that holds only while it is the single key and there is no admin key.
"""

from __future__ import annotations

import contextlib
import html
import time
from importlib.resources import files
from typing import Any
from urllib.parse import parse_qs

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from gateway.api.dashboard.data import collect
from gateway.api.dashboard.session import COOKIE, Sessions, load_secret
from gateway.auth.keys import ADMIN_KEY_ID, DEV_KEY_ID, KeyInfo, KeyStore, dev_key_only_admin, sha256_hex
from gateway.config import Settings
from gateway.errors import AuthError, GatewayError
from gateway.ledger.export import ExportError, parse_period
from gateway.pipeline.accounting import Accounting
from gateway.pipeline.routing import Routing
from gateway.state.breaker import RedisDown

STATIC = {"dashboard.js": "text/javascript; charset=utf-8", "dashboard.css": "text/css; charset=utf-8",
          "favicon.svg": "image/svg+xml"}
LOGIN_BODY_MAX = 4096
#: the 401 of ``GET /dashboard/data`` without a session: a script sent the key as a Bearer header (as it does
#: everywhere else) and was told only "log in at /dashboard", a page for a browser
NO_SESSION = ("no dashboard session: log in at /dashboard with the admin key (a script: POST /dashboard/login with "
              "the form field key=<admin key>, keep the session cookie it sets and send it here); an API key sent "
              "in 'Authorization' is no session (GET /v1/usage and /metrics take one)")
# no inline script, nothing from elsewhere: the page's own files and its own JSON only
SECURITY_HEADERS = {"content-security-policy": "default-src 'self'; frame-ancestors 'none'; form-action 'self'",
                    "x-frame-options": "DENY", "referrer-policy": "no-referrer", "cache-control": "no-store",
                    "x-content-type-options": "nosniff"}


def dev_key_is_admin(settings: Settings, key: KeyInfo) -> bool:
    """True when ``key`` is the development key of embedded defaults (see the module doc)."""
    return dev_key_only_admin(settings.auth, key.id)


def admin_credential(settings: Settings, key_id: str) -> bytes | None:
    """The SHA-256 digest of the credential that makes ``key_id`` an admin of the dashboard now, or None when it is
    no admin now. A session is good only while this is the credential it logged in with: a rotated admin key (a
    new ``auth.admin_key_sha256``, same id ``admin``), a removed one, or a development key that stopped being admin
    (keys configured, its file rewritten) ends the sessions it opened at their next request."""
    auth = settings.auth
    if key_id == ADMIN_KEY_ID and auth.admin_key_sha256:
        return bytes.fromhex(auth.admin_key_sha256)
    if key_id == DEV_KEY_ID and dev_key_is_admin(settings, KeyInfo(id=DEV_KEY_ID)):
        return bytes.fromhex(auth.keys[0].secret_sha256 or "")
    return None


def _asset(name: str) -> bytes:
    return files("gateway.api.dashboard").joinpath("static", name).read_bytes()


def _page(name: str, **fields: str) -> str:
    text = _asset(name).decode()
    for k, v in fields.items():
        text = text.replace("{{" + k + "}}", v)
    return text


def login_page(message: str = "", status: int = 200) -> HTMLResponse:
    """The login form (``message``: why the last attempt was refused)."""
    note = f'<p class="error" role="alert">{html.escape(message)}</p>' if message else ""
    return HTMLResponse(_page("login.html", message=note), status, headers=SECURITY_HEADERS)


def attach(app: Starlette, settings: Settings, keys: KeyStore, acct: Accounting, routing: Routing) -> None:
    """Add the dashboard routes to ``app`` (nothing when ``dashboard.enabled`` is false)."""
    cfg = settings.dashboard
    if not cfg.enabled:
        return
    state: dict[str, Sessions] = {}

    def sessions() -> Sessions:
        # the secret file is read (or made) on first use, not at import or app build
        if "s" not in state:
            state["s"] = Sessions(load_secret(cfg.secret_file), cfg.session_ttl_s, cfg.secure_cookie)
        return state["s"]

    async def session_key(request: Request) -> str | None:
        return await _session_key(sessions(), acct.handle, request, settings)

    async def page(request: Request) -> Response:
        key_id = await session_key(request)
        if key_id is None:
            return login_page()
        tiers = ", ".join(html.escape(t.name) for t in settings.tiers)
        body = _page("dashboard.html", key_id=html.escape(key_id), tiers=tiers, poll_ms=str(int(cfg.poll_s * 1000)))
        return HTMLResponse(body, headers=SECURITY_HEADERS)

    async def login(request: Request) -> Response:
        secret = await _login_secret(request)
        if isinstance(secret, Response):
            return secret
        key = await _admin_key(keys, settings, secret)
        if isinstance(key, Response):
            return key
        resp = RedirectResponse("/dashboard", status_code=303, headers=SECURITY_HEADERS)
        # bound to this key's digest, not only its id: the id ``admin`` outlives a rotation of the admin key
        cookie = sessions().issue(key.id, bytes.fromhex(sha256_hex(secret)))
        resp.headers.append("set-cookie", sessions().cookie_header(cookie))
        return resp

    async def logout(request: Request) -> Response:
        await _revoke(sessions(), acct.handle, request)
        resp = RedirectResponse("/dashboard", status_code=303, headers=SECURITY_HEADERS)
        resp.headers.append("set-cookie", sessions().clear_header())
        return resp

    async def data(request: Request) -> Response:
        if await session_key(request) is None:
            return _json({"error": {"message": NO_SESSION, "type": "authentication_error", "param": None,
                                    "code": "no_session"}}, 401)
        return await _data(request, acct, settings, routing)

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in STATIC:
            return Response(status_code=404)
        return Response(_asset(name), media_type=STATIC[name], headers={"cache-control": "no-cache"})

    app.router.add_route("/dashboard", page, methods=["GET"])
    app.router.add_route("/dashboard/login", login, methods=["POST"])
    app.router.add_route("/dashboard/logout", logout, methods=["POST"])
    app.router.add_route("/dashboard/data", data, methods=["GET"])
    app.router.add_route("/dashboard/static/{name}", static, methods=["GET"])


def _revoked_key(handle: Any, nonce: str) -> str:
    return f"{handle.prefix}dashboard:revoked:{nonce}"


async def _session_key(sessions: Sessions, handle: Any, request: Request, settings: Settings) -> str | None:
    """The key id of the request's session: a valid cookie, opened with the key id's current admin credential
    (:func:`admin_credential` — a session outlived the rotation of the key that opened it: a security review), that
    no logout revoked (a logged-out cookie went on reading the data for its 8 hours: the same review). Redis down:
    the signature and the credential decide (the data answer needs Redis anyway)."""
    parsed = sessions.parse(request.cookies.get(COOKIE))
    if parsed is None or not sessions.bound_to(parsed, admin_credential(settings, parsed.key_id)):
        return None
    with contextlib.suppress(Exception):
        if await handle.client.exists(_revoked_key(handle, parsed.nonce)):
            return None
    return parsed.key_id


async def _revoke(sessions: Sessions, handle: Any, request: Request) -> None:
    """Logout: the request's session is revoked on every replica until it would have expired."""
    parsed = sessions.parse(request.cookies.get(COOKIE))
    if parsed is not None:
        ttl = max(1, parsed.exp - int(time.time()))
        with contextlib.suppress(Exception):
            await handle.client.set(_revoked_key(handle, parsed.nonce), "1", ex=ttl)


async def _login_secret(request: Request) -> str | Response:
    """The key a login form posts (``key=…``, at most ``LOGIN_BODY_MAX`` bytes), or the login page refusing it:
    413 (too large), 400 (a query string — a key in a URL would end up in logs and history — or no key)."""
    raw = b""
    async for part in request.stream():
        raw += part
        if len(raw) > LOGIN_BODY_MAX:
            return login_page("request too large", 413)
    if request.query_params:  # a key in a URL would end up in logs and history: refuse it outright
        return login_page("send the key in the form body, never in the URL", 400)
    form = parse_qs(raw.decode(errors="replace"), keep_blank_values=True)
    secret = (form.get("key") or [""])[0].strip()
    if not secret:
        return login_page("enter the admin key", 400)
    return secret


async def _admin_key(keys: KeyStore, settings: Settings, secret: str) -> KeyInfo | Response:
    """The admin key whose secret is ``secret``, or the login page refusing it: 401 (unknown), 503 (key store
    unreachable), 403 (a key that is not the admin key)."""
    try:
        key = await keys.authenticate(f"Bearer {secret}")
    except AuthError:
        return login_page("unknown key", 401)
    except GatewayError:
        return login_page("the key store is unreachable; retry later", 503)
    if not (key.is_admin or dev_key_is_admin(settings, key)):
        return login_page("this key is not an admin key: the dashboard needs the admin key", 403)
    return key


async def _data(request: Request, acct: Accounting, settings: Settings, routing: Routing) -> Response:
    """``GET /dashboard/data`` for a logged-in session: the JSON document over ``since``/``until`` (400 when
    they do not parse, 503 while Redis is down)."""
    try:
        since, until = parse_period(request.query_params.get("since"), request.query_params.get("until"))
    except ExportError as exc:
        return _json({"error": {"message": str(exc), "type": "invalid_request_error",
                                "code": "invalid_request"}}, 400)
    try:
        doc = await collect(acct, settings, routing, since, until, time.time())
    except RedisDown:
        return _json({"object": "dashboard.data", "redis": "unreachable",
                      "message": "the usage store (Redis) is unreachable: no figures until it answers"}, 503)
    return _json(doc)


def _json(doc: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(doc), status_code=status, media_type="application/json",
                    headers={"cache-control": "no-store"})
