"""Dashboard sessions: a signed, expiring cookie that names the admin key id — never the key itself.

Cookie value: ``base64url(JSON {"k": key id, "c": credential tag, "exp": epoch s, "n": nonce}) "."
base64url(HMAC-SHA256)``, signed with a 32-byte server secret read from ``dashboard.secret_file`` (created with
mode 0600 on first use). A forged, altered or expired cookie reads as no session. The credential tag is an HMAC
(same secret) of the SHA-256 of the key that logged in: the dashboard compares it with the key id's current
credential on every request, so rotating or removing the admin key ends the sessions it opened (the id alone —
``admin`` — survives a rotation). The tag is keyed, so the cookie does not carry the key's plain digest.
The cookie is ``HttpOnly; SameSite=Strict; Path=/dashboard`` (``Secure`` with ``dashboard.secure_cookie``), so
page scripts cannot read it and cross-site requests never carry it (the login and logout forms need no other
CSRF token).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import time
from pathlib import Path
from typing import NamedTuple

import orjson

COOKIE = "thinkgate_dashboard"
COOKIE_PATH = "/dashboard"


class Session(NamedTuple):
    """A parsed cookie: the key id, the tag of the credential that logged in, the nonce (the session's name),
    the expiry (epoch s)."""

    key_id: str
    credential: str
    nonce: str
    exp: int


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

    def credential_tag(self, secret_sha256: bytes) -> str:
        """The cookie's tag of a credential (the SHA-256 digest of a key's secret): keyed with the server secret,
        so a cookie read off a browser reveals nothing to test guessed keys against offline."""
        return _b64(hmac.new(self._secret, b"credential\x00" + secret_sha256, hashlib.sha256).digest()[:16])

    def issue(self, key_id: str, secret_sha256: bytes, now: float | None = None) -> str:
        """A cookie value for ``key_id`` logged in with the key whose secret hashes to ``secret_sha256``, valid
        ``ttl_s`` from ``now`` (epoch s)."""
        exp = int((now if now is not None else time.time()) + self.ttl_s)
        payload = orjson.dumps({"k": key_id, "c": self.credential_tag(secret_sha256), "exp": exp,
                                "n": secrets.token_hex(8)})
        return f"{_b64(payload)}.{_b64(self._sign(payload))}"

    def check(self, value: str | None, now: float | None = None) -> str | None:
        """The key id of a valid, unexpired cookie value; None for anything else (the credential is not
        checked here: see :meth:`parse`)."""
        parsed = self.parse(value, now)
        return parsed.key_id if parsed is not None else None

    def parse(self, value: str | None, now: float | None = None) -> Session | None:
        """The session of a valid, unexpired cookie value; None for anything else — a cookie without a
        credential tag too (issued before sessions were bound to their key: it cannot be checked against a
        rotation, so it reads as logged out). The nonce names the session (logout revokes it by that name)."""
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
        if (not isinstance(data, dict) or not isinstance(data.get("k"), str) or not isinstance(data.get("exp"), int)
                or not isinstance(data.get("c"), str)):
            return None
        if data["exp"] <= (now if now is not None else time.time()):
            return None
        return Session(str(data["k"]), str(data["c"]), str(data.get("n") or ""), int(data["exp"]))

    def bound_to(self, session: Session, secret_sha256: bytes | None) -> bool:
        """True when ``session`` was opened with the credential whose digest is ``secret_sha256`` (None: the key id
        has no admin credential now — removed, or no longer admin)."""
        return secret_sha256 is not None and hmac.compare_digest(session.credential,
                                                                  self.credential_tag(secret_sha256))

    def cookie_header(self, value: str) -> str:
        """The ``Set-Cookie`` value for a new session."""
        secure = "; Secure" if self.secure else ""
        return (f"{COOKIE}={value}; Max-Age={self.ttl_s}; Path={COOKIE_PATH}; HttpOnly; SameSite=Strict{secure}")

    def clear_header(self) -> str:
        """The ``Set-Cookie`` value that ends the session."""
        return f"{COOKIE}=; Max-Age=0; Path={COOKIE_PATH}; HttpOnly; SameSite=Strict"
