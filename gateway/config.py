"""The settings tree: one typed model for the whole product.

Sources, highest priority first: keyword arguments, ``THINKGATE_*`` environment variables (nested
fields joined by ``__``, e.g. ``THINKGATE_SERVER__PORT=9000``), the YAML file given by ``--config`` or
``THINKGATE_CONFIG``, then the embedded defaults below (the local vLLM engine serving the shipped model,
three tiers ``none``/``short``/``long``). ``REDIS_URL`` is honoured as an alias of ``redis.url``.

Units: token counts are tokens; prices are USD per 1M tokens (``Decimal``); durations are seconds.
Invalid configuration raises :class:`ConfigError` whose message names the offending field.
"""

from __future__ import annotations

import contextvars
import hashlib
import os
from decimal import Decimal
from importlib.resources import files
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from router.errors import ThinkGateError


def _shipped(package: str, *parts: str) -> Path:
    """A file shipped inside an installed package (``importlib.resources``), as a filesystem path.

    The distribution is installed unzipped (a wheel or an editable checkout), so the traversable is a real path.
    The lookup imports only the package's ``__init__`` (a docstring), never its modules.
    """
    return Path(str(files(package).joinpath(*parts)))


#: The shipped local reasoning model that the embedded dev engine serves (a training product, found as package data).
DEFAULT_MODEL_DIR = _shipped("training", "assets", "thinkgate-tiny")
#: The shipped difficulty router.
DEFAULT_ROUTER_PATH = _shipped("router", "assets", "default.skops")
#: Where the gateway keeps local state (dev key, usage spool, engine caches): ``$THINKGATE_STATE_DIR``, else
#: ``.thinkgate/`` in the working directory — never inside site-packages.
STATE_DIR = Path(os.environ.get("THINKGATE_STATE_DIR") or Path.cwd() / ".thinkgate")


#: The YAML file of the :meth:`Settings.load` call in progress (a context variable: loads on several threads or
#: nested loads do not see each other's file).
_YAML_FILE: contextvars.ContextVar[Path | None] = contextvars.ContextVar("thinkgate_yaml_file", default=None)


class ConfigError(ThinkGateError, ValueError):
    """Raised when the configuration is invalid; the message names each offending field."""


class _Strict(BaseModel):
    # Frozen: the settings are built once (Settings.load) and never edited; an override is a model_copy(update=…).
    model_config = ConfigDict(extra="forbid", frozen=True)


class Prices(_Strict):
    """Prices in USD per 1M tokens (exact decimals)."""

    input_usd_per_mtok: Decimal = Decimal("0")
    cached_input_usd_per_mtok: Decimal = Decimal("0")
    output_usd_per_mtok: Decimal = Decimal("0")

    @field_validator("*")
    @classmethod
    def _non_negative(cls, v: Decimal) -> Decimal:
        if v < 0:
            raise ValueError("prices must be >= 0")
        return v


class LoopGuard(_Strict):
    """Cut a thought that repeats itself: an n-gram (of ``ngram`` tokens, approximated by whitespace words)
    seen ``max_repeats`` times inside the thought ends it and the answer is forced."""

    ngram: int = Field(8, ge=2)
    max_repeats: int = Field(3, ge=2)


class UpstreamPoolConfig(_Strict):
    """How a tier with several ``base_urls`` spreads its calls (``gateway/upstream/balancer.py``).

    Each call goes to the replica with the fewest outstanding requests, except that with ``affinity: prefix``
    a conversation (its first system and user messages; a completion prompt's first 1,024 characters) has
    a preferred replica by rendezvous hashing, kept while it is in rotation and has at most
    ``affinity_max_skew`` more outstanding requests than the least loaded one (so the engine's prefix cache
    stays warm). ``allowed_fails`` consecutive failures (connection refused/reset, connect or read timeout, a
    5xx) eject a replica for ``cooldown_s`` seconds; then it is probed (``GET /health``, else ``/v1/models``)
    and readmitted on success, else ejected again for twice as long (at most ``max_cooldown_s``).
    ``health_check_interval_s`` > 0: every replica is also probed on that interval (each probe bounded by
    ``health_check_timeout_s``) and one that fails stays out of rotation until a probe succeeds. When no
    replica is in rotation, all are used (least outstanding first) rather than refusing the call.
    A tier with one upstream is never ejected or probed (as before pools existed)."""

    affinity: Literal["prefix", "none"] = "prefix"
    affinity_max_skew: int = Field(4, ge=0)
    allowed_fails: int = Field(3, ge=1)
    cooldown_s: float = Field(10.0, gt=0)
    max_cooldown_s: float = Field(300.0, gt=0)
    health_check_interval_s: float = Field(5.0, ge=0)
    health_check_timeout_s: float = Field(2.0, gt=0)


