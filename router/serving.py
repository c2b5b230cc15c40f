"""The router as the gateway uses it: load at start, score per request, reload a new file without restart.

:class:`RouterService` is a :class:`router.base.Router` (``score(text) -> float``) holding the current
:class:`router.model.TrainedRouter`, swapped atomically on reload (a reference assignment; scoring threads
never see a half-loaded router).

**No router file, or one that fails to load** (``routing.on_router_error``):

* ``refuse_start`` — :meth:`RouterService.from_config` raises :class:`RouterUnavailable`; the gateway does
  not start. For deployments where an unrouted gateway would silently cost too much.
* ``default_tier`` (the default) — a warning is logged and every ``auto`` request goes to
  ``routing.default_tier`` (``long`` by default) with route reason ``fallback`` and no difficulty header;
  :attr:`RouterService.available` is False and :attr:`RouterService.error` says why. We chose this default
  because it keeps answers correct (the capable tier) and the gateway up, at a visible cost (log line,
  route reason in headers and usage events), and a later valid file is picked up by the watcher/reload.

**Reload**: :meth:`reload` loads the configured path now (admin endpoint); :meth:`reload_if_changed` does
so only when the file's (mtime_ns, size, inode) changed and at most every ``reload_interval_s``; the gateway
runs it from a background task (:meth:`watch`). A reload that fails keeps the router in service and
records the error; a service that had no router stays in ``default_tier`` mode until a load succeeds.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from router.base import Router, register
from router.errors import ThinkGateError
from router.model import TrainedRouter
from router.persistence import RouterFileError, load_router
from router.policy import (
    budget_map_of,
    budget_sentence,
    cold_start_summary,
    embed_cuts,
    guarantee_sentence,
    serving,
)

log = logging.getLogger("thinkgate.router")

_Signature = tuple[int, int, int]


class RouterUnavailable(ThinkGateError, RuntimeError):
    """No usable router and ``on_router_error: refuse_start``; the message says why and what to do."""


#: How many hex digits of a router file's SHA-256 name it where the gateway's retraining keeps it by content
#: (``p router:current``'s ``digest``, the ``sha256:`` entries of ``p router:bad``, the kept copies
#: ``<state_dir>/<digest>.skops``): 128 bits, the length ``p router:configured`` has always used.
DIGEST_HEX = 32


def file_version(router: TrainedRouter, sha256: str | None) -> str:
    """What a router file is called in ``router:current`` and the retraining audit events: its metadata
    ``version``, else its ``created_utc``, else ``file-`` and the first 12 hex digits of its content's SHA-256
    (``""`` when that is not known either)."""
    meta = router.metadata
    return str(meta.get("version") or meta.get("created_utc") or (f"file-{sha256[:12]}" if sha256 else ""))


def file_signature(path: Path) -> _Signature | None:
    """(mtime_ns, size, inode) of ``path``: a file rewritten or renamed over reads differently; None when it cannot
    be read."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def file_sha256(path: Path) -> str | None:
    """The SHA-256 (hex) of ``path``'s bytes: the file's identity in ``GET /v1/models`` (with its name), where the
    absolute path would tell every key the server's layout; None when it cannot be read."""
    h = hashlib.sha256()
    try:
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError:
        return None
    return h.hexdigest()


_CACHE: dict[tuple[str, _Signature], TrainedRouter] = {}
_CACHE_LOCK = threading.Lock()


def load_router_cached(path: Path) -> TrainedRouter:
    """:func:`router.persistence.load_router` for serving (``pipeline=False``: NumPy only when the file carries
    its fast-path arrays) memoised on (resolved path, mtime_ns, size, inode), so many gateway apps in one
    process (tests, workers) load a file once. Keeps the 2 most recent entries."""
    sig = file_signature(path)
    if sig is None:
        raise RouterFileError(path, "not found")
    key = (str(path.resolve()), sig)
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
    if hit is not None:
        return hit
    router = load_router(path, pipeline=False)
    with _CACHE_LOCK:
        _CACHE[key] = router
        while len(_CACHE) > 2:
            _CACHE.pop(next(iter(_CACHE)))
    return router


