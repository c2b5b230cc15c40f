"""Automatic retraining and safe promotion (``routing.retrain``, off unless ``every_outcomes`` > 0).

One :class:`RetrainTrigger` per gateway process, a background task (:meth:`RetrainTrigger.run`) that every
``interval_s``:

0. **adopts** a new file written to ``routing.router_path`` (:meth:`RetrainTrigger.adopt_configured`) as the
   promoted router, with an operator's ``promote`` event — while a promotion is in force the replicas serve
   ``router:current``, and the file was otherwise never served —, unless it was rolled back (step 3). What is
   adopted is the bytes read, kept as ``state_dir/<digest>.skops`` (:func:`keep_copy`): the path can be written
   again at any time (a replica's lagging copy, a rolled-back file put back), the copy never changes;
1. **follows** the promoted router: ``p router:current`` (a hash: ``path``, ``version``, ``digest``, ``previous``,
   ``previous_version``, ``previous_digest``: :data:`ROUTER_FIELDS`) names the file every replica with retraining
   on serves, and its content (``digest``, :func:`file_digest`); when it differs from this replica's
   ``RouterService.path`` the replica points its service there and reloads it (the hot reload of
   ``/admin/router/reload``, in a worker thread), serving it only if its bytes are the ones named (a state written
   before ``digest`` existed: the path as it is);
2. **fits** (``fit_here``, one replica at a time: the lock ``p router:lock``, holding this trigger's token, so
   the replica that took it can take it again after a Redis outage left it behind; renewed while the fit runs, and
   a fit that lost it all the same drops its verdict): once the outcome stream
   (``p outcomes``) has had ``every_outcomes`` more entries written than at the last judged fit (counted as written,
   :meth:`OutcomeStore.added`: its length stops at ``stream_maxlen``; ``p router:fitted_at``,
   written once the verdict is in — a Redis failure before then, e.g. reading the outcomes, leaves it, and the
   next tick fits again; a fit that raises is not retried on the same outcomes), reads the newest
   ``max_outcomes`` outcomes and runs :func:`router.fit.promote.fit_and_save` **in a child process** (``fit_in:
   process``, the default: one spawned worker at ``nice`` +10
   (``fit_nice``), started at the first fit and kept) or, with ``fit_in:
   thread``, in a worker thread: fit on those outcomes, compare with the router in service on the held-back
   slice under the served-floor rule (two or more routed tiers: one cut per boundary, ``router/fit/promote.py``).
   Better → the candidate is written to ``state_dir/router-<version>.skops`` (versioned; the files before it are
   kept, up to ``keep_files``: "Retention" below), its bytes to ``p router:file:{digest}`` (a replica whose state
   dir is its own — an ``emptyDir`` per pod — has no such file and keeps a copy from there; the key goes once a
   transition stops naming the router), ``p router:current`` is set with the previous path, every replica follows.
   Why a process: a fit holds the GIL — measured on 1,536 outcomes (fit + save 2.5–5.5 s), a fit in a
   thread stretches the serving loop's 1 ms ticks to p99 11–16 ms, max 25–435 ms; in the child p99 0.2–1.0 ms
   (``python -m bench.retrain_lag``; bench/RESULTS.md, "Retraining off the serving loop");
3. **rolls back** (checked once a third of ``realised_min`` new outcomes are in): the realised floor of the
   promoted router (:func:`router.fit.realised.realised`: the feedback on the answers it served, explored ones
   left out; unbiased through the spot-check arm once ``spot_check_min`` spot-check answers are graded, else under
   the nesting assumption) below ``floor`` on at least ``realised_min`` graded cheap answers → ``p router:current`` goes
   back to the previous file (the router is added to ``p router:bad`` by its digest, ``sha256:<digest>``: its bytes
   written to ``routing.router_path`` again are not adopted, step 0, nor loaded by any replica's reload; another
   file with the same version is — an entry without ``sha256:``, written before, refuses its version). With three
   or more routed tiers every tier
   below the top is the cheap side: the spot checks sample every decision below the top alike, so their reading
   stays unbiased; the nesting fallback pools the lower tiers' grades into one cheap accuracy.

Each promotion, refusal and rollback is an audit event in the stream ``p router:history`` (field ``e`` = JSON:
``{"event": "promote" | "keep" | "rollback", "ts", "version", "previous", "path", "outcomes", "comparison" |
"realised", "reason"}``; a promotion superseded before it was written, a ``keep`` with ``current``: the file
``router:current`` had moved to), read by ``thinkgate router history`` and summarised in ``GET /v1/models``
(``router_status.learning``).

**Transitions** of ``p router:current`` (an adoption, a fit's promotion, a rollback, ``thinkgate router retrain
--output``) are one compare-and-set each (:class:`CurrentRouter`, :data:`TRANSITION_LUA`): the hash carries a
generation ``gen``, bumped by every transition; a writer names the ``gen`` and ``path`` it read, and the script
writes the new state with its ``promote`` / ``rollback`` audit event only when they are still there. Separate reads
and writes let an adoption and a rollback on two replicas interleave: the rollback overwritten (the rolled-back
file kept as ``previous``), or the adoption lost, with audit events for both. A writer whose read went stale reads
again (an adoption: the operator's file still replaces whatever serves now) or gives up (a rollback judged the
router that no longer serves; a fit's candidate was compared with it: a ``keep`` says so). An adoption also sets
``p router:adopted:{digest}`` in the same script, for ``readopt_after_s``: one promote event per file, whoever adopts
it (a replica, or the command that wrote it), and a replica's lagging copy of a replaced file is not adopted back;
after that window the same file written again is adopted again (an operator putting an earlier router back).

**Retention** (``keep_files``, 20 by default; None: off): every adoption and promotion adds a file to the state dir
(a few hundred KB to a few MB). A replica that follows a transition (:meth:`RetrainTrigger.follow`) then removes the
router files nothing needs any more (:meth:`RetrainTrigger._retain`, :func:`prune_state_dir`): it keeps what
``router:current`` names (the router serving and its ``previous``, the only one a rollback can go back to), the file
it serves, the files it saw named in the last :data:`RETAIN_NAMED_S` (a replica sharing the directory that has not
followed yet serves one), any written in the last :data:`RETAIN_YOUNG_S` and the newest ``keep_files`` others; only
the names ThinkGate writes there are ever removed.

**Exploration** (``explore`` > 0): :meth:`explore` is the routing hook: a routed decision for a tier above the
cheapest goes one tier down with probability ``explore`` (seeded per process), with route reason ``explore``
(the header, the usage event, the outcome), so the realised floor leaves those answers out on every replica —
they are the router's teacher, not its choice.

**Spot check** (``spot_check`` > 0, default 5%): :meth:`spot_check` is the second hook: a routed decision for a
tier below the top goes to the top tier with probability ``spot_check``, with route reason ``spot_check`` (the
header, the usage event, the outcome). Graded, those answers measure the top tier on the questions the router
sends cheap — the control arm that makes the realised floor unbiased.

The offline fit code (``router.fit``) is imported by name inside the fit (the child imports it itself), as the
verifier judge imports the task checkers (the request path's import contract keeps ``router.fit`` out of its imports).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import multiprocessing
import os
import random
import re
import tempfile
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import orjson

from gateway.config import RetrainConfig, Settings
from gateway.control.outcomes import OutcomeStore
from gateway.ledger.outcome import Outcome
from gateway.state.batches import new_token
from gateway.state.breaker import Breaker, RedisDown
from gateway.state.redis import RedisHandle, as_bytes
from router.durable import fsync_dir
from router.persistence import load_router
from router.serving import DIGEST_HEX, RouterService, file_signature, file_version

log = logging.getLogger("thinkgate.retrain")

HISTORY_MAXLEN = 10_000
#: Compare-and-set tries of one transition before it is left for the next tick (each retry follows a transition
#: by another writer, and those are minutes apart: more than a few in a row means something is wrong)
TRANSITION_TRIES = 8

# The one way p router:current changes (module doc, "Transitions").
# KEYS: router:current, router:history[, router:adopted:{digest} and router:configured (adopt) | router:bad
# (rollback)]. ARGV: expected gen, expected path, kind ("promote" | "adopt" | "rollback"), the audit event (JSON),
# history maxlen, the digest (adopt) | the router:bad entry (rollback) | "", adopted TTL s (adopt) | 0, then the new
# hash's fields and values (every one of ROUTER_FIELDS: a field the new state has no value for is written empty, not
# left from the old one), and ``digest_gen`` = the new gen (:meth:`CurrentRouter.read`). A hash without ``gen``
# (written before it existed, or never) reads as gen 0.
# Returns {1, new gen} (written), {0, gen, path} (router:current is not what the writer read: nothing written) or
# {-1} (adopt: the file is adopted already, by this writer or another: nothing written).
TRANSITION_LUA = """
if ARGV[3] == 'adopt' and redis.call('EXISTS', KEYS[3]) == 1 then return {-1} end
local gen = redis.call('HGET', KEYS[1], 'gen') or '0'
local path = redis.call('HGET', KEYS[1], 'path') or ''
if gen ~= ARGV[1] or path ~= ARGV[2] then return {0, gen, path} end
if ARGV[3] == 'adopt' then
  redis.call('SET', KEYS[3], '1', 'EX', ARGV[7])
  redis.call('SET', KEYS[4], ARGV[6])