def prompted_hard_stop(budget: int) -> int:
    """Forcing budget (tokens) above a ``prompted`` tier's requested ``budget``: 25% + 16 tokens more. Here beside
    the tier so that admission (``gateway/state/limits.py``) bounds a prompted call by the same number that
    ``gateway/thinking/dial.py`` cuts it at; ``thinkgate eval dial`` closes an open thought at the same point."""
    return budget + budget // 4 + 16


class TierConfig(_Strict):
    """One reasoning tier: where to send the request and how much it may think.

    ``base_url``: the tier's OpenAI-compatible upstream (``…/v1``). ``base_urls``: several replicas of the same
    model instead (a pool, balanced as ``pool`` says); ``base_url`` then reads as the first of them. Set one of
    the two (or both with ``base_url`` among ``base_urls``).

    ``thinking_budget`` is in tokens (``None`` = unlimited). ``budget_mode``: ``native`` sends vLLM's
    per-request ``thinking_token_budget``; ``forced`` enforces it in the gateway by two-phase budget
    forcing (stop the thought at the budget, append ``end_of_thinking``, continue for the answer);
    ``off`` sends no budget; ``prompted`` sends the budget *to the model* in its prompt (a dial model,
    ``training/assets/thinkgate-tiny-dial``): ``budget_prompt`` (``{budget}`` = tokens) is appended to the last
    user message, and budget forcing stays as the hard stop above it (``gateway/thinking/dial.py``).
    ``enable_thinking: false`` disables thinking through ``chat_template_kwargs.enable_thinking``. ``max_n``: the
    most choices (``n``) one request may ask of this tier (more is a 400); with ``max_tokens`` it bounds what one
    request can cost.

    ``escalate_on`` (the cascade): retry on the next tier when this tier's answer is empty
    (``empty_answer``), cut inside its thought (``length_in_thought``), abstains (``abstain``: its final-answer
    part contains one of ``abstain_phrases``, default ``gateway.pipeline.abstention.DEFAULT_PHRASES``, English)
    or is unsure (``low_confidence``: mean answer-token logprob below ``min_answer_logprob``, natural log; only
    where the upstream returns logprobs, e.g. ``sampling: {logprobs: true}``), or its answer-aware model says
    it is likely wrong (``learned``: ``escalation_model``, normally from the router file, router/escalation.py).
    """

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    base_url: str = "http://127.0.0.1:8001/v1"
    base_urls: list[str] = Field(default_factory=list)
    pool: UpstreamPoolConfig = Field(default_factory=UpstreamPoolConfig)
    model: str = "thinkgate-tiny"
    api_key: str | None = None
    max_tokens: int = Field(1024, ge=1)
    max_n: int = Field(8, ge=1)
    thinking_budget: int | None = Field(None, ge=0)
    budget_mode: Literal["native", "forced", "off", "prompted"] = "native"
    #: the dial prompt format of a ``prompted`` tier (appended to the last user message)
    budget_prompt: str = Field("Think for {budget} tokens.", pattern=r"\{budget\}")
    enable_thinking: bool = True
    end_of_thinking: str = "\n</think>\n\n"
    escalate_on: list[Literal["empty_answer", "length_in_thought", "abstain", "low_confidence", "learned"]] = Field(
        default_factory=list)
    abstain_phrases: list[str] | None = None
    #: the answer-aware escalation model (``learned``; a router file's ``metadata.serving.cascade.models[tier]``,
    #: router/escalation.py): features of the finished answer → P(wrong) ≥ its ``threshold`` escalates
    escalation_model: dict[str, Any] | None = None
    min_answer_logprob: float | None = Field(None, le=0)
    loop_guard: LoopGuard | None = None
    sampling: dict[str, Any] = Field(default_factory=dict)
    prices: Prices = Field(default_factory=Prices)
    connect_timeout_s: float = Field(5.0, gt=0)
    read_timeout_s: float = Field(120.0, gt=0)
    max_retries: int = Field(2, ge=0)
    #: this tier's upstream serves ``POST /v1/embeddings`` (gateway/api/embeddings.py); keep it out of
    #: ``routing.routed_tiers``
    embeddings: bool = False

    @model_validator(mode="after")
    def _confidence_needs_threshold(self) -> TierConfig:
        if "low_confidence" in self.escalate_on and self.min_answer_logprob is None:
            raise ValueError("escalate_on: low_confidence needs min_answer_logprob")
        if "learned" in self.escalate_on and self.escalation_model is None:
            raise ValueError("escalate_on: learned needs escalation_model (a router file serves one)")
        return self

    @model_validator(mode="after")
    def _one_upstream_field(self) -> TierConfig:
        if not self.base_urls:
            return self
        if len({u.rstrip("/") for u in self.base_urls}) != len(self.base_urls):
            raise ValueError(f"base_urls: each upstream once, got {self.base_urls}")
        if "base_url" in self.model_fields_set and self.base_url not in self.base_urls:
            raise ValueError("set base_url or base_urls, not both (or base_url as one of base_urls)")
        # code that needs one address (the semantic cache's embedder, logs) reads the first replica
        object.__setattr__(self, "base_url", self.base_urls[0])
        return self

    @property
    def upstream_urls(self) -> tuple[str, ...]:
        """The tier's upstream base URLs: ``base_urls``, else ``(base_url,)``."""
        return tuple(self.base_urls) or (self.base_url,)


