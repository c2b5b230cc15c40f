"""Routing (``routing:``): the router, its cut points and the closed loop's knobs (cost target, outcomes,
shadow comparisons, drift alarm) — owned by ``gateway/pipeline/routing.py`` and ``gateway/control/``.
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from gateway.config.base import _Strict
from gateway.config.paths import DEFAULT_ROUTER_PATH


class RoutingTargetConfig(_Strict):
    """The cost-target controller (``gateway/control/target.py``): off unless one target is set.

    ``long_share``: the fraction of routed ``auto`` requests to send to the top routed tier; or
    ``usd_per_1k_requests`` / ``usd_per_day``: a spend, turned into that share from the mean cost per request
    of each routed tier measured on this traffic (and, for ``usd_per_day``, the recent request rate). The top
    threshold then follows the ``1 - share`` quantile of the last ``window`` router scores (shared in Redis by
    every replica), moved at most ``max_step`` per update; an update runs every ``update_every`` routed
    requests per replica (or each ``interval_s`` when some are pending), and only once ``min_samples`` scores
    are in the window. Feedback on the realized share: the quantile is taken at ``share + gain × (share −
    realized)``, ``realized`` = the top share of the last ``error_window`` routed decisions (``gain`` 0: the
    plain quantile), which corrects a run of over- or under-routing that the score quantile alone passes on.
    Unset: the calibrated (or configured) thresholds apply unchanged."""

    long_share: float | None = Field(None, ge=0, le=1)
    usd_per_day: Decimal | None = Field(None, gt=0)
    usd_per_1k_requests: Decimal | None = Field(None, gt=0)
    window: int = Field(500, ge=10, le=100_000)
    min_samples: int = Field(50, ge=1)
    max_step: float = Field(0.02, gt=0, le=1)
    update_every: int = Field(16, ge=1)
    interval_s: float = Field(1.0, gt=0)
    gain: float = Field(2.0, ge=0, le=10)
    error_window: int = Field(250, ge=10, le=100_000)

    @model_validator(mode="after")
    def _one_target(self) -> RoutingTargetConfig:
        if sum(v is not None for v in (self.long_share, self.usd_per_day, self.usd_per_1k_requests)) > 1:
            raise ValueError("routing.target: set at most one of long_share, usd_per_day, usd_per_1k_requests")
        return self

    @property
    def enabled(self) -> bool:
        return any(v is not None for v in (self.long_share, self.usd_per_day, self.usd_per_1k_requests))


#: How long a UTC day's outcome seen-set (and its grades hash) lives after its last new outcome: what deduplicates
#: the grades of that day's requests (``gateway/control/outcomes.py``, ``Outcome.seen_day``).
OUTCOMES_SEEN_TTL_S = 40 * 86400
#: The longest ``routing.outcomes.request_ttl_s``: a request is graded for that long, and each grade must still meet
#: the seen-set its first grade went into (which lives ``OUTCOMES_SEEN_TTL_S`` from then); a day to spare for the
#: request's own duration, the index write's delay and clock skew between replicas and Redis.
MAX_REQUEST_TTL_S = OUTCOMES_SEEN_TTL_S - 86400


class OutcomesConfig(_Strict):
    """Routing outcomes (``gateway/control/outcomes.py``): client feedback (``POST /v1/feedback``), escalations and
    shadow comparisons, in the Redis stream ``{prefix}outcomes`` (at most ``stream_maxlen`` entries, trimmed
    approximately), spooled to ``spool_path`` (default: beside the usage spool) while Redis is down and
    replayed every ``replay_interval_s``.
    Feedback is accepted for ``request_ttl_s`` seconds after a request (each request leaves a small index
    entry: key id, tier, router score, window digest), at most ``MAX_REQUEST_TTL_S`` (39 days): a request's grades
    are deduplicated by its UTC day's seen-set, which lives ``OUTCOMES_SEEN_TTL_S`` (40 days) — a longer TTL let
    a second grade come after the first one's seen-set expired, and count twice. ``retain_text``: also keep the
    routing window's text (and shadow answers) in the outcomes, which ``router retrain`` needs to learn from them;
    off = digests only. ``feedback_keys``: the API key ids whose ``POST /v1/feedback`` is accepted (None, the
    default: every key's); feedback trains the one router every key is served by and decides its rollback, so a
    deployment whose tenants it does not trust with that lists the keys it does (others: 403)."""

    enabled: bool = True
    retain_text: bool = False
    request_ttl_s: int = Field(86400, ge=60)
    stream_maxlen: int = Field(1_000_000, ge=1000)
    spool_path: Path | None = None  # None: next to the usage spool, ``<usage spool stem>.outcomes.jsonl``
    replay_interval_s: float = Field(5.0, gt=0)
    feedback_keys: list[str] | None = None

    @field_validator("request_ttl_s")
    @classmethod
    def _graded_within_the_seen_sets(cls, v: int) -> int:
        if v > MAX_REQUEST_TTL_S:
            raise ValueError(f"routing.outcomes.request_ttl_s must be at most {MAX_REQUEST_TTL_S} s "
                             f"({MAX_REQUEST_TTL_S // 86400} days): grades are deduplicated by per-day seen-sets "
                             f"that live {OUTCOMES_SEEN_TTL_S // 86400} days, so a request graded later than that "
                             "could have a second grade counted")
        return v


class ShadowConfig(_Strict):
    """Shadow comparisons (``gateway/control/shadow.py``): a sampled ``fraction`` of the routed chat requests
    answered by a cheaper routed tier are sent again, after the client's answer is complete, to the next routed tier up
    (non-streamed; at most ``max_concurrency`` at once per replica, others skipped), metered with route reason
    ``shadow`` under the key id ``_shadow`` (never the client's budget) and admitted only while they fit in
    ``max_usd_day`` per UTC day — in ``hard`` mode whatever ``limits.budget_mode`` says, so the cap is never
    passed. ``judge``: ``agreement`` (normalised final answers equal: two tiers that agree need no third opinion),
    ``normalised`` (final answers compared with the ``router.tasks`` checkers where a task applies — numbers, math —
    else abstentions and word containment) or ``tier:<name>`` (that tier is asked, with the prompt
    shipped in shadow.py, whether the cheap answer reaches the same answer; its call is metered as ``shadow`` too).
    The result is a ``shadow`` outcome. ``verifier``: where the request's last user message is a question of the
    ``references`` JSONL (question rows: ``question``, ``answer``, optionally ``task``), the ``verifier``
    (``router.tasks.verifiers``: task | math | int | exact | module:function) judges the cheap answer against the
    reference, with no higher-tier call; other requests fall back to ``agreement``
    (``gateway/control/shadow_references.py``). ``fraction: 0`` (the default) turns shadowing off."""

    fraction: float = Field(0.0, ge=0, le=1)
    max_usd_day: Decimal = Field(Decimal("1"), ge=0)
    judge: str = Field("agreement", pattern=r"^(agreement|normalised|verifier|tier:[A-Za-z0-9_.-]+)$")
    references: Path | None = None
    verifier: str = "task"
    max_concurrency: int = Field(4, ge=1, le=256)

    @model_validator(mode="after")
    def _references_for_verifier(self) -> ShadowConfig:
        if self.judge == "verifier" and self.references is None:
            raise ValueError("routing.shadow.judge 'verifier' needs routing.shadow.references (a JSONL of "
                             "question rows with reference answers)")
        return self


class DriftConfig(_Strict):
    """The drift alarm (``gateway/control/drift.py``): PSI of the last ``window`` routed scores (and tier mix)
    against the router file's calibration histogram, every ``interval_s``, once ``min_samples`` are in; an alert
    (the budget alerts' log and webhook) when a PSI reaches ``threshold`` (0.25: a significant shift)."""

    enabled: bool = True
    window: int = Field(1000, ge=50, le=100_000)
    min_samples: int = Field(200, ge=10)
    interval_s: float = Field(10.0, gt=0)
    threshold: float = Field(0.25, gt=0)


class RetrainConfig(_Strict):
    """Automatic retraining and safe promotion (``gateway/control/retrain_trigger.py``): off unless
    ``every_outcomes`` > 0. Every ``every_outcomes`` new outcomes in the stream, one replica (a Redis lock) fits a
    router on the newest ``max_outcomes`` outcomes (``router.fit.retrain``; needs ``routing.outcomes.retain_text``)
    in a child process (``fit_in: process``, at nice +10: a fit holds the GIL, so in a thread it stalls serving) or a
    worker thread (``fit_in: thread``), compares it with the router in service on the held-back ``heldout_frac`` of the
    outcomes under the served-floor rule (accuracy ≥ ``floor`` × always-top, savings as the tie-break; at least
    ``min_heldout`` labelled windows) and promotes it — a versioned file under ``state_dir``, hot-reloaded by
    every replica with retraining on — only when it is better. ``explore``: the share of ``auto`` requests routed
    to the tier below the one predicted, at random (route reason ``explore``), so that cheap answers exist to learn
    from (0: none). The realised floor (feedback on the answers the promoted router chose) is checked every
    ``interval_s``; below ``floor`` (on at least ``realised_min`` graded cheap answers) the previous file
    is served again. ``spot_check``: the share of the requests the router sends below the top tier that the top tier
    serves instead, at random (route reason ``spot_check``): the control arm that makes the realised floor unbiased
    (``router/fit/realised.py``; it costs ``spot_check`` of the cheap share's savings); with fewer than
    ``spot_check_min`` graded spot-check answers the estimate falls back to the nesting assumption, which reads
    optimistic once a router sends the easy questions cheap. ``fit_here: false``: this replica follows promotions
    but never fits. ``keep_files``: every promotion and adoption adds a file of a few hundred KB to a few MB to
    ``state_dir``; when a replica follows one, it removes the files ThinkGate wrote there that nothing still needs —
    it keeps the files ``router:current`` names (the router serving and the previous one, all a rollback can go back
    to), the one it serves, those it saw named in the last 10 minutes (a replica sharing the directory that has not
    followed yet serves one), any written in the last 10 minutes, and the newest ``keep_files`` others (None: none
    removed, as before)."""

    every_outcomes: int = Field(0, ge=0)
    #: where the fits' versioned files and the adopted routers' copies (``<digest>.skops``) are kept: every replica
    #: reads a fit's file from it (share it); an adopted copy missing there a replica keeps itself from its own
    #: ``routing.router_path``. None: ``<usage spool dir>/routers``
    state_dir: Path | None = None
    heldout_frac: float = Field(0.2, ge=0.05, le=0.5)
    min_heldout: int = Field(10, ge=4)
    floor: float = Field(0.98, gt=0, le=1)
    explore: float = Field(0.0, ge=0, le=1)
    realised_min: int = Field(30, ge=5)
    spot_check: float = Field(0.05, ge=0, le=1)
    spot_check_min: int = Field(30, ge=3)
    fit_here: bool = True
    fit_in: Literal["process", "thread"] = "process"
    #: the niceness the fit process adds to the gateway's (``fit_in: process``; 0–19): +10 yields the CPU to the
    #: serving loop, but on a box where other work at the gateway's own priority keeps the cores busy it gets about a
    #: tenth of that work's share per core and a fit of seconds takes minutes (4 CPU-seconds in 146 s measured at load
    #: 10 on 2 cores), the retrain lock held meanwhile; 0: the fit competes as an equal
    fit_nice: int = Field(10, ge=0, le=19)
    interval_s: float = Field(1.0, gt=0)
    #: seconds a file adopted from ``routing.router_path`` stays marked adopted (``p router:adopted:{digest}``):
    #: within it the same bytes are not adopted again — a replica whose copy of the path lags (a ConfigMap still
    #: propagating, a pod of the previous rollout restarting) would otherwise flip the fleet back to the file the
    #: new one replaced —; after it, writing a file back (an operator putting an earlier router back) adopts it
    #: again. Longer than the deployment's worst skew between two replicas' copies of the path.
    readopt_after_s: int = Field(900, ge=1)
    #: how many router files in ``state_dir`` no longer in use (``router-<version>.skops`` of earlier fits,
    #: ``<digest>.skops`` of earlier adoptions) are kept, newest first, when a replica follows a transition; the rest
    #: are removed (``retrain_trigger.prune_state_dir``: only those names, never another file). The files still in use
    #: are kept whatever this says. None: nothing is removed (the directory grows with every promotion)
    keep_files: int | None = Field(20, ge=0)
    #: seconds the fit lock (``p router:lock``: one replica fits at a time) lives unless renewed; the fitting replica
    #: renews it every third of this while its fit runs, so it bounds how long a replica that died mid-fit keeps
    #: the others from fitting, not how long a fit may take
    lock_ttl_s: int = Field(600, ge=1)
    #: how many outcomes a fit and a realised-floor check read: the newest of the stream (which keeps up to
    #: ``routing.outcomes.stream_maxlen``, a million by default). Each is read into the gateway's memory (about
    #: 2 KB with a 1 KB routing window) and parsed on its event loop at every fit and every check — a third of
    #: ``realised_min`` new outcomes apart —, and a fit's time grows with it; 100,000 is ~50 times what a first
    #: promotion needs (~950 labelled windows)
    max_outcomes: int = Field(100_000, ge=1000)

    @property
    def enabled(self) -> bool:
        return self.every_outcomes > 0


#: the values of OpenAI's ``reasoning_effort`` (openai-python's ``ReasoningEffort``), what vLLM's chat templates read:
#: a named tier accepts these (passed on as sent) besides ``routing.effort_tiers``'s own keys
OPENAI_REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


class RoutingConfig(_Strict):
    """How ``model: "auto"`` picks a tier.

    The router scores P(needs a more capable tier) in [0, 1]; ``thresholds`` (ascending, one fewer than
    ``routed_tiers``) map a score to a tier: score < thresholds[0] → routed_tiers[0], and so on. When
    ``thresholds`` is unset the router file's calibrated thresholds are used.
    """

    router_path: Path | None = DEFAULT_ROUTER_PATH
    on_router_error: Literal["refuse_start", "default_tier"] = "default_tier"
    default_tier: str = "long"
    routed_tiers: list[str] = Field(default_factory=lambda: ["short", "long"])
    thresholds: list[float] | None = None
    effort_tiers: dict[str, str] = Field(
        default_factory=lambda: {
            "none": "none",
            "minimal": "short",
            "low": "short",
            "medium": "long",
            "high": "long",
            "xhigh": "long",  # OpenAI's two efforts above high (the SDK's ReasoningEffort): the top tier
            "max": "long",
        }
    )
    fallback: bool = True
    reload_interval_s: float = Field(2.0, gt=0)
    #: a conversation keeps the tier of its first routed turn this long after its last turn, seconds; 0 = off
    #: (the default, so per-request routing stays as it was until an operator opts in; 1800 suits agent
    #: loops); see gateway/pipeline/sessions.py
    session_ttl_s: int = Field(0, ge=0)
    #: the cost-target controller (off by default: the calibrated thresholds apply)
    target: RoutingTargetConfig = Field(default_factory=RoutingTargetConfig)
    #: feedback, escalation and shadow outcomes (the labels retraining learns from)
    outcomes: OutcomesConfig = Field(default_factory=OutcomesConfig)
    #: shadow comparisons with the next tier up (off by default)
    shadow: ShadowConfig = Field(default_factory=ShadowConfig)
    #: the drift alarm (PSI of the realized scores against the router file's calibration histogram)
    drift: DriftConfig = Field(default_factory=DriftConfig)
    #: automatic retraining and safe promotion from the outcomes (off by default)
    retrain: RetrainConfig = Field(default_factory=RetrainConfig)

    @field_validator("thresholds")
    @classmethod
    def _ascending(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and (any(not 0 <= t <= 1 for t in v) or v != sorted(v)):
            raise ValueError("thresholds must be ascending values in [0, 1]")
        return v

