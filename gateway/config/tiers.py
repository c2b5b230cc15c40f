"""Reasoning tiers (``tiers:``): where each tier's upstream is, how much it may think, what it costs.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from gateway.config.base import _Strict


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
    the two (or both with ``base_url`` among ``base_urls``); with neither, the embedded engine's address
    (``engine.host``/``engine.port``, set by ``Settings``).

    ``thinking_budget`` is in tokens (``None`` = unlimited). ``budget_mode``: ``native`` sends vLLM's
    per-request ``thinking_token_budget``; ``forced`` enforces it in the gateway by two-phase budget
    forcing (stop the thought at the budget, append ``end_of_thinking``, continue for the answer);
    ``off`` sends no budget; ``prompted`` sends the budget *to the model* in its prompt (a dial model,
    ``models/thinkgate-tiny-dial``): ``budget_prompt`` (``{budget}`` = tokens) is appended to the last
    user message, and a hard stop stays above it (``gateway/thinking/dial.py``): ``hard_stop: forced`` (the
    default; any OpenAI-compatible upstream) cuts an overrun by two-phase budget forcing, whose phase 2 sends the
    prompt again; ``hard_stop: native`` (vLLM) sends the stop as the request's ``thinking_token_budget``, one
    pass, the prompt billed once.
    ``thinking_budget_range: [min, max]`` declares the budgets the tier's model follows (a dial model's
    ``budget_range``): every budget the tier serves — its own, a dial router's pick, a request's
    ``thinking_token_budget`` (Anthropic's ``thinking.budget_tokens``), a key's cap — is clamped into it
    (:meth:`applied_budget`; a key with ``over_cap: refuse`` gets a 400 for a request's own budget outside it
    instead, ``gateway/pipeline/policy.py``); ``thinking_budget`` itself must lie in it (or be 0 / null).
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
    #: how a ``prompted`` tier stops a thought that overruns its requested budget (class doc)
    hard_stop: Literal["forced", "native"] = "forced"
    #: the thinking budgets (tokens, ``[min, max]``) this tier's model follows — a dial model's ``budget_range``
    #: (its ``dial.json``); a budget asked outside it is served at the nearest end, and that is the one
    #: ``x-thinkgate-thinking-budget`` reports (:meth:`applied_budget`); null: any budget, as asked
    thinking_budget_range: tuple[int, int] | None = None
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
    #: how long a non-streamed answer may take (it comes whole when the generation ends: a long thought is silence
    #: until then); the OpenAI SDK's and LiteLLM's default request timeout. At least ``read_timeout_s``.
    response_timeout_s: float = Field(600.0, gt=0)
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
        if self.response_timeout_s < self.read_timeout_s:  # a whole answer cannot come before its first byte could
            raise ValueError(f"response_timeout_s ({self.response_timeout_s}) must be >= read_timeout_s "
                             f"({self.read_timeout_s})")
        return self

    @model_validator(mode="after")
    def _one_answer_by_default(self) -> TierConfig:
        # admission bounds a request's cost from the client's own n and best_of; a default of several answers from
        # the tier would be billed n times over what was booked against the budgets
        several = sorted(k for k in ("n", "best_of") if self.sampling.get(k) not in (None, 1))
        if several:
            raise ValueError(f"sampling: {', '.join(several)} cannot be set on a tier (several answers per request "
                             "are the client's to ask for, and admission books them from the request)")
        return self

    @model_validator(mode="after")
    def _budget_in_range(self) -> TierConfig:
        r = self.thinking_budget_range
        if r is None:
            return self
        if not 1 <= r[0] <= r[1]:
            raise ValueError(f"thinking_budget_range must be [min, max] with 1 <= min <= max, got {list(r)}")
        b = self.thinking_budget
        if b is not None and b != 0 and not r[0] <= b <= r[1]:  # 0 is thinking off, None unlimited: no budget
            raise ValueError(f"thinking_budget {b} is outside thinking_budget_range {list(r)}: the tier's model "
                             "would not follow it")
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

    def applied_budget(self, budget: int | None) -> int | None:
        """The thinking budget (tokens) this tier serves for ``budget``: clamped into ``thinking_budget_range``
        when the tier declares one (above its maximum → the maximum, below its minimum → the minimum), else as
        given; None (unlimited) and 0 (thinking off) are not budgets to clamp and stay as they are."""
        r = self.thinking_budget_range
        if r is None or budget is None or budget <= 0:
            return budget
        return min(max(budget, r[0]), r[1])

    @property
    def upstream_urls(self) -> tuple[str, ...]:
        """The tier's upstream base URLs: ``base_urls``, else ``(base_url,)``."""
        return tuple(self.base_urls) or (self.base_url,)


def unpriced_tiers(tiers: list[TierConfig]) -> list[str]:
    """Names of the tiers whose three prices are all zero (the default when ``prices`` is left out): their tokens
    are metered at 0 micro-USD, so no spend budget, cost limit or USD savings figure can bind on them. ``serve``
    warns with this list at start; an on-premise tier may be free on purpose, so it is not an error."""
    return [t.name for t in tiers if t.prices == Prices()]


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