def _cold_start_info(meta: dict[str, Any]) -> dict[str, Any] | None:
    cs = meta.get("cold_start")
    if not isinstance(cs, dict):
        return None
    return {"serves": "router" if cs.get("choice") == "learned" else "length",
            "validated_on": cs.get("validated_on"), "worse_than_length": cs.get("worse_than_length"),
            "summary": cold_start_summary(meta)}


@register
class RouterService(Router):
    """The gateway's router handle. Build with :meth:`from_config`. Thread-safe."""

    name = "service"

    def __init__(
        self,
        path: Path | None,
        routed_tiers: list[str],
        config_thresholds: list[float] | None,
        default_tier: str,
        reload_interval_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.routed_tiers = list(routed_tiers)
        self.config_thresholds = None if config_thresholds is None else list(config_thresholds)
        self.default_tier = default_tier
        self.reload_interval_s = reload_interval_s
        self._clock = clock
        self._router: TrainedRouter | None = None
        self._signature: _Signature | None = None
        self._sha256: str | None = None  # of the file in service (read once per load)
        self._error: str | None = None
        self._next_check = 0.0
        self._lock = threading.Lock()  # serialises reloads (scoring never takes it)
        self.reloads = 0
        #: versions (:func:`file_version`) a reload refuses, the router in service kept: the gateway's retraining
        #: sets the rolled-back ones of ``p router:bad`` written before it named files by content (version-only
        #: entries), so a file written back over the path it serves is not served again (replaced whole, never
        #: mutated: reloads read it from worker threads)
        self.refused_versions: frozenset[str] = frozenset()
        #: content digests (the first :data:`DIGEST_HEX` hex digits of the SHA-256) a reload refuses: the rolled-back
        #: routers of ``p router:bad`` — by their bytes, so neither another file that happens to carry a rolled-back
        #: version nor the rolled-back bytes under another name are confused (replaced whole, as above)
        self.refused_digests: frozenset[str] = frozenset()

    @classmethod
    def from_config(cls, cfg: Any, clock: Callable[[], float] = time.monotonic) -> RouterService:
        """Build from :class:`gateway.config.RoutingConfig` and load ``cfg.router_path``.

        Raises :class:`RouterUnavailable` when no router could be loaded and
        ``cfg.on_router_error == "refuse_start"``; otherwise logs a warning and serves in default-tier mode.
        """
        svc = cls(
            path=None if cfg.router_path is None else Path(cfg.router_path),
            routed_tiers=list(cfg.routed_tiers),
            config_thresholds=cfg.thresholds,
            default_tier=cfg.default_tier,
            reload_interval_s=cfg.reload_interval_s,
            clock=clock,
        )
        try:
            svc.reload()
        except RouterFileError as exc:
            if cfg.on_router_error == "refuse_start":
                raise RouterUnavailable(
                    f"{exc}; not starting (routing.on_router_error: refuse_start). Fix routing.router_path, "
                    "build one with `thinkgate router fit` + `calibrate`, or set on_router_error: default_tier."
                ) from None
            log.warning("%s; routing every 'auto' request to tier %r (routing.on_router_error: default_tier)",
                        exc, cfg.default_tier)
        else:  # once at start: a fresh gateway on the shipped default says which default and on what it was checked
            line = cold_start_summary(svc._router.metadata if svc._router is not None else None)
            if line:
                log.info("%s (%s)", line, svc.path)
        svc._next_check = svc._clock() + svc.reload_interval_s
        return svc

    # ---- state -----------------------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """True when a router is loaded; False = default-tier mode (route reason ``fallback``)."""
        return self._router is not None

    @property
    def mode(self) -> str:
        """``"router"`` or ``"default_tier"``."""
        return "router" if self._router is not None else "default_tier"

    @property
    def error(self) -> str | None:
        """The last load error (None after a successful load)."""
        return self._error

    @property
    def router(self) -> TrainedRouter | None:
        return self._router

    @property
    def sha256(self) -> str | None:
        """The SHA-256 (hex) of the bytes in service (None: default-tier mode, or the file was replaced while it was
        read — the watcher loads it again)."""
        return self._sha256 if self._router is not None else None

    def refused_reason(self) -> str | None:
        """Why a reload would refuse the router in service now (its version or digest in :attr:`refused_versions` /
        :attr:`refused_digests`, set after it was loaded), or None."""
        r = self._router
        return None if r is None else self._refusal(r, self._sha256)

    def _refusal(self, router: TrainedRouter, sha256: str | None) -> str | None:
        if sha256 is not None and sha256[:DIGEST_HEX] in self.refused_digests:
            return (f"is the router file with sha256 {sha256[:DIGEST_HEX]}, which was rolled back (its realised floor "
                    "fell; router:bad): not served again — save it under a new version to serve it anyway")
        if (version := file_version(router, sha256)) in self.refused_versions:
            return (f"is version {version}, which was rolled back (its realised floor fell; router:bad): not served "
                    "again — save it under a new version to serve it anyway")
        return None

    @property
    def version(self) -> str | None:
        """The router in service's :func:`file_version` (None: default-tier mode)."""
        r = self._router
        return None if r is None else file_version(r, self._sha256)

    @property
    def thresholds(self) -> list[float]:
        """Cut points in use: ``routing.thresholds`` when configured, else the router file's — on a longer ladder
        than the file was calibrated for, its cuts at the top boundaries and 0.0 below (:func:`embed_cuts`). Empty
        in default-tier mode without configured thresholds."""
        if self.config_thresholds is not None:
            return list(self.config_thresholds)
        r = self._router
        return embed_cuts(r.thresholds, len(self.routed_tiers)) if r is not None else []

    def info(self, *, with_path: bool = True) -> dict[str, Any]:
        """A JSON-able summary (for ``/v1/models`` and the admin reload answer). The file is named by ``file`` (its
        name) and ``sha256`` (of the bytes in service); ``with_path=False`` leaves out its full path — there and in
        ``error`` — for views any API key reads (the path tells a client the server's directory layout)."""
        r = self._router
        meta = r.metadata if r is not None else {}
        error = self._error
        if not with_path and error is not None and self.path is not None:
            error = error.replace(str(self.path), self.path.name)
        out = {
            "mode": self.mode,
            "path": None if self.path is None else str(self.path),
            "file": None if self.path is None else self.path.name,
            "sha256": self._sha256 if r is not None else None,
            "router": meta.get("router"),
            "version": meta.get("version") or meta.get("created_utc"),
            "created_utc": meta.get("created_utc"),
            "training_data_sha256": meta.get("training_data_sha256"),
            "thresholds": self.thresholds,
            # how the cut points were chosen and the share of requests they sent up (router/fit/calibrate.py)
            "calibration": meta.get("thresholds_calibration"),
            # what `auto` serves from this file (router/policy.py): the policy and its promise, in one sentence
            "policy": (serving(meta) or {}).get("policy"),
            "guarantee": guarantee_sentence(meta),
            # a dial model's router: the score -> thinking budget map it serves on one prompted tier
            "budgets": budget_sentence(meta),
            # the shipped default's cold-start validation (router/fit/coldstart.py): what it serves, checked on what
            "cold_start": _cold_start_info(meta),
            "error": error,
            "reloads": self.reloads,
        }
        if not with_path:
            del out["path"]
        return out

    # ---- scoring ---------------------------------------------------------------------------------------

    def score(self, text: str) -> float:
        """P(needs the long tier) for a routing window. Raises :class:`RouterUnavailable` in default-tier
        mode (callers check :attr:`available` first)."""
        r = self._router
        if r is None:
            raise RouterUnavailable(self._error or "no router loaded")
        return r.score(text)

    def tier_for(self, score: float) -> str:
        """``routed_tiers[i]`` with i = number of thresholds ≤ ``score`` (the gateway's rule)."""
        return self.routed_tiers[sum(1 for t in self.thresholds if score >= t)]

    # ---- reload ----------------------------------------------------------------------------------------

    def reload(self, expected: str | None = None) -> TrainedRouter:
        """Load ``path`` now and swap it in. On failure raise :class:`RouterFileError` and keep the current
        router (if any); the error is kept in :attr:`error`. ``expected`` (the first :data:`DIGEST_HEX` hex digits
        of a SHA-256): serve the file only when its bytes are those — the gateway's retraining names the router every
        replica serves by content (``p router:current``), and a file of other bytes at that path is not it."""
        with self._lock:
            if self.path is None:
                self._error = "no router file configured (routing.router_path is null)"
                raise RouterFileError(None, self._error)
            sig = file_signature(self.path)
            try:
                router = load_router_cached(self.path)
                self._check_thresholds(router)
                self._check_budgets(router)
            except RouterFileError as exc:
                self._signature = sig  # do not retry the same bytes on every check
                self._error = str(exc)
                raise
            digest = file_sha256(self.path)
            if file_signature(self.path) != sig:
                digest = None  # replaced while it was read: not the bytes loaded (the watcher loads it next)
            if expected is not None and (digest is None or digest[:DIGEST_HEX] != expected):
                # not this file's fault (as a refusal, below): the router in service and its error stay
                raise RouterFileError(self.path, f"holds other bytes (sha256 {(digest or '?')[:DIGEST_HEX]}) than "
                                                 f"the router named to be served (sha256 {expected}): not served")
            if (refused := self._refusal(router, digest)) is not None:
                self._signature = sig  # the same bytes are not tried again
                raise RouterFileError(self.path, refused)
            self._router, self._signature, self._error, self._sha256 = router, sig, None, digest
            self.reloads += 1
            log.info("router loaded from %s (thresholds %s)", self.path, self.thresholds)
            if (said := budget_sentence(router.metadata)) is not None:
                log.info("router: %s", said)
            return router

    def check(self, router: TrainedRouter) -> None:
        """Raise :class:`RouterFileError` when this service would refuse ``router`` at load (its thresholds for
        the routed tiers, its budget map): what :meth:`reload` checks, for a file about to be named the promoted
        one."""
        self._check_thresholds(router)
        self._check_budgets(router)

    def _check_budgets(self, router: TrainedRouter) -> None:
        """A malformed score -> budget map refuses the file at load (not a 500 per request later)."""
        try:
            budget_map_of(router.metadata)
        except ValueError as exc:
            raise RouterFileError(self.path, str(exc)) from None

    def _check_thresholds(self, router: TrainedRouter) -> None:
        """``routing.thresholds``, when set, must have one cut per boundary; a file's own may have fewer (a file
        calibrated for a shorter ladder: :func:`embed_cuts`, said once at load), never more or none."""
        need = len(self.routed_tiers) - 1
        if self.config_thresholds is not None:
            ok = len(self.config_thresholds) == need
        else:
            ok = 1 <= len(router.thresholds) <= need
        if not ok:
            raise RouterFileError(
                self.path,
                f"has {len(router.thresholds)} calibrated threshold(s) but routing.routed_tiers "
                f"{self.routed_tiers} needs {need}: run `thinkgate router calibrate` or set routing.thresholds",
            )
        if self.config_thresholds is None and len(router.thresholds) < need:
            below = self.routed_tiers[:need - len(router.thresholds)]
            log.info("router file %s has %d cut(s) for %d routed tiers: they serve the top boundaries; nothing is "
                     "routed to %s until a router with their cuts is loaded (routing.retrain learns them from "
                     "explored answers; routing.thresholds would pin the cuts of every file, promoted ones too)",
                     self.path, len(router.thresholds), len(self.routed_tiers), below)

    def reload_if_changed(self, *, force_check: bool = False) -> bool:
        """Reload when the file changed since the last attempt; looks at the file at most every
        ``reload_interval_s`` (unless ``force_check``). Returns True when a new router was swapped in.
        Never raises (errors are logged and kept in :attr:`error`)."""
        now = self._clock()
        if self.path is None or (now < self._next_check and not force_check):
            return False
        self._next_check = now + self.reload_interval_s
        sig = file_signature(self.path)
        if sig is None or sig == self._signature:
            return False
        try:
            self.reload()
        except RouterFileError as exc:
            kept = "keeping the loaded router" if self._router is not None else "staying on the default tier"
            log.error("router reload failed: %s; %s", exc, kept)
            return False
        return True

    async def watch(self, stop: asyncio.Event | None = None) -> None:
        """Background task: :meth:`reload_if_changed` every ``reload_interval_s`` in a worker thread (a load
        takes ~1 s and must not block the event loop). Runs until cancelled or ``stop`` is set."""
        while stop is None or not stop.is_set():
            await asyncio.sleep(self.reload_interval_s)
            await asyncio.to_thread(self.reload_if_changed, force_check=True)