class RoutingTargetConfig(_Strict):
    """The cost-target controller (``gateway/state/routing_target.py``): off unless one target is set.

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


class OutcomesConfig(_Strict):
    """Routing outcomes (``gateway/state/outcomes.py``): client feedback (``POST /v1/feedback``), escalations and
    shadow comparisons, in the Redis stream ``{prefix}outcomes`` (at most ``stream_maxlen`` entries, trimmed
    approximately), spooled to ``spool_path`` (default: beside the usage spool) while Redis is down and
    replayed every ``replay_interval_s``.
    Feedback is accepted for ``request_ttl_s`` seconds after a request (each request leaves a small index
    entry: key id, tier, router score, window digest). ``retain_text``: also keep the routing window's text (and
    shadow answers) in the outcomes, which ``router retrain`` needs to learn from them; off = digests only."""

    enabled: bool = True
    retain_text: bool = False
    request_ttl_s: int = Field(86400, ge=60)
    stream_maxlen: int = Field(1_000_000, ge=1000)
    spool_path: Path | None = None  # None: next to the usage spool, ``<usage spool stem>.outcomes.jsonl``
    replay_interval_s: float = Field(5.0, gt=0)


class ShadowConfig(_Strict):
    """Shadow comparisons (``gateway/pipeline/shadow.py``): a sampled ``fraction`` of the routed chat requests
    answered by a cheaper routed tier are sent again, after the client's answer is complete, to the next
    routed tier up (non-streamed; at most ``max_concurrency`` at once per replica, others skipped), metered
    with route reason ``shadow`` under the key id ``_shadow`` (never the client's budget) and stopped for the
    UTC day once they cost ``max_usd_day``. ``judge``: ``agreement`` (normalised final answers equal: two tiers
    that agree need no third opinion) or ``tier:<name>`` (that tier is asked, with the prompt shipped in
    shadow.py, whether the cheap answer reaches the same answer; its call is metered as ``shadow`` too). The
    result is a ``shadow`` outcome. ``verifier``: where the request's last user message is a question of the
    ``references`` JSONL (question rows: ``question``, ``answer``, optionally ``task``), the ``verifier``
    (``router.tasks.verifiers``: task | math | int | exact | module:function) judges the cheap answer against
    the reference, with no higher-tier call; other requests fall back to ``agreement``
    (``gateway/pipeline/shadow_references.py``). ``fraction: 0`` (the default) turns shadowing off."""

    fraction: float = Field(0.0, ge=0, le=1)
    max_usd_day: Decimal = Field(Decimal("1"), ge=0)
    judge: str = Field("agreement", pattern=r"^(agreement|verifier|tier:[A-Za-z0-9_.-]+)$")
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
    """The drift alarm (``gateway/state/drift.py``): PSI of the last ``window`` routed scores (and tier mix)
    against the router file's calibration histogram, every ``interval_s``, once ``min_samples`` are in; an alert
    (the budget alerts' log and webhook) when a PSI reaches ``threshold`` (0.25: a significant shift)."""

    enabled: bool = True
    window: int = Field(1000, ge=50, le=100_000)
    min_samples: int = Field(200, ge=10)
    interval_s: float = Field(10.0, gt=0)
    threshold: float = Field(0.25, gt=0)


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

    @field_validator("thresholds")
    @classmethod
    def _ascending(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and (any(not 0 <= t <= 1 for t in v) or v != sorted(v)):
            raise ValueError("thresholds must be ascending values in [0, 1]")
        return v


class RedisConfig(_Strict):
    """Where the shared state lives (see ``gateway/state/redis.py`` for the URL forms).

    ``url``: ``redis://`` / ``rediss://`` / ``unix://`` (one server), ``redis+cluster://host:port`` (Redis
    Cluster), ``redis+sentinel://host:port[,host:port…]/service_name[/db]`` (Sentinel). In Cluster mode
    ``key_prefix`` is wrapped in a hash tag (``{tg:}``) unless it already has one: the keys of the admission and
    metering scripts share that slot, and tenant-owned keys (cache, conversations, sessions…) get a tag of their
    own tenant (``{tg:<tenant>}``, ``gateway/state/keys.py``); a prefix with its own hash tag keeps every key in
    that one slot. ``socket_timeout_s`` bounds connect and every command;
    after a failure the circuit breaker answers "down" at once for ``breaker_cooldown_s`` seconds.
    """

    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "tg:"
    socket_timeout_s: float = Field(0.25, gt=0)
    start_if_missing: bool = True
    breaker_cooldown_s: float = Field(5.0, gt=0)
    max_connections: int = Field(256, ge=1)


class SemanticCacheConfig(_Strict):
    """The semantic cache (``gateway/state/semantic_cache.py``): a request the exact cache would look up may
    also be answered by a stored answer to a *similar* last user turn, same tenant and same everything else.
    ``threshold``: minimum similarity in [0, 1] (MinHash Jaccard for ``lexical``, cosine for ``openai:<tier>``,
    which calls that tier's ``/v1/embeddings``). At most ``max_entries_per_tenant`` entries per tenant scope
    (the soonest to expire are evicted first); last user turns longer than ``max_chars`` characters are not
    cached semantically (a one-word edit in a long text barely moves the similarity)."""

    enabled: bool = False
    threshold: float = Field(0.8, ge=0, le=1)
    embedder: str = Field("lexical", pattern=r"^(lexical|openai:[A-Za-z0-9_.-]+)$")
    max_entries_per_tenant: int = Field(10_000, ge=1)
    max_chars: int = Field(2000, ge=1)
    max_candidates: int = Field(16, ge=1, le=256)
    embed_timeout_s: float = Field(2.0, gt=0)


class CacheConfig(_Strict):
    """The exact response cache. ``mode``: ``deterministic`` caches only temperature-0 or seeded requests,
    ``always`` every request, ``off`` none. ``ttl_s`` is the default entry lifetime; a request may ask for
    another with the ``x-thinkgate-cache-ttl`` header, clamped to ``max_ttl_s``. Entries larger than
    ``max_entry_bytes`` (stored bytes) are not stored. Concurrent identical misses wait up to
    ``single_flight_wait_s`` seconds for the first one (0 disables single-flight). ``semantic``: the similar-question
    cache on top (:class:`SemanticCacheConfig`, off by default)."""

    mode: Literal["deterministic", "always", "off"] = "deterministic"
    ttl_s: int = Field(3600, ge=1)
    max_ttl_s: int = Field(7 * 86400, ge=1)
    max_entry_bytes: int = Field(1_000_000, ge=1)
    single_flight_wait_s: float = Field(30.0, ge=0)
    replay_chunk_chars: int = Field(16, ge=1)
    semantic: SemanticCacheConfig = Field(default_factory=SemanticCacheConfig)


class MeteringConfig(_Strict):
    """Usage events: Redis Stream ``{prefix}usage:events`` + counters; a local fsync'd spool while Redis is
    down, replayed every ``replay_interval_s`` seconds. ``dedup_ttl_s`` is how long an ``event_id`` is
    remembered (a spool replayed later than that could count twice). ``stream_maxlen`` trims the stream
    approximately (None = never; exports read the stream)."""

    spool_path: Path = STATE_DIR / "usage-spool.jsonl"
    replay_interval_s: float = Field(5.0, gt=0)
    dedup_ttl_s: int = Field(40 * 86400, ge=60)
    stream_maxlen: int | None = Field(None, ge=1000)
    # Write-ahead records (gateway/state/write_ahead.py): every upstream call leaves one in Redis before its first
    # byte, its streamed tokens written at most every write_ahead_interval_s, deleted by its usage event; records
    # of a process whose heartbeat (TTL heartbeat_ttl_s) expired are metered as partial by any replica, checked at
    # start and every reconcile_interval_s (at most reconcile_batch records per pass).
    write_ahead: bool = True
    write_ahead_interval_s: float = Field(1.0, gt=0)
    heartbeat_ttl_s: float = Field(15.0, ge=0.5)
    reconcile_interval_s: float = Field(30.0, gt=0)
    reconcile_batch: int = Field(1000, ge=1)


class KeyConfig(_Strict):
    """An API key declared in the config file. Give ``secret_sha256`` (hex) — or ``secret`` for local
    development, which is hashed at load and never kept.

    Policy: ``allowed_tiers`` (None = all) with ``on_disallowed_tier`` (``refuse`` → 403 naming the allowed
    tiers; ``downgrade`` → the most capable allowed tier below the one asked for); ``max_thinking_budget``
    (tokens) caps the thinking budget of every request of the key; ``over_cap``: a ``max_tokens`` above the
    tier's cap or a ``thinking_token_budget`` above the key's is clamped (default) or refused (400)."""

    id: str = Field(pattern=r"^[A-Za-z0-9_.:-]+$")
    secret: str | None = None
    secret_sha256: str | None = None
    tags: dict[str, str] = Field(default_factory=dict)
    budget_usd_day: Decimal | None = Field(None, ge=0)
    budget_usd_month: Decimal | None = Field(None, ge=0)
    rpm: int | None = Field(None, ge=1)
    tpm: int | None = Field(None, ge=1)
    cache_namespace: str | None = None
    allowed_tiers: list[str] | None = None
    on_disallowed_tier: Literal["refuse", "downgrade"] = "refuse"
    max_thinking_budget: int | None = Field(None, ge=0)
    over_cap: Literal["clamp", "refuse"] = "clamp"

    @model_validator(mode="before")
    @classmethod
    def _hash_secret(cls, data: Any) -> Any:
        # The plain secret is hashed before the (frozen) model exists and never kept.
        if isinstance(data, dict) and isinstance(data.get("secret"), str):
            data = {**data, "secret_sha256": hashlib.sha256(data["secret"].encode()).hexdigest(), "secret": None}
        return data

    @model_validator(mode="after")
    def _has_secret(self) -> KeyConfig:
        if not self.secret_sha256:
            raise ValueError(f"key {self.id!r} needs secret or secret_sha256")
        return self


class AuthConfig(_Strict):
    """``key_cache_s``: how long a key found in the Redis store is trusted without asking again (revocation
    takes effect within it); ``key_stale_s``: how long a known key keeps working while Redis is down."""

    require_key: bool = True
    admin_key_sha256: str | None = None
    keys: list[KeyConfig] = Field(default_factory=list)
    dev_key_file: Path = STATE_DIR / "dev-key"
    key_cache_s: float = Field(5.0, ge=0)
    key_stale_s: float = Field(3600.0, ge=0)


class LevelBudget(_Strict):
    """A budget of a level above the key (a tag, or the whole gateway), USD per UTC day / month."""

    usd_day: Decimal | None = Field(None, ge=0)
    usd_month: Decimal | None = Field(None, ge=0)


class LimitsConfig(_Strict):
    """Budgets and rate limits. ``budget_mode``: ``hard`` admits only when spend + open reservations + this
    request's upper-bound estimate fit in every budget it is under; ``soft`` admits while spend + open
    reservations are below the budget (overshoot bounded by one capped request; ``docs/metering.md``).
    ``tag_budgets`` (``"team=a": {usd_day, usd_month}``) are shared by every key with that tag,
    ``global_budget`` by all keys; budgets set with ``thinkgate budgets set`` (Redis) override these per level
    and are in force for the next request (admission reads them in Redis); the per-process copy re-read every
    ``budget_refresh_s`` seconds serves only while Redis is down. ``on_redis_down``: ``fail_open`` admits on local
    approximate counters, ``fail_closed`` refuses (503). A reservation not settled within
    ``reservation_ttl_s`` seconds (a crashed replica) stops counting; streams renew theirs while they run, up to
    ``max_stream_s``. Alerts fire once per period and level
    at each of ``alert_fractions`` of a budget."""

    budget_mode: Literal["hard", "soft"] = "hard"
    tag_budgets: dict[str, LevelBudget] = Field(default_factory=dict)
    global_budget: LevelBudget | None = None
    budget_refresh_s: float = Field(2.0, ge=0)
    on_redis_down: Literal["fail_open", "fail_closed"] = "fail_open"
    alert_fractions: list[float] = Field(default_factory=lambda: [0.5, 0.8, 1.0])
    alert_webhook_url: str | None = None
    alert_webhook_timeout_s: float = Field(2.0, gt=0)
    alert_webhook_attempts: int = Field(5, ge=1, le=20)
    alert_webhook_backoff_s: float = Field(0.5, ge=0)
    alert_dead_letter_path: Path = STATE_DIR / "alerts-dead-letter.jsonl"
    reservation_ttl_s: float = Field(600.0, gt=0)
    #: a stream renews its reservations every third of ``reservation_ttl_s`` while it runs, and is cut (finish
    #: reason ``length``, metered) once it has run this long, so no reservation outlives its bound
    max_stream_s: float = Field(3600.0, gt=0)
    #: ``auto``: one admission script for every level on a single Redis, one per level group (with rollback) on
    #: Redis Cluster; ``single`` / ``grouped`` force one (``gateway/state/limits.py``)
    admission_script: Literal["auto", "single", "grouped"] = "auto"

    @field_validator("alert_fractions")
    @classmethod
    def _fractions(cls, v: list[float]) -> list[float]:
        if any(not 0 < f <= 10 for f in v):
            raise ValueError("alert_fractions must be in (0, 10]")
        return sorted(set(v))

    @field_validator("tag_budgets")
    @classmethod
    def _tags(cls, v: dict[str, LevelBudget]) -> dict[str, LevelBudget]:
        for tag in v:
            k, sep, _ = tag.partition("=")
            if not sep or not k or "|" in tag:
                raise ValueError(f"tag budget keys are 'name=value', got {tag!r}")
        return v


class DashboardConfig(_Strict):
    """``GET /dashboard`` (``gateway/api/dashboard/``): on unless ``enabled: false``. The session cookie is
    signed with the secret in ``secret_file`` (created 0600 on first use; replicas behind one load balancer
    share it by pointing at the same file) and expires after ``session_ttl_s`` seconds. ``secure_cookie``
    adds the ``Secure`` attribute (set it behind TLS). ``poll_s``: how often the page refreshes its data."""

    enabled: bool = True
    session_ttl_s: int = Field(8 * 3600, ge=60)
    secret_file: Path = STATE_DIR / "dashboard-secret"
    secure_cookie: bool = False
    poll_s: float = Field(10.0, ge=1)


class TelemetryConfig(_Strict):
    """OpenTelemetry traces (``gateway/telemetry.py``), off unless ``otlp_endpoint`` is set: the OTLP/HTTP
    traces URL (e.g. ``http://127.0.0.1:4318/v1/traces``). Needs ``pip install 'thinkgate[otel]'``.
    ``sample_ratio``: the share of new traces recorded (``ParentBased(TraceIdRatioBased)``: a client's sampled
    ``traceparent`` is always followed); 1.0 records every request."""

    otlp_endpoint: str | None = None
    sample_ratio: float = Field(1.0, ge=0, le=1)
    service_name: str = "thinkgate"
    headers: dict[str, str] = Field(default_factory=dict)
    export_timeout_s: float = Field(10.0, gt=0)


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    max_body_bytes: int = Field(1_000_000, ge=1)
    log_level: str = "info"


class EngineConfig(_Strict):
    """The embedded upstream: a vLLM OpenAI server on loopback serving the local model."""

    enabled: bool = True
    model_path: Path = DEFAULT_MODEL_DIR
    served_model_name: str = "thinkgate-tiny"
    host: str = "127.0.0.1"
    port: int = Field(8001, ge=1, le=65535)
    kv_cache_gib: int = Field(1, ge=1)
    cpu_threads_bind: str = "0-1"
    reasoning_parser: str = "qwen3"
    dtype: str = "float32"
    max_model_len: int = Field(2048, ge=64)
    startup_timeout_s: float = Field(300.0, gt=0)
    extra_args: list[str] = Field(default_factory=list)


class MetricsConfig(_Strict):
    """Prometheus ``/metrics``. Labels are bounded: tier, upstream model (both from this config), route reason,
    cache result, status class; the key id only when ``key_id_label`` (one series per key)."""

    key_id_label: bool = False


class ResponsesConfig(_Strict):
    """``POST /v1/responses``: a stored answer (``store`` not false) can be continued with
    ``previous_response_id`` for ``store_ttl_s`` seconds (``gateway/state/conversations.py``)."""

    store_ttl_s: int = Field(3600, ge=1)


def _default_tiers() -> list[TierConfig]:
    # Budgets follow the shipped model's measured thought lengths (docs/local-model.md, "Measured"): thinkgate-tiny
    # v2 re-checks every step, 57 thought tokens on 1 operation and up to ~300 on 6; 32 keeps 98% on 1 operation.
    return [
        TierConfig(
            name="none",
            max_tokens=64,
            thinking_budget=0,
            enable_thinking=False,
            budget_mode="off",
            prices=Prices(
                input_usd_per_mtok=Decimal("0.05"),
                cached_input_usd_per_mtok=Decimal("0.025"),
                output_usd_per_mtok=Decimal("0.20"),
            ),
        ),
        TierConfig(
            name="short",
            max_tokens=96,
            thinking_budget=32,
            escalate_on=["empty_answer"],
            prices=Prices(
                input_usd_per_mtok=Decimal("0.10"),
                cached_input_usd_per_mtok=Decimal("0.05"),
                output_usd_per_mtok=Decimal("0.40"),
            ),
        ),
        TierConfig(
            name="long",
            max_tokens=448,
            thinking_budget=320,
            prices=Prices(
                input_usd_per_mtok=Decimal("0.50"),
                cached_input_usd_per_mtok=Decimal("0.25"),
                output_usd_per_mtok=Decimal("2.00"),
            ),
        ),
    ]


class Settings(BaseSettings):
    """The whole configuration. Build with :meth:`Settings.load`."""

    model_config = SettingsConfigDict(env_prefix="THINKGATE_", env_nested_delimiter="__", extra="forbid", frozen=True)

    server: ServerConfig = Field(default_factory=ServerConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    tiers: list[TierConfig] = Field(default_factory=_default_tiers)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    metering: MeteringConfig = Field(default_factory=MeteringConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    responses: ResponsesConfig = Field(default_factory=ResponsesConfig)
    dashboard: DashboardConfig = Field(default_factory=DashboardConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        yaml_file = _YAML_FILE.get()
        if yaml_file is not None:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=yaml_file))
        return tuple(sources)

    @model_validator(mode="after")
    def _cross_check(self) -> Settings:
        if "tiers" not in self.model_fields_set:
            # The embedded default tiers are served by the embedded engine: they follow engine.host/port
            # (THINKGATE_ENGINE__PORT moved the engine and left the tiers on 8001). Configured tiers are as written.
            url = f"http://{self.engine.host}:{self.engine.port}/v1"
            object.__setattr__(self, "tiers", [t.model_copy(update={"base_url": url}) for t in self.tiers])
        names = [t.name for t in self.tiers]
        if not names:
            raise ValueError("tiers: at least one tier is required")
        if len(set(names)) != len(names):
            raise ValueError(f"tiers: names must be unique, got {names}")
        if "auto" in names:
            raise ValueError("tiers: 'auto' is reserved for routed requests")
        r = self.routing
        for field, tiers in (("routing.routed_tiers", r.routed_tiers), ("routing.default_tier", [r.default_tier])):
            for t in tiers:
                if t not in names:
                    raise ValueError(f"{field}: unknown tier {t!r} (tiers: {names})")
        if "effort_tiers" not in r.model_fields_set:
            # The embedded default names the none/short/long tiers; with other tiers (e.g. only short and long on
            # GPUs) each effort falls back to the cheapest (none, minimal, low) or the top routed tier instead of
            # refusing a config that never mentioned effort. An explicit map is checked as written.
            cheap, top = r.routed_tiers[0], r.routed_tiers[-1]
            fitted = {e: t if t in names else (cheap if e in ("none", "minimal", "low") else top)
                      for e, t in r.effort_tiers.items()}
            object.__setattr__(r, "effort_tiers", fitted)  # frozen model: resolved once, during validation
        for effort, t in r.effort_tiers.items():
            if t not in names:
                raise ValueError(f"routing.effort_tiers.{effort}: unknown tier {t!r} (tiers: {names})")
        embedder = self.cache.semantic.embedder
        if embedder.startswith("openai:") and embedder.removeprefix("openai:") not in names:
            raise ValueError(f"cache.semantic.embedder: unknown tier {embedder.removeprefix('openai:')!r} "
                             f"(tiers: {names})")
        if r.thresholds is not None and len(r.thresholds) != len(r.routed_tiers) - 1:
            raise ValueError("routing.thresholds: need exactly len(routed_tiers) - 1 values")
        for k in self.auth.keys:
            for t in k.allowed_tiers or ():
                if t not in names:
                    raise ValueError(f"auth.keys.{k.id}.allowed_tiers: unknown tier {t!r} (tiers: {names})")
        return self

    def tier(self, name: str) -> TierConfig:
        """The tier called ``name``; raises KeyError if there is none."""
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> Settings:
        """Build the settings from ``path`` (or ``$THINKGATE_CONFIG``), the environment and ``overrides``.

        Raises :class:`ConfigError` naming each invalid field, or when the file is missing/unreadable.
        """
        path = path or os.environ.get("THINKGATE_CONFIG")
        yaml_path = Path(path) if path else None
        if yaml_path is not None and not yaml_path.is_file():
            raise ConfigError(f"config file not found: {yaml_path}")
        if "REDIS_URL" in os.environ and "THINKGATE_REDIS__URL" not in os.environ:
            overrides.setdefault("redis", {}).setdefault("url", os.environ["REDIS_URL"])
        token = _YAML_FILE.set(yaml_path)
        try:
            return cls(**overrides)
        except ValidationError as exc:
            raise ConfigError(_describe(exc, yaml_path)) from None
        finally:
            _YAML_FILE.reset(token)


def _describe(exc: ValidationError, path: Path | None) -> str:
    where = f" in {path}" if path else ""
    lines = [f"invalid configuration{where}:"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(root)"
        lines.append(f"  {loc}: {err['msg']}")
    return "\n".join(lines)