elseif ARGV[3] == 'rollback' then
  redis.call('SADD', KEYS[3], ARGV[6])
end
local new = redis.call('HINCRBY', KEYS[1], 'gen', 1)
redis.call('HSET', KEYS[1], 'digest_gen', new, unpack(ARGV, 8))
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'e', ARGV[4])
return {1, new}
"""
# The fit lock's release. KEYS: router:lock. ARGV: the releasing trigger's token. Deletes it only while it holds that
# token (1), else leaves it (0).
RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# The fit lock's renewal. KEYS: router:lock. ARGV: the renewing trigger's token, the new TTL in ms. Sets the TTL only
# while the lock holds that token (1), else leaves it (0): expired, or another replica's since.
RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
#: The fields of ``p router:current`` a transition writes (besides ``gen``): the file every replica serves (``path``,
#: its ``version`` and content ``digest``: :func:`file_digest`) and the one before it, for a rollback. ``digest`` /
#: ``previous_digest`` empty: a state written before routers were kept by content (its ``path`` is loaded as it is).
ROUTER_FIELDS = ("path", "version", "digest", "previous", "previous_version", "previous_digest")
#: How ``p router:bad`` names a rolled-back router by its content (:func:`bad_entry`); an entry without it is a
#: version, as every entry was before (still refused by version).
BAD_DIGEST = "sha256:"

# --- retention of the state dir (prune_state_dir): the only names it ever removes are the ones ThinkGate writes there
#: an adopted router's copy (:func:`router_copy`)
KEPT_COPY = re.compile(rf"[0-9a-f]{{{DIGEST_HEX}}}\.skops")
#: a fit's promoted candidate (``router-<version>.skops``, the version :meth:`RetrainTrigger.fit_once` makes)
FIT_FILE = re.compile(r"router-auto-\d{8}T\d{6}-\d{3,}\.skops")
#: a temporary file left by a writer that died: :func:`stage_copy`'s, or :func:`router.persistence.save_router`'s
#: writing a fit's candidate (``<name>.<random>.tmp``)
LEFTOVER = re.compile(rf"\.router-[a-z0-9_]+\.tmp|{FIT_FILE.pattern}\.[a-z0-9_]+\.tmp")
#: seconds a file written to the state dir is never removed: a fit's candidate or an adopted copy about to be named by
#: ``router:current`` (its transition waiting for Redis), a temporary file still being written
RETAIN_YOUNG_S = 600.0
#: seconds a file a replica saw ``router:current`` name is kept after it stopped being named: a replica sharing the
#: directory that has not followed yet serves it (after a rollback, or two transitions within one of its ticks)
RETAIN_NAMED_S = 600.0


def state_dir_of(settings: Settings) -> Path:
    """Where versioned router files go: ``routing.retrain.state_dir``, else ``<usage spool dir>/routers``."""
    cfg = settings.routing.retrain
    return cfg.state_dir if cfg.state_dir is not None else settings.metering.spool_path.parent / "routers"


class RetrainTrigger:
    """Follow, fit, promote, roll back (module doc). Build in ``create_app``; :meth:`run` inside the event loop."""

    def __init__(self, settings: Settings, service: RouterService, handle: RedisHandle, breaker: Breaker,
                 outcomes: OutcomeStore, rng: random.Random | None = None) -> None:
        self.cfg: RetrainConfig = settings.routing.retrain
        self.tiers = list(settings.routing.routed_tiers)  # cheapest first: one cut per adjacent pair
        self.top = self.tiers[-1]
        self.service = service
        self.handle = handle
        self.redis = handle.client
        self.prefix = handle.prefix
        # p router:current: every write of it goes through here
        self.current = CurrentRouter(handle, breaker, self.cfg.readopt_after_s)
        self.breaker = breaker
        self.outcomes = outcomes
        self.dir = state_dir_of(settings)
        self.rng = rng or random.Random()
        self.fits = 0
        self.fitting = False
        self.last: dict[str, Any] | None = None  # the last audit event of this replica
        self.realised_last: dict[str, Any] | None = None  # the last realised-floor reading (status)
        self._checked_at = -1  # outcome count at the last realised-floor check
        self._pool: ProcessPoolExecutor | None = None  # the fit process (fit_in: process), made at the first fit
        self._token = new_token()  # this trigger's value of the fit lock
        self._release = self.redis.register_script(RELEASE_LUA)
        self._renew = self.redis.register_script(RENEW_LUA)
        # a verdict's Redis writes not done yet (a Redis failure cut them short): done first at the next tick
        self._unwritten: list[Callable[[], Awaitable[Any]]] = []
        # routing.router_path and its (mtime, size, inode) as last read here (None: not yet — the first tick reads
        # it and compares its digest with the deployment's, :meth:`adopt_configured`)
        self.configured = settings.routing.router_path.resolve() if settings.routing.router_path else None
        self._configured_seen: tuple[int, int, int] | None = None
        # (the file loaded, the path router:current named, its digest) at this replica's last follow (:meth:`_served`)
        self._followed: tuple[Path, Path, str] | None = None
        # file name -> time.monotonic() when router:current last named it here (:meth:`_saw`, :meth:`_retain`)
        self._named: dict[str, float] = {}

    # --- keys -------------------------------------------------------------------------------------------
    @property
    def k_history(self) -> str:
        return history_key(self.prefix)

    @property
    def k_current(self) -> str:
        return f"{self.prefix}router:current"

    @property
    def k_lock(self) -> str:
        return f"{self.prefix}router:lock"

    @property
    def k_fitted(self) -> str:
        return f"{self.prefix}router:fitted_at"

    @property
    def k_bad(self) -> str:
        """The versions rolled back (a set, written by the rollback's compare-and-set): never adopted again."""
        return f"{self.prefix}router:bad"

    @property
    def k_realised(self) -> str:
        return f"{self.prefix}router:realised"

    @property
    def k_looks(self) -> str:
        """How many promotion comparisons this deployment has judged (both routers estimated)."""
        return f"{self.prefix}router:looks"

    # --- exploration ------------------------------------------------------------------------------------
    def explore(self, i: int) -> int:
        """The routing hook (module doc): ``i`` or, with probability ``explore`` when ``i`` > 0, ``i - 1``
        (served with route reason ``explore``)."""
        if i <= 0 or self.cfg.explore <= 0 or self.rng.random() >= self.cfg.explore:
            return i
        return i - 1

    def spot_check(self) -> bool:
        """The spot-check hook (module doc): whether this decision below the top tier is served by the top tier."""
        return self.cfg.spot_check > 0 and self.rng.random() < self.cfg.spot_check

    # --- status -----------------------------------------------------------------------------------------
    def status(self, *, with_paths: bool = True) -> dict[str, Any]:
        """For ``/v1/models``: the configuration, this replica's fits, its last audit event and the last reading
        of the promoted router's realised floor — the fitting replica's, on every replica (``p router:realised``:
        ``{"version", "method", "n", "n_cheap", "n_spot_check", "n_top", "accuracy_ratio", "ratio_low",
        "holds_floor", ...}``; None before the first check of a promoted router). ``with_paths=False`` (what any
        API key reads): no ``state_dir``, and the last event's files (``path``, a keep's ``current``) by name only."""
        last = self.last
        if not with_paths and last is not None:
            last = {**last, **{f: Path(str(last[f])).name for f in ("path", "current") if last.get(f)}}
        return {"every_outcomes": self.cfg.every_outcomes, "explore": self.cfg.explore,
                "spot_check": self.cfg.spot_check, "floor": self.cfg.floor,
                "fit_here": self.cfg.fit_here, "state_dir": str(self.dir) if with_paths else None,
                "fits": self.fits, "fitting": self.fitting, "last_event": last, "realised": self.realised_last}

    # --- loop -------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """At process start, before the first request: serve the promoted router now (a restarted replica served
        the configured file — and had its answers' outcomes stamped with its version — until the first tick,
        ``interval_s`` later) and read the last audit event (``router_status.learning.last_event`` read null after
        a restart). Redis down or slow: skipped, the ticks catch up."""
        try:
            await asyncio.wait_for(self.read_bad(), START_FOLLOW_S)
            # shielded: a slow reload that outlives the wait still finishes (or rolls the path back) on its own
            await asyncio.wait_for(asyncio.shield(self.follow()), START_FOLLOW_S)
            if (why := self.service.refused_reason()) is not None:
                # loaded at start, before router:bad was read, and router:current named no other router this replica
                # could load (a state written before routers were kept by content names routing.router_path itself;
                # or the copy it names is missing here and this replica's copy of the path holds other bytes):
                # nothing else to go to — said, loudly (docs/closed-loop.md)
                log.error("retrain: serving %s: it %s. router:current names no other router this replica can load: "
                          "replace the file, or promote another router", self.service.path, why)
            last = await asyncio.wait_for(read_history(self.handle, self.breaker, count=1), START_FOLLOW_S)
            if last and self.last is None:
                self.last = last[-1]
        except Exception as exc:  # Redis down or slow, a bad history entry: never a reason not to start
            log.warning("retrain: the promoted router was not read at start (%s: %s); the next tick follows it",
                        type(exc).__name__, exc)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Every ``interval_s`` until cancelled: follow, fit when due, check the realised floor."""
        if len(self.tiers) < 2:
            log.warning("routing.retrain: automatic retraining needs at least two routed tiers; off")
            return
        if len(self.tiers) > 2:  # what k tiers change: say it once, at start
            log.info("routing.retrain: %d routed tiers %s: one cut per boundary, each held to its share of the "
                     "floor; q from each boundary's explored arm (spot checks only with two tiers); the "
                     "realised floor reads every tier below %s as the cheap side", len(self.tiers), self.tiers,
                     self.top)
        while stop is None or not stop.is_set():
            await asyncio.sleep(self.cfg.interval_s)
            try:
                await self.tick()
            except RedisDown as exc:
                log.debug("retrain: redis down (%s)", exc)
            except Exception:
                log.exception("retrain: tick failed")

    async def tick(self) -> None:
        """One round: the writes a Redis failure left undone, follow, then (``fit_here``) check the realised floor
        and fit when due."""
        await self._write([])
        await self.read_bad()
        await self.adopt_configured()
        await self.follow()
        if not self.cfg.fit_here:
            await self.read_realised()
            return
        n = await self.outcomes.added()  # written so far, not the stream's length (capped)
        # the realised floor first: a fit due at the same tick would replace a router whose floor broke by a
        # promotion ("holds the floor where the router in service does not") — the broken floor never recorded, the
        # audit trail saying promote where it is a rollback. Read only once enough new outcomes (a third of
        # realised_min) are in (marked once read: a Redis failure mid-check leaves it due at the next tick)
        if n >= self._checked_at + max(1, self.cfg.realised_min // 3):
            try:
                await self.check_realised()
            except RedisDown:
                raise
            except Exception:
                self._checked_at = n  # it would fail on the same outcomes again
                raise
            self._checked_at = n
        fitted = int(await self.breaker.call(lambda: self.redis.get(self.k_fitted)) or 0)
        if n >= fitted + self.cfg.every_outcomes:
            await self.fit_once(n)

    @property
    def k_adopted(self) -> str:
        return f"{self.prefix}router:adopted"

    @property
    def k_configured(self) -> str:
        return f"{self.prefix}router:configured"

    async def adopt_configured(self) -> bool:
        """A new file at ``routing.router_path`` while a promoted router is in service becomes the promoted one
        (``p router:current``, the promoted one kept as ``previous`` for a rollback) with a ``promote`` audit event,
        "operator: a new file at routing.router_path"; every replica follows. Without it the file was never served
        and nothing said so (replicas serve ``router:current``).

        New = its content's SHA-256 differs from ``p router:configured``, the digest of the configured file the
        deployment last saw (set at the first look, and at each adoption): the same on every replica whatever its
        copy's inode or mtime, and across restarts — a file written while the replicas were down (a new ConfigMap
        and a rollout) is adopted by the first replica up, a replica restarted on the same file adopts nothing.
        One writer adopts it — a replica, or ``thinkgate router retrain --output`` that wrote it —: the digest's mark
        ``p router:adopted:{digest}`` is set in the compare-and-set that moves ``p router:current``
        (:meth:`CurrentRouter.adopt`); a replica's write goes through :meth:`_write` (a Redis failure finishes it at
        the next tick).

        What is adopted is the bytes read, not the path: they are kept as ``<state_dir>/<digest>.skops``
        (:func:`keep_copy`, written before ``router:current`` names it) and ``router:current`` names that copy and
        its digest. ``routing.router_path`` can be rewritten any time — by a lagging replica's copy of it (a
        ConfigMap still propagating), by a rolled-back file put back —, and while the promoted router was the path
        itself, every replica's hot reload served whatever was written there and a replica starting on it served it
        (it was what ``router:current`` named); the copy never changes.

        A file that does not load, or that this service would refuse (its thresholds for the routed tiers, its
        budget map), is logged and left out; the promoted router keeps serving. So is a file in ``p router:bad``
        (by its digest, or by its version for an entry written before rollbacks named digests): one a rollback took
        out of service because its realised floor fell below ``routing.retrain.floor`` — written back (a config
        management tool or a ConfigMap reverted to it, past ``readopt_after_s``) it would serve again the answers it
        was rolled back for; the warning says how to serve it anyway (save it under a new version). The file is read
        only when its (mtime, size, inode) changed here. True when adopted here."""
        seen = file_signature(self.configured) if self.configured is not None else None
        if self.configured is None or seen is None or seen == self._configured_seen:
            return False
        path = self.configured
        try:
            data = await asyncio.to_thread(path.read_bytes)
        except OSError:
            return False
        digest = file_digest(data)
        stored = await self.breaker.call(lambda: self.redis.get(self.k_configured))
        if stored is None or as_bytes(stored).decode() == digest:
            if stored is None:  # the first look of this deployment: the baseline, nothing to adopt
                await self.breaker.call(lambda: self.redis.set(self.k_configured, digest, nx=True))
            self._configured_seen = seen
            return False
        if not await self.current.read():  # no promotion in force: the service's own hot reload serves the new file
            await self.breaker.call(lambda: self.redis.set(self.k_configured, digest))
            self._configured_seen = seen
            return False
        bad = {as_bytes(v).decode() for v in await self.breaker.call(lambda: self.redis.smembers(self.k_bad)) or ()}
        if bad_entry(digest) in bad:
            # rolled back on its graded answers (check_realised): never promoted again by a file written back
            self._configured_seen = seen
            log.warning("retrain: the file at routing.router_path (%s, sha256 %s) was rolled back (its realised floor "
                        "fell below routing.retrain.floor; listed in router:bad): not adopted, the promoted router "
                        "keeps serving. To serve it anyway, save it under a new metadata version and write that file",
                        path, digest)
            return False
        if await self.breaker.call(lambda: self.redis.exists(f"{self.k_adopted}:{digest}")):
            # adopted within routing.retrain.readopt_after_s and replaced since (router:configured names another
            # file): a lagging copy of the path, or an operator writing it back too soon — said, not served
            self._configured_seen = seen
            log.warning("retrain: the file at routing.router_path (%s, sha256 %s…) was adopted less than "
                        "routing.retrain.readopt_after_s = %d s ago and replaced since: not adopted again (a "
                        "replica's lagging copy of the path?); write it again after that to put it back", path,
                        digest[:12], self.cfg.readopt_after_s)
            return False
        # the bytes read, staged beside their kept name and loaded from there: what is checked is what is kept
        try:
            staged = await asyncio.to_thread(stage_copy, data, self.dir)
        except OSError as exc:
            self._configured_seen = seen  # said once per file written: a new write tries again
            log.warning("retrain: a new file at routing.router_path (%s) is not adopted: no copy of it can be kept in "
                        "routing.retrain.state_dir (%s): %s", path, self.dir, exc)
            return False
        try:
            try:
                router = await asyncio.to_thread(load_router, staged, pipeline=False)
                self.service.check(router)
            except Exception as exc:
                self._configured_seen = seen  # the same bytes are not tried again; a new write is
                log.warning("retrain: a new file at routing.router_path (%s) is not served, the promoted router keeps "
                            "serving: %s", path, str(exc).replace(str(staged), str(path)))
                return False
            version = file_version(router, digest)
            if version in bad:  # an entry of router:bad written before rollbacks named the digest
                self._configured_seen = seen
                log.warning("retrain: the file at routing.router_path (%s) is version %s, which was rolled back (its "
                            "realised floor fell below routing.retrain.floor; listed in router:bad): not adopted, the "
                            "promoted router keeps serving. To serve it anyway, save it under a new metadata version "
                            "and write that file", path, version)
                return False
            copy = await asyncio.to_thread(settle_copy, staged, router_copy(self.dir, digest))
        finally:
            staged.unlink(missing_ok=True)
        n = await self.outcomes.added()  # written so far, not the stream's length (capped)
        self._configured_seen = seen
        adopted: list[dict[str, Any]] = []

        async def adopt() -> None:
            # the mark, router:configured, router:current and the event in one script (CurrentRouter.adopt): of the
            # replicas and the command racing for this file, one adopts it, on the state serving when it does
            event = await self.current.adopt(copy, version, digest, n, "operator: a new file at routing.router_path")
            if event is not None:
                self.last = event
                adopted.append(event)
                log.info("retrain: %s (version %s, kept as %s) written to routing.router_path replaces the promoted "
                         "%s", path, version, copy.name, event["previous"])
        await self._write([adopt])
        return bool(adopted)

    async def read_bad(self) -> None:
        """The rolled-back routers (``p router:bad``) into the service's ``refused_digests`` (``sha256:`` entries)
        and ``refused_versions`` (the others: written before rollbacks named the digest): its reloads do not serve
        one — a file written back to a path it serves (``routing.router_path`` while no promotion is in force, or
        one ``router:current`` named before routers were kept by content), nor one a stale ``router:current``
        names."""
        bad = {as_bytes(v).decode() for v in await self.breaker.call(lambda: self.redis.smembers(self.k_bad)) or ()}
        digests = frozenset(v[len(BAD_DIGEST):] for v in bad if v.startswith(BAD_DIGEST))
        versions = frozenset(v for v in bad if not v.startswith(BAD_DIGEST))
        if versions != self.service.refused_versions:
            self.service.refused_versions = versions
        if digests != self.service.refused_digests:
            self.service.refused_digests = digests

    async def follow(self) -> bool:
        """Serve the router ``p router:current`` names when it is not the one in service; True when switched.

        Named with a digest, the file loaded is this replica's copy of those bytes (:meth:`_local_copy`), and it is
        served only if its bytes are those (``RouterService.reload(expected=...)``); the service's hot reload then
        watches a file that never changes. Without one (a state written before routers were kept by content) the
        named path is loaded as it is."""
        c = await self.current.read()
        self._saw(c)
        if not c.get("path"):
            return False
        named, digest = Path(c["path"]), c.get("digest", "")
        path = await asyncio.to_thread(self._local_copy, named, digest) if digest else named
        if digest and not path.is_file():  # a fit's candidate in another replica's state dir: its published bytes
            path = await self._fetch(digest) or path
        if self.service.path is not None and path == self.service.path:
            self._followed = (path, named, digest)  # e.g. loaded at start from the path router:current names
            return False
        old = self.service.path
        self.service.path = path
        try:
            await asyncio.to_thread(self.service.reload, digest or None)
        except Exception as exc:  # keep serving the router we have
            self.service.path = old
            log.warning("retrain: cannot load the promoted router %s: %s", path, exc)
            return False
        self._followed = (path, named, digest)
        log.info("retrain: now serving %s", path)
        await self._retain()
        return True

    def _saw(self, c: Mapping[str, str]) -> None:
        """Remember when ``router:current`` last named each file (every tick's read): :meth:`_retain` keeps them
        for :data:`RETAIN_NAMED_S` after."""
        now = time.monotonic()
        for name in named_files(c):
            self._named[name] = now

    async def _retain(self) -> None:
        """After this replica followed a transition (an adoption, a fit's promotion, a rollback — each adds a file
        or leaves one unused): remove the router files of the state dir nothing needs any more, beyond the newest
        ``routing.retrain.keep_files`` (:func:`prune_state_dir`; in a worker thread, never on the request path).

        Kept: the files ``router:current`` names now, read afresh (``path``/``digest``, the router every replica
        serves, and ``previous``/``previous_digest``: the only router a rollback goes back to — it writes
        ``previous`` empty, so nothing older is ever gone back to), the one this replica serves, and those it saw
        named in the last :data:`RETAIN_NAMED_S`. Why that is enough for replicas sharing the directory: each follows
        ``router:current`` every ``interval_s``, so a replica serves what it names or, one transition behind,
        its ``previous`` — except right after a rollback (``previous`` written empty: the rolled-back router) or
        after two transitions within one of its ticks; those files were named moments ago, and this replica saw
        them named. Redis down: nothing removed (what is in use is not known)."""
        if self.cfg.keep_files is None:
            return
        try:
            raw = await self.breaker.call(lambda: self.redis.hgetall(self.k_current))
        except RedisDown:
            return
        c = {as_bytes(k).decode(): as_bytes(v).decode() for k, v in (raw or {}).items()}
        self._saw(c)
        now = time.monotonic()
        self._named = {n: t for n, t in self._named.items() if now - t <= RETAIN_NAMED_S}
        keep = set(self._named)
        keep.update(p.name for p in (self.service.path, *(self._followed or ())[:2]) if isinstance(p, Path))
        try:
            removed = await asyncio.to_thread(prune_state_dir, self.dir, keep, self.cfg.keep_files)
        except OSError as exc:  # the directory unreadable: nothing removed, said
            log.warning("retrain: the router files of %s were not pruned: %s", self.dir, exc)
            return
        if removed:
            log.info("retrain: removed %d router file(s) no longer in use from %s (routing.retrain.keep_files = "
                     "%d): %s", len(removed), self.dir, self.cfg.keep_files, ", ".join(removed))

    def _local_copy(self, named: Path, digest: str) -> Path:
        """The file to load for ``router:current`` naming ``named`` with content ``digest`` (in a worker thread):
        this replica's kept copy of those bytes (``<state_dir>/<digest>.skops``) when it has one, else ``named``
        when it exists (a fit's candidate, or a copy in a state_dir shared with the replica that kept it), else a
        copy kept now from this replica's ``routing.router_path`` when that file has those bytes (a state_dir of its
        own: the file was adopted from another replica's copy of the path), else ``named`` (its load fails, said;
        tried again at the next tick — a replica whose copy of the path lags serves what it has until it arrives)."""
        own = router_copy(self.dir, digest)
        if own.is_file():
            return own
        if named.is_file() or self.configured is None:
            return named
        try:
            data = self.configured.read_bytes()
            return keep_copy(data, self.dir, digest) if file_digest(data) == digest else named
        except OSError as exc:  # the path unreadable, or the state dir not writable: the load of named says the rest
            log.warning("retrain: no copy of the promoted router (sha256 %s) kept in %s: %s", digest, self.dir, exc)
            return named

    def _served(self) -> tuple[str, str]:
        """(path, digest) that name the router in service as a fit's ``previous`` in ``router:current`` (in a worker
        thread): what ``router:current`` named when this replica followed it, else — the file at
        ``routing.router_path``, which can change under it — a copy of its bytes kept under their digest
        (:func:`keep_copy`), so that a rollback goes back to the router that served, not to whatever the path holds
        then; ``(path, "")`` when its bytes are not known (replaced since they were loaded: a rollback loads the
        path as it is, as before routers were kept by content)."""
        path, sha = self.service.path, self.service.sha256
        if path is None:
            return "", ""
        if self._followed is not None and self._followed[0] == path:
            return str(self._followed[1]), self._followed[2]
        if sha is None:
            return str(path), ""
        try:
            data = path.read_bytes()
            digest = file_digest(data)
            return (str(keep_copy(data, self.dir, digest)), digest) if digest == sha[:DIGEST_HEX] else (str(path), "")
        except OSError as exc:  # never a reason to lose the verdict: the path as it is, as before
            log.warning("retrain: no copy of the router in service (%s) kept in %s: %s", path, self.dir, exc)
            return str(path), ""

    async def _show(self, event: dict[str, Any]) -> None:
        self.last = event

    async def _history(self, event: dict[str, Any]) -> None:
        self.last = event
        await write_history(self.handle, self.breaker, event)

    async def _write(self, steps: list[Callable[[], Awaitable[Any]]]) -> None:
        """Run a verdict's Redis writes (``steps``, after any left from before) in order. A :class:`RedisDown`
        keeps the step that failed and those after it for the next tick, so a promotion or rollback that happened
        is not missing from ``p router:history`` for a blip (a step whose reply was lost may run twice: an extra
        look only tightens the next bounds)."""
        self._unwritten += steps
        while self._unwritten:
            await self._unwritten[0]()
            self._unwritten.pop(0)

    async def _promote(self, mapping: dict[str, str], event: dict[str, Any]) -> None:
        """Point ``p router:current`` at the candidate, with its promote event — unless it moved since the fit
        (another writer's adoption or rollback, or a write left for a later tick that must not undo a newer one):
        the candidate was compared with a router no longer serving, so the event becomes a keep that says so."""
        await self._publish(Path(mapping["path"]), mapping.get("digest", ""))
        for _ in range(TRANSITION_TRIES):
            c = await self.current.read()
            if c.get("path") == mapping["path"]:  # an earlier try wrote it (and its event): its reply was lost
                return
            if c and c.get("path") != mapping["previous"]:
                # the file it moved to by name in the reason (any API key reads the last event: status()), its
                # path in ``current``, which the tenant's view names by file as it does ``path``
                event.update({"event": "keep", "version": mapping["previous_version"] or None,
                              "path": mapping["previous"], "current": c.get("path", ""),
                              "reason": f"superseded: router:current moved to {Path(c.get('path', '')).name} "
                                        f"(version {c.get('version') or '?'}) while the candidate was fitted or "
                                        "its promotion waited for Redis"})
                await self._history(event)
                with contextlib.suppress(RedisDown):  # its published bytes: nothing will name them
                    await self.breaker.call(lambda: self.redis.delete(self.current.file_key(mapping.get("digest", ""))))
                return
            # compare-and-set on what was just read: a transition landing in between is read at the next try
            if await self.current.transition(c, mapping, event, "promote") == 1:
                return
        raise RuntimeError(f"router:current moved {TRANSITION_TRIES} times while {mapping['path']} was promoted")

    async def _publish(self, path: Path, digest: str) -> None:
        """Put the bytes of a fit's candidate at ``path`` (content ``digest``) in Redis (``p router:file:{digest}``,
        :meth:`CurrentRouter.publish`) before ``router:current`` names it: a replica whose state dir is not this
        one's (an ``emptyDir`` per pod) has no file at that path, and loads those bytes instead (:meth:`follow`).
        A candidate that cannot be read back is said and not published (this replica serves it; the others keep
        theirs, warning, as before). Raises :class:`RedisDown`."""
        if not digest:
            return
        try:
            data = await asyncio.to_thread(path.read_bytes)
        except OSError as exc:
            log.warning("retrain: the candidate %s is not published for the replicas without it: %s", path, exc)
            return
        if file_digest(data) != digest:
            log.warning("retrain: the candidate %s no longer holds sha256 %s: not published", path, digest)
            return
        await self.current.publish(digest, data)

    async def _fetch(self, digest: str) -> Path | None:
        """A copy kept from ``p router:file:{digest}`` (:meth:`_publish`) in this replica's state dir, for a
        ``router:current`` that names a file this replica does not have; None when Redis holds no such bytes (a
        router named before they were published, an adopted file: the path is loaded as it is, and fails, as
        before). A copy that cannot be written (a full or read-only state dir) is said and None: the load of the
        named path fails as before, and the tick goes on (its realised-floor check, its fit). Raises
        :class:`RedisDown`."""
        data = await self.current.published(digest)
        if data is None or file_digest(data) != digest:
            return None
        try:
            return await asyncio.to_thread(keep_copy, data, self.dir, digest)
        except OSError as exc:
            log.warning("retrain: no copy of the promoted router (sha256 %s) kept in %s from Redis: %s", digest,
                        self.dir, exc)
            return None

    async def _recent_outcomes(self) -> list[dict[str, Any]]:
        """The newest ``max_outcomes`` outcomes, oldest first, as the fit code reads them (dicts). Raises
        :class:`RedisDown`."""
        outcomes = await self.outcomes.newest(self.cfg.max_outcomes)  # parsed a page (1,000) per await
        # in a worker thread: on the loop, the newest 100,000 held it for ~1 s at every fit and every realised-floor
        # check (one per realised_min // 3 outcomes) — every request on the fitting replica waited that long
        return await asyncio.to_thread(_as_dicts, outcomes)

    async def _take_lock(self) -> bool:
        """The fit lock: taken now, or already this trigger's (a Redis failure after a fit started can leave it
        behind: the delete in :meth:`fit_once` went to a Redis that was down). Lives ``lock_ttl_s`` unless
        renewed (:meth:`_hold_lock`). Raises :class:`RedisDown`."""
        ttl_ms = self.cfg.lock_ttl_s * 1000
        if await self.breaker.call(lambda: self.redis.set(self.k_lock, self._token, nx=True, px=ttl_ms)):
            return True
        return await self._renew_lock()

    async def _renew_lock(self) -> bool:
        """Give the fit lock ``lock_ttl_s`` more if it still holds this trigger's token; False when it does not
        (expired, or taken by another replica since). Raises :class:`RedisDown`."""
        ttl_ms = self.cfg.lock_ttl_s * 1000
        return int(await self.breaker.call(lambda: self._renew(keys=[self.k_lock], args=[self._token, ttl_ms]))) == 1

    async def _hold_lock(self, lost: asyncio.Event) -> None:
        """While a fit runs (a task :meth:`fit_once` cancels): renew the fit lock every third of ``lock_ttl_s``, so
        a fit longer than the TTL keeps it — expired, a second replica took it and fitted the same outcomes beside
        this one. Sets ``lost`` and stops once the lock is no longer this trigger's. A Redis failure skips a turn:
        the lock outlives an outage shorter than its TTL, and the verdict's own check says whether it did."""
        while True:
            await asyncio.sleep(self.cfg.lock_ttl_s / 3)
            try:
                if not await self._renew_lock():
                    lost.set()
                    return
            except Exception as exc:  # an outage, a failover's READONLY: the next turn tries again
                log.debug("retrain: the fit lock was not renewed this turn: %s: %s", type(exc).__name__, exc)

    async def _mark_fitted(self, n_outcomes: int) -> None:
        await self.breaker.call(lambda: self.redis.set(self.k_fitted, n_outcomes))

    async def fit_once(self, n_outcomes: int) -> dict[str, Any] | None:
        """Take the lock, fit and compare (in the fit process or a worker thread), promote when better; the audit
        event (None when another replica holds the lock or no router is in service).

        ``p router:fitted_at`` moves to ``n_outcomes`` once the verdict is in, before it is written: a
        :class:`RedisDown` before then (reading the outcomes, a stalled loop's timeout, Redis dying during the
        fit) leaves it where it was, so the next tick fits these outcomes again instead of waiting for
        ``every_outcomes`` more; after it, the verdict is not refitted: its writes that a Redis failure cut short
        are done at the next tick (:meth:`_write`). A fit that raises (anything but a Redis outage) marks the
        outcomes fitted: it would fail on them again.

        The lock is renewed while the fit runs (:meth:`_hold_lock`). A fit that lost it anyway (Redis lost the key,
        or an outage outlived ``lock_ttl_s`` and another replica took it) drops its verdict — nothing written, its
        candidate file removed, None —: the replica holding the lock now fits these outcomes, or this one at a later
        tick if none did."""
        if not await self._take_lock():
            return None
        lost = asyncio.Event()
        holder = asyncio.create_task(self._hold_lock(lost), name="retrain-fit-lock")
        self.fitting = True  # until the verdict is served and recorded (a reader of the status waits on it)
        try:
            old = self.service.router
            if old is None:  # said at every due fit: nothing is learnt until a router file serves
                await self._mark_fitted(n_outcomes)
                log.warning("retrain: %d outcomes, but no router file is in service (%s): nothing to retrain",
                            n_outcomes, self.service.error or "routing.router_path is unset")
                return None
            outcomes = await self._recent_outcomes()
            # its file, router-<version>.skops, is one retention may remove once unused (FIT_FILE: keep them alike)
            version = f"auto-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{self.fits + 1:03d}"
            # this comparison's number among the deployment's judged ones (every replica's, across restarts):
            # the promotion's bounds tighten with it (router.fit.promote.look_z)
            look = int(await self.breaker.call(lambda: self.redis.get(self.k_looks)) or 0) + 1
            try:
                path, cmp, fit = await self._fit(old, outcomes, version, look)
            except Exception:
                with contextlib.suppress(RedisDown):
                    await self._mark_fitted(n_outcomes)
                raise
            # checked once more here, not only by the renewals: the lock can be lost since the last one
            if lost.is_set() or not await self._renew_lock():
                if path is not None:
                    await asyncio.to_thread(Path(path).unlink, missing_ok=True)
                log.warning("retrain: the fit lock (%s) was lost while fitting %d outcomes (another replica holds it, "
                            "or it expired): the verdict (%s) is dropped", self.k_lock, n_outcomes, cmp["reason"])
                return None
            await self._mark_fitted(n_outcomes)
            self.fits += 1
            prev_version = old.metadata.get("version") or old.metadata.get("created_utc")
            event: dict[str, Any] = {"event": "keep", "ts": round(time.time(), 3), "version": prev_version,
                                     "previous": prev_version, "path": str(self.service.path),
                                     "outcomes": n_outcomes, "comparison": cmp, "reason": cmp["reason"],
                                     "fit": {"in": self.cfg.fit_in, **fit}}
            steps: list[Callable[[], Awaitable[Any]]] = []
            if cmp.get("old") is not None and cmp.get("new") is not None:  # judged: a look spent
                steps.append(lambda: self.breaker.call(lambda: self.redis.incr(self.k_looks)))
            if path is not None:
                # by content: the candidate's digest, and the router it replaces as router:current named it (or, the
                # configured file, a copy of its bytes: a rollback goes back to them)
                digest = file_digest(await asyncio.to_thread(Path(path).read_bytes))
                prev_path, prev_digest = await asyncio.to_thread(self._served)
                mapping = {"path": str(path), "version": version, "digest": digest, "previous": prev_path,
                           "previous_version": str(prev_version or ""), "previous_digest": prev_digest}
                event.update({"event": "promote", "version": version, "path": str(path), "digest": digest})
                # the promote event is written with router:current (or a keep instead), by _promote
                # shown in the status (self.last) once this replica serves it, as before the compare-and-set
                steps += [functools.partial(self._promote, mapping, event), self.follow,
                          functools.partial(self._show, event)]
            else:
                steps.append(functools.partial(self._history, event))
            await self._write(steps)
            log.info("retrain: %s %s at %d outcomes: %s", event["event"], event["version"], n_outcomes,
                     event["reason"])
            return event
        finally:
            holder.cancel()
            await asyncio.wait({holder})  # not `await holder`: that would swallow this task's own cancellation
            self.fitting = False
            with contextlib.suppress(RedisDown):
                # only while it is still this trigger's: a fit that lost it (see above) would remove another
                # replica's lock with a plain DEL — letting a third replica fit beside that one
                await self.breaker.call(lambda: self._release(keys=[self.k_lock], args=[self._token]))

    async def _fit(self, old: Any, outcomes: list[dict[str, Any]], version: str, look: int
                   ) -> tuple[str | None, dict[str, Any], dict[str, Any]]:
        """:func:`router.fit.promote.fit_and_save` in the fit process (or a thread): (the written path of a better
        candidate or None, the comparison, ``{"pid", "seconds"}``). A fit process that died is replaced at the
        next fit (this one raises ``BrokenProcessPool``, logged by :meth:`run`)."""
        from router.fit import promote  # lazy: only with routing.retrain on (listed in the contract)
        job = functools.partial(promote.fit_and_save, old, outcomes, self.tiers, str(self.dir), version,
                                floor=self.cfg.floor, heldout_frac=self.cfg.heldout_frac,
                                min_heldout=self.cfg.min_heldout, spot_check_min=self.cfg.spot_check_min,
                                look=look)
        if self.cfg.fit_in == "thread":
            return await asyncio.to_thread(job)
        if self._pool is None:
            # spawn, not fork: the gateway has threads and an event loop a forked child would inherit half of
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=os.nice, initargs=(self.cfg.fit_nice,))
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, job)
        except BrokenProcessPool:
            self._pool = None
            raise

    def close(self) -> None:
        """Stop the fit process (a fit in progress is abandoned: its lock expires, the next replica fits)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            for proc in list(getattr(pool, "_processes", {}).values()):  # no public way to stop a running job
                with contextlib.suppress(OSError):
                    proc.terminate()
            pool.shutdown(wait=False, cancel_futures=True)

    async def read_realised(self) -> None:
        """A replica that does not fit shows the fitting replica's last realised-floor reading
        (``p router:realised``, JSON), so ``/v1/models`` says the same behind any load balancer."""
        raw = await self.breaker.call(lambda: self.redis.get(self.k_realised))
        if raw is not None:
            self.realised_last = dict(orjson.loads(as_bytes(raw)))

    async def check_realised(self) -> dict[str, Any] | None:
        """Roll back to the previous file when the promoted router's realised floor — read on the newest
        ``max_outcomes`` outcomes — is below ``floor`` on at least ``realised_min`` graded cheap answers; the
        rollback event (None: nothing to do)."""
        c = await self.current.read()
        if not c.get("previous"):
            return None
        outcomes = await self._recent_outcomes()
        from router.fit import realised  # lazy: only with routing.retrain on (listed in the contract)
        real = await asyncio.to_thread(realised.realised, outcomes, c["version"], self.top, self.cfg.floor,
                                       spot_check_min=self.cfg.spot_check_min)  # off the loop, as the read
        self.realised_last = {"version": c["version"], **real}
        reading = orjson.dumps(self.realised_last)
        await self.breaker.call(lambda: self.redis.set(self.k_realised, reading))
        if real["holds_floor"] or real["n_cheap"] < self.cfg.realised_min:
            return None
        mapping = {"path": c["previous"], "version": c.get("previous_version", ""),
                   "digest": c.get("previous_digest", "")}  # no previous: the fields written empty
        # router:bad names the rolled-back router by its bytes; by its version only when router:current did not carry
        # them (a state written before routers were kept by content)
        bad = bad_entry(c["digest"]) if c.get("digest") else c["version"]
        event = {"event": "rollback", "ts": round(time.time(), 3), "version": c.get("previous_version"),
                 "previous": c["version"], "path": c["previous"], "digest": c.get("previous_digest") or None,
                 "previous_digest": c.get("digest") or None, "outcomes": len(outcomes), "realised": real,
                 "reason": f"realised floor {real['accuracy_ratio']} < {self.cfg.floor} ({real['method']} estimate) "
                           f"on {real['n']} graded answers ({real['n_cheap']} cheap, {real['n_spot_check']} "
                           f"spot-checked) of {c['version']}"}
        # compare-and-set on the state read before the reading (router:current, router:bad and the event at once): a
        # transition since (an adoption, another replica's rollback) replaced the router this reading judged, and
        # rolling back over it would undo it — the new router's own floor is read at a later check. A Redis failure
        # here leaves the check due at the next tick, which reads router:current again.
        if await self.current.transition(c, mapping, event, "rollback", bad=bad) != 1:
            log.warning("retrain: no rollback of %s (its realised floor %s < %s): router:current moved while it was "
                        "read", c["version"], real["accuracy_ratio"], self.cfg.floor)
            return None
        self.last = event
        if c.get("digest"):  # every replica reads router:bad at its next tick
            self.service.refused_digests |= {c["digest"]}
        else:
            self.service.refused_versions |= {c["version"]}
        await self._write([self.follow])  # a Redis failure: followed at the next tick
        log.warning("retrain: rollback to %s: %s", event["version"], event["reason"])
        return event


def _as_dicts(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    """``outcomes`` as the fit and realised-floor code read them: one dict per outcome, every field present."""
    return [orjson.loads(o.to_json()) for o in outcomes]


def attach(settings: Settings, routing: Any, handle: RedisHandle, breaker: Breaker,
           outcomes: OutcomeStore | None) -> RetrainTrigger | None:
    """The trigger of ``create_app`` (None: ``routing.retrain`` off, no outcome store or no router file),
    with its exploration hook on ``routing``."""
    if not settings.routing.retrain.enabled or outcomes is None or routing.service is None:
        return None
    trigger = RetrainTrigger(settings, routing.service, handle, breaker, outcomes)
    if settings.routing.retrain.explore > 0:
        routing.explore = trigger.explore
    if settings.routing.retrain.spot_check > 0:
        routing.spot_check = trigger.spot_check
    return trigger


#: How long a replica's start waits for Redis to name the promoted router (s; each of two reads).
START_FOLLOW_S = 5.0


def history_key(prefix: str) -> str:
    """The audit stream of automatic retraining: ``p router:history``."""
    return f"{prefix}router:history"


async def write_history(handle: RedisHandle, breaker: Breaker, event: dict[str, Any]) -> None:
    """Append one audit event to ``p router:history`` (capped at about ``HISTORY_MAXLEN`` entries)."""
    data = orjson.dumps(event)
    await breaker.call(lambda: handle.client.xadd(history_key(handle.prefix), {"e": data},
                                                  maxlen=HISTORY_MAXLEN, approximate=True))


async def read_history(handle: RedisHandle, breaker: Breaker, count: int = 100) -> list[dict[str, Any]]:
    """The last ``count`` audit events of ``p router:history``, oldest first."""
    raw = await breaker.call(lambda: handle.client.xrevrange(history_key(handle.prefix), count=count)) or []
    return [dict(orjson.loads(as_bytes((f or {})[b"e"]))) for _, f in reversed(raw)]


def file_digest(data: bytes) -> str:
    """What ``p router:configured``, ``p router:adopted:{digest}``, ``p router:current``'s ``digest`` and
    ``p router:bad`` name a router file by: its content's SHA-256 (:data:`router.serving.DIGEST_HEX` = 32 hex
    characters) — the same on every replica and for the command that wrote it."""
    return hashlib.sha256(data).hexdigest()[:DIGEST_HEX]


def bad_entry(digest: str) -> str:
    """The ``p router:bad`` entry of the rolled-back router with content ``digest``: by its bytes, so another file
    that carries the same version is not refused with it (nor are its bytes let through under another version)."""
    return BAD_DIGEST + digest


def router_copy(state_dir: Path, digest: str) -> Path:
    """Where the router file with content ``digest`` is kept once ``router:current`` names it (adopted from
    ``routing.router_path``, or the configured file a fit's promotion replaced): ``<state_dir>/<digest>.skops``."""
    return state_dir / f"{digest}.skops"


def named_files(c: Mapping[str, str]) -> set[str]:
    """The names of the files a ``router:current`` state ``c`` (its fields as text) names: its ``path`` and
    ``previous``, and the kept copies of its ``digest`` and ``previous_digest`` (:func:`router_copy`) — by name, so
    a path written by a replica that mounts the shared directory elsewhere still names the file here."""
    names = {Path(c[f]).name for f in ("path", "previous") if c.get(f)}
    names.update(router_copy(Path(), c[f]).name for f in ("digest", "previous_digest") if c.get(f))
    return names


def prune_state_dir(state_dir: Path, keep: Collection[str], keep_files: int) -> list[str]:
    """Remove from ``state_dir`` the router files nothing needs (:meth:`RetrainTrigger._retain`); the names removed.

    Only the names ThinkGate writes there are looked at — an adopted copy (:data:`KEPT_COPY`), a fit's candidate
    (:data:`FIT_FILE`), a leftover temporary file (:data:`LEFTOVER`) —, and only plain files: whatever else an
    operator keeps in the directory is never touched. Of the router files, those named in ``keep``, those modified in
    the last :data:`RETAIN_YOUNG_S` (a file about to be named) and the ``keep_files`` newest others (by mtime) stay; a
    temporary file goes once it is older than :data:`RETAIN_YOUNG_S` (its writer died). A file gone already
    (another replica sharing the directory removed it) or that cannot be removed is skipped; no directory yet (no
    router copied there: ``router:current`` names files elsewhere), nothing to do."""
    now = time.time()
    others: list[tuple[float, str]] = []
    stale: list[str] = []
    try:
        entries = list(os.scandir(state_dir))
    except FileNotFoundError:
        return []
    for entry in entries:
        router = KEPT_COPY.fullmatch(entry.name) or FIT_FILE.fullmatch(entry.name)
        if not (router or LEFTOVER.fullmatch(entry.name)) or entry.name in keep:
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            mtime = entry.stat(follow_symlinks=False).st_mtime
        except OSError:  # removed meanwhile
            continue
        if now - mtime < RETAIN_YOUNG_S:
            continue
        if router:
            others.append((mtime, entry.name))
        else:
            stale.append(entry.name)
    others.sort(reverse=True)
    removed: list[str] = []
    for name in stale + [n for _, n in others[keep_files:]]:
        try:
            (state_dir / name).unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("retrain: cannot remove %s from %s: %s", name, state_dir, exc)
            continue
        removed.append(name)
    return removed


def stage_copy(data: bytes, state_dir: Path) -> Path:
    """``data`` in a new temporary file in ``state_dir`` (created when missing), flushed to disk: the first half of
    :func:`keep_copy`, for bytes that are checked (loaded) before they are kept. The caller removes it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".router-", suffix=".tmp", dir=state_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(name, 0o644)  # mkstemp makes 0600; a router file is not a secret (save_router does the same)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    return Path(name)


def settle_copy(staged: Path, dest: Path) -> Path:
    """Rename ``staged`` (:func:`stage_copy`) to ``dest`` and flush the directory, so the name survives a crash —
    unless ``dest`` is there already: named by its content, it holds these bytes (written the same way, by this
    replica or one sharing the directory) and is left as it is (a replica serving it sees no new file)."""
    if dest.is_file():
        # young again: retention (_retain) spares files written in the last minutes, and this one is about to be
        # named — another replica's prune could otherwise remove an old copy of a router adopted once more
        os.utime(dest)
        return dest
    os.replace(staged, dest)
    fsync_dir(dest.parent)
    return dest


def keep_copy(data: bytes, state_dir: Path, digest: str) -> Path:
    """Keep ``data`` (content ``digest``) as ``<state_dir>/<digest>.skops`` (:func:`router_copy`), written atomically
    — a temporary file, fsync'd, renamed —, so no reader ever sees half of it; the path. A file named by content
    never changes: ``router:current`` names it, and no later write to the path it came from reaches the replicas."""
    dest = router_copy(state_dir, digest)
    if dest.is_file():
        return dest
    staged = stage_copy(data, state_dir)
    try:
        return settle_copy(staged, dest)
    finally:
        staged.unlink(missing_ok=True)


class CurrentRouter:
    """``p router:current`` and its transitions, each one compare-and-set (module doc, "Transitions")."""

    def __init__(self, handle: RedisHandle, breaker: Breaker, readopt_after_s: int) -> None:
        self.handle = handle
        self.breaker = breaker
        self.readopt_after_s = readopt_after_s  # routing.retrain.readopt_after_s: the adopted mark's TTL
        self.prefix = handle.prefix
        self.key = f"{self.prefix}router:current"
        self._script = handle.client.register_script(TRANSITION_LUA)

    async def read(self) -> dict[str, str]:
        """The hash as text (``{}``: no promotion yet), its ``digest`` / ``previous_digest`` left out unless they
        were written with the state they describe (``digest_gen`` is ``gen``): a replica of an earlier release,
        still running in a rolling upgrade, moves ``path`` and bumps ``gen`` but leaves the digests of the state
        before — followed, they would serve that router instead of the one named (its path is loaded as it is)."""
        cur = await self.breaker.call(lambda: self.handle.client.hgetall(self.key))
        out = {as_bytes(k).decode(): as_bytes(v).decode() for k, v in (cur or {}).items()}
        if out.get("digest_gen") != out.get("gen"):
            out.pop("digest", None)
            out.pop("previous_digest", None)
        return out

    async def transition(self, seen: dict[str, str], mapping: dict[str, str], event: dict[str, Any], kind: str,
                         digest: str = "", bad: str = "") -> int:
        """Replace ``seen`` (what :meth:`read` returned) by ``mapping`` (:data:`ROUTER_FIELDS`; one missing is
        written empty) and append ``event`` to the history, both only if ``seen`` still holds: 1 written, 0
        ``router:current`` moved since (nothing written), -1 ``kind`` ``adopt`` and the file whose ``digest`` this is
        was adopted already (nothing written). ``bad`` (rollback): the ``p router:bad`` entry added with it."""
        keys = [self.key, history_key(self.prefix)]
        args: list[Any] = [seen.get("gen", "0"), seen.get("path", ""), kind, orjson.dumps(event), HISTORY_MAXLEN]
        if kind == "adopt":
            keys += [f"{self.prefix}router:adopted:{digest}", f"{self.prefix}router:configured"]
            args += [digest, self.readopt_after_s]
        elif kind == "rollback":
            keys.append(f"{self.prefix}router:bad")
            args += [bad, 0]
        else:
            args += ["", 0]
        for field in ROUTER_FIELDS:
            args += [field, mapping.get(field, "")]
        reply = await self.breaker.call(lambda: self._script(keys=keys, args=args))
        if int(reply[0]) == 1:
            # the bytes published of a router no longer named (neither serving nor the previous one) are not needed:
            # no replica goes back to it (a rollback goes to ``previous`` only); best effort — one left is harmless
            dropped = {seen.get(f) or "" for f in ("digest", "previous_digest")} - {
                mapping.get(f) or "" for f in ("digest", "previous_digest")} - {""}
            if dropped:
                with contextlib.suppress(RedisDown):
                    await self.breaker.call(lambda: self.handle.client.delete(*(self.file_key(d) for d in dropped)))
        return int(reply[0])

    def file_key(self, digest: str) -> str:
        """``p router:file:{digest}``: the bytes of a fit's candidate, for the replicas whose state dir lacks it."""
        return f"{self.prefix}router:file:{digest}"

    async def publish(self, digest: str, data: bytes) -> None:
        """Keep ``data`` (a router file, content ``digest``) in Redis until a transition stops naming it."""
        await self.breaker.call(lambda: self.handle.client.set(self.file_key(digest), data))

    async def published(self, digest: str) -> bytes | None:
        """The bytes :meth:`publish` kept for ``digest`` (None: none)."""
        raw = await self.breaker.call(lambda: self.handle.client.get(self.file_key(digest)))
        return None if raw is None else as_bytes(raw)

    async def adopt(self, path: Path, version: str, digest: str, outcomes: int, reason: str
                    ) -> dict[str, Any] | None:
        """Make the file at ``path`` (content digest ``digest``: the copy :func:`keep_copy` kept) the promoted
        router, the one serving now kept as its ``previous``, with a ``promote`` event; the event, or None when the
        file was adopted already (by another replica, the command that wrote it, or this call's earlier try whose
        reply a Redis failure lost). A transition by another writer between the read and the write (a rollback, a
        fit's promotion) is read again: the operator's file replaces whatever serves by then."""
        for _ in range(TRANSITION_TRIES):
            c = await self.read()
            mapping = {"path": str(path), "version": version, "digest": digest, "previous": c.get("path", ""),
                       "previous_version": c.get("version", ""), "previous_digest": c.get("digest", "")}
            event = {"event": "promote", "ts": round(time.time(), 3), "version": version,
                     "previous": c.get("version") or None, "path": str(path), "digest": digest,
                     "outcomes": outcomes, "reason": reason}
            done = await self.transition(c, mapping, event, "adopt", digest=digest)
            if done == 1:
                return event
            if done == -1:
                return None
        raise RuntimeError(f"router:current moved {TRANSITION_TRIES} times while {path} was being adopted: not "
                           "adopted yet (a replica tries again at its next tick)")
