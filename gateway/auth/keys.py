"""API-key authentication: ``Authorization: Bearer <secret>`` → :class:`KeyInfo`.

Keys are stored as SHA-256 hex digests (``auth.keys[*].secret_sha256``, ``auth.admin_key_sha256``); the
presented secret is hashed and compared with every stored digest in constant time (``hmac.compare_digest``,
no early exit), so response time does not depend on which key matched. A Redis key store sits behind the
same ``await authenticate(header)`` interface: config keys are checked first, then (when given) the
:class:`gateway.auth.redis_store.RedisKeyStore` keys created with ``thinkgate keys create``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Protocol

from gateway.config import AuthConfig
from gateway.errors import AuthError

DEV_KEY_ID = "dev"
ADMIN_KEY_ID = "admin"  # the id of ``auth.admin_key_sha256``
ANONYMOUS_KEY_ID = "anonymous"


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """Who is calling: key id, tags for metering, the key's limits (``None`` = unlimited) and its policy
    (``gateway/pipeline/policy.py``; fields as in :class:`gateway.config.KeyConfig`)."""

    id: str
    tags: dict[str, str] = field(default_factory=dict)
    is_admin: bool = False
    budget_usd_day: Decimal | None = None
    budget_usd_month: Decimal | None = None
    rpm: int | None = None
    tpm: int | None = None
    cache_namespace: str | None = None
    allowed_tiers: tuple[str, ...] | None = None  # None = every tier
    on_disallowed_tier: str = "refuse"  # refuse (403) | downgrade
    max_thinking_budget: int | None = None  # tokens
    over_cap: str = "clamp"  # clamp | refuse (400) a max_tokens / thinking budget above the cap

    @classmethod
    def of(cls, k: KeySource) -> KeyInfo:
        """The caller identity of a declared key (:class:`gateway.config.KeyConfig`) or a stored one
        (:class:`gateway.auth.redis_store.KeyRecord`, whose budgets are decimal strings). Raises
        ``decimal.InvalidOperation`` for a budget that is not a decimal."""
        return cls(
            id=k.id,
            tags=dict(k.tags),
            budget_usd_day=Decimal(k.budget_usd_day) if k.budget_usd_day is not None else None,
            budget_usd_month=Decimal(k.budget_usd_month) if k.budget_usd_month is not None else None,
            rpm=k.rpm,
            tpm=k.tpm,
            cache_namespace=k.cache_namespace,
            allowed_tiers=tuple(k.allowed_tiers) if k.allowed_tiers is not None else None,
            on_disallowed_tier=k.on_disallowed_tier,
            max_thinking_budget=k.max_thinking_budget,
            over_cap=k.over_cap,
        )


class KeySource(Protocol):
    """What :meth:`KeyInfo.of` reads: the fields :class:`gateway.config.KeyConfig` and
    :class:`gateway.auth.redis_store.KeyRecord` share (budgets in USD, a Decimal or a decimal string)."""

    @property
    def id(self) -> str: ...
    @property
    def tags(self) -> Mapping[str, str]: ...
    @property
    def budget_usd_day(self) -> Decimal | str | None: ...
    @property
    def budget_usd_month(self) -> Decimal | str | None: ...
    @property
    def rpm(self) -> int | None: ...
    @property
    def tpm(self) -> int | None: ...
    @property
    def cache_namespace(self) -> str | None: ...
    @property
    def allowed_tiers(self) -> Sequence[str] | None: ...
    @property
    def on_disallowed_tier(self) -> str: ...
    @property
    def max_thinking_budget(self) -> int | None: ...
    @property
    def over_cap(self) -> str: ...


def sha256_hex(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def bearer_secret(authorization: str | None) -> str | None:
    """The secret of an ``Authorization: Bearer <secret>`` header value, or None when absent/malformed."""
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    value = value.strip()
    if scheme.lower() != "bearer" or not value:
        return None
    return value


class DigestLookup(Protocol):
    """A store of further keys by the SHA-256 hex of their secret (``gateway.auth.redis_store.RedisKeyStore``)."""

    async def lookup(self, sha256_hex: str) -> KeyInfo | None: ...


#: The 401 of a key no store knows. "invalid API key" alone left a new user guessing; the usual causes are these
#: (``thinkgate keys create`` run with another ``REDIS_URL`` or ``redis.key_prefix`` than the gateway's writes a key
#: this gateway never sees).
UNKNOWN_KEY = ("invalid API key: no active key of this gateway has this secret — mistyped, revoked, or made with "
               "`thinkgate keys create` on another Redis or key prefix than this gateway's")


class KeyStore:
    """Keys from the config file (plus the admin key), then ``redis_store`` if given.
    ``authenticate`` raises :class:`AuthError` (401)."""

    def __init__(self, cfg: AuthConfig, redis_store: DigestLookup | None = None) -> None:
        self.require_key = cfg.require_key
        self.redis_store = redis_store
        self._entries: list[tuple[bytes, KeyInfo]] = [
            (bytes.fromhex(k.secret_sha256 or ""), KeyInfo.of(k)) for k in cfg.keys
        ]
        if cfg.admin_key_sha256:
            self._entries.append((bytes.fromhex(cfg.admin_key_sha256), KeyInfo(id=ADMIN_KEY_ID, is_admin=True)))

    async def authenticate(self, authorization: str | None) -> KeyInfo:
        """Resolve the ``Authorization`` header to a key; raises AuthError when missing or unknown."""
        secret = bearer_secret(authorization)
        if secret is None:
            if not self.require_key:
                return KeyInfo(id=ANONYMOUS_KEY_ID)
            raise AuthError(
                "missing API key: send 'Authorization: Bearer <key>' (on /v1/messages also 'x-api-key: <key>')",
                code="missing_api_key"
            )
        digest = hashlib.sha256(secret.encode()).digest()
        found: KeyInfo | None = None
        for stored, info in self._entries:
            # Evaluate every entry: no early exit, so timing does not reveal the position of a match.
            if hmac.compare_digest(stored, digest) and found is None:
                found = info
        if found is None and self.redis_store is not None:
            found = await self.redis_store.lookup(digest.hex())
        if found is None:
            if not self.require_key:
                return KeyInfo(id=ANONYMOUS_KEY_ID)
            raise AuthError(UNKNOWN_KEY)
        return found


def dev_key_only_admin(auth: AuthConfig, key_id: str) -> bool:
    """True when ``key_id`` is the development key of embedded defaults (``thinkgate serve`` registered
    ``auth.dev_key_file`` as the only key, no admin key): its holder is the operator, so the operator's pages (the
    dashboard, ``/metrics``) take it as admin — while it is the single key and still the file's."""
    if auth.admin_key_sha256 or len(auth.keys) != 1 or key_id != DEV_KEY_ID or auth.keys[0].id != DEV_KEY_ID:
        return False
    try:
        secret = auth.dev_key_file.read_text().strip()
    except OSError:
        return False
    stored = auth.keys[0].secret_sha256 or ""
    return bool(secret) and hmac.compare_digest(hashlib.sha256(secret.encode()).hexdigest(), stored)


def ensure_dev_key(path: Path) -> tuple[str, bool]:
    """Return (secret, created) of the development key in ``path``, creating it (mode 0600) if missing.

    The file holds the plain secret (it is the operator's local copy); the gateway keeps only its hash.
    """
    if path.is_file():
        secret = path.read_text().strip()
        if secret:
            return secret, False
    path.parent.mkdir(parents=True, exist_ok=True)
    secret = "tg-dev-" + secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    os.chmod(path, 0o600)
    return secret, True
