"""Dashboard sessions: a signed, expiring cookie that names the admin key id — never the key itself.

Cookie value: ``base64url(JSON {"k": key id, "exp": epoch s, "n": nonce}) "." base64url(HMAC-SHA256)``, signed
with a 32-byte server secret read from ``dashboard.secret_file`` (created with mode 0600 on first use). A
forged, altered or expired cookie reads as no session. The cookie is ``HttpOnly; SameSite=Strict; Path=/dashboard``
(``Secure`` with ``dashboard.secure_cookie``), so page scripts cannot read it and cross-site requests never
carry it (the login and logout forms need no other CSRF token).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import time
from pathlib import Path

import orjson

COOKIE = "thinkgate_dashboard"
COOKIE_PATH = "/dashboard"


def load_secret(path: Path) -> bytes:
    """The signing secret in ``path`` (hex), creating it (mode 0600) when missing or empty."""
    if path.is_file():
        text = path.read_text().strip()
        if text:
            return bytes.fromhex(text)
    path.parent.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_bytes(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex() + "\n")
    return secret


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Sessions:
    """Issues and checks session cookies; ``ttl_s`` seconds of validity."""

    def __init__(self, secret: bytes, ttl_s: int, secure: bool = False) -> None:
        self._secret = secret
        self.ttl_s = ttl_s
        self.secure = secure

    def _sign(self, payload: bytes) -> bytes:
        return hmac.new(self._secret, payload, hashlib.sha256).digest()

    def issue(self, key_id: str, now: float | None = None) -> str:
        """A cookie value for ``key_id``, valid ``ttl_s`` from ``now`` (epoch s)."""
        exp = int((now if now is not None else time.time()) + self.ttl_s)
        payload = orjson.dumps({"k": key_id, "exp": exp, "n": secrets.token_hex(8)})
        return f"{_b64(payload)}.{_b64(self._sign(payload))}"

    def check(self, value: str | None, now: float | None = None) -> str | None:
        """The key id of a valid, unexpired cookie value; None for anything else."""
        parsed = self.parse(value, now)
        return parsed[0] if parsed is not None else None

    def parse(self, value: str | None, now: float | None = None) -> tuple[str, str, int] | None:
        """(key id, nonce, expiry epoch s) of a valid, unexpired cookie value; None for anything else. The nonce
        names the session (logout revokes it by that name)."""
        if not value or value.count(".") != 1:
            return None
        body, sig = value.split(".")
        try:
            payload, mac = _unb64(body), _unb64(sig)
        except (ValueError, TypeError):
            return None
        if not hmac.compare_digest(mac, self._sign(payload)):
            return None
        try:
            data = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("k"), str) or not isinstance(data.get("exp"), int):
            return None
        if data["exp"] <= (now if now is not None else time.time()):
            return None
        return str(data["k"]), str(data.get("n") or ""), int(data["exp"])

    def cookie_header(self, value: str) -> str:
        """The ``Set-Cookie`` value for a new session."""
        secure = "; Secure" if self.secure else ""
        return (f"{COOKIE}={value}; Max-Age={self.ttl_s}; Path={COOKIE_PATH}; HttpOnly; SameSite=Strict{secure}")

    def clear_header(self) -> str:
        """The ``Set-Cookie`` value that ends the session."""
        return f"{COOKIE}=; Max-Age=0; Path={COOKIE_PATH}; HttpOnly; SameSite=Strict"
