"""Shadow comparisons: did the cheaper tier's answer suffice? Ask the next tier up, after the client has its answer.

For a sampled ``routing.shadow.fraction`` of the chat requests routed (reason ``predicted``, not escalated) to
a routed tier below the top one, non-streamed or streamed, with one choice: once the client's answer is
complete — a JSON answer: from the response's background hook, which Starlette runs after the last byte was
sent; a stream: when the relay closed the exchange after the last chunk — :meth:`Shadow.start` hands the
job to a task and returns at once, so the client's response and its connection are never held. The task:

1. skips when ``max_concurrency`` shadow calls are in flight on this replica, or when today's shadow spend has
   reached ``max_usd_day``, or when Redis does not answer that read in time (a timeout, Redis down, the breaker
   open). Today's shadow spend is what metering counted for the key ``_shadow`` that UTC day — ``cost_micro_usd``
   of ``p usage:key:_shadow:d:{YYYY-MM-DD}``, written atomically with each usage event by the metering script and,
   for an event spooled during an outage, when it is replayed — the one number shown as shadow spend (``thinkgate
   usage report``, the dashboard) and the one admission reserves against; there is no second counter. This check
   only saves a doomed call: a call that finished a moment ago may not be counted yet, and admission (step 2) is
   what holds the cap. Skipping on a timeout is deliberate: a comparison is optional evidence, and one not made
   costs a label, never money (``stats.skipped["redis_down"]``);
2. sends the same request, non-streamed, to the next routed tier up; metered as a usage event with route
   reason ``shadow`` under the key id ``_shadow`` (so a client's budget never pays for it). Like every upstream
   call it is admitted first (``Accounting.admit``): reserved against the shadow's own budget — the key
   ``_shadow`` with ``max_usd_day`` as its daily budget, whose spend is exactly the shadow calls' — *and* the
   global level, always in ``hard`` mode whatever ``limits.budget_mode`` says for the keys: spend + open
   reservations + this call's upper-bound estimate must fit, so neither budget can be overspent by shadow or judge
   calls, however many are in flight (``soft`` admitted while spend + reserved was below the cap, and the last
   call admitted took the day's shadow spend past ``max_usd_day`` by up to its estimate: the cap is a promise
   about the gateway's own spend, and a comparison is optional evidence); a refused call is skipped
   (``stats.skipped["admission"]``), never sent. An admitted call's write-ahead record is written before it is
   sent (``Accounting.write_ahead``), so a gateway killed during it has it billed by the next reconcile, and one
   cancelled in flight (the gateway stopping) is metered ``partial``, status 499; one cancelled while its
   admission is out is metered as never sent (499, cost 0) once that admission admits, which settles its
   reservations at once (``Accounting.admit_estimate``);
3. judges: ``agreement`` compares the normalised final answers (:func:`normalise_answer`: the part after a
   last ``Answer:``, thinking removed, lower case, punctuation, articles and extra spaces dropped); a
   ``tier:<name>`` judge gets :data:`JUDGE_PROMPT` and answers YES/NO (its call metered as ``shadow`` too);
   ``normalised``: the final answers compared with the task checkers where one applies (numbers, math),
   abstentions and word containment elsewhere (``gateway/control/shadow_normalised.py``);
   ``verifier``: a request whose question is in ``routing.shadow.references`` is judged by the task verifier
   against the reference answer (``gateway/control/shadow_references.py``) before step 1, with no call at
   all; the others by ``agreement``;
4. records a ``shadow`` outcome (``gateway/control/outcomes.py``: spooled while Redis is down) with both tiers,
   the judge, ``sufficed`` and what the evidence cost.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import string
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Protocol

import orjson

from gateway.auth.keys import KeyInfo
from gateway.config import Settings, TierConfig
from gateway.control.outcomes import OutcomeStore
from gateway.control.shadow_normalised import NormalisedJudge
from gateway.control.shadow_references import References
from gateway.errors import GatewayError
from gateway.ledger.event import ROUTER_DECIDED, RouteReason, WireEndpoint
from gateway.ledger.record import UsageRecord
from gateway.openai.usage import estimate_prompt, estimate_tokens, generated_text
from gateway.state.breaker import Breaker, RedisDown
from gateway.state.keys import RedisKeys
from gateway.state.limits import BudgetMode
from gateway.state.redis import RedisHandle
from gateway.upstream.pool import UpstreamPool

log = logging.getLogger("thinkgate.shadow")

SHADOW_KEY = "_shadow"
#: the status of a shadow or judge call cancelled in flight (the gateway stopping): nginx's "client closed request",
#: as a request whose client went away is metered
CANCELLED_STATUS = 499
CHAT_PATH = "/chat/completions"

JUDGE_PROMPT = (
    "You compare two answers to the same question. Reply with exactly one word: YES if answer A reaches the "
    "same final answer as answer B (wording may differ), NO otherwise.\n\n"
    "Question:\n{question}\n\nAnswer A:\n{a}\n\nAnswer B:\n{b}\n\nSame final answer (YES or NO)?"
)

_THINK = re.compile(r"<think>.*?</think>", re.S)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalise_answer(text: str) -> str:
    """The comparable final answer of ``text``: after the last ``Answer:`` when there is one, ``<think>``
    blocks removed, lower case, punctuation and the articles a/an/the dropped, whitespace collapsed."""
    text = _THINK.sub(" ", text)
    low = text.lower()
    cut = low.rfind("answer:")
    if cut >= 0:
        low = low[cut + len("answer:"):]
    low = _ARTICLES.sub(" ", low.translate(_PUNCT))
    return " ".join(low.split())


def answers_agree(a: str, b: str) -> bool:
    """Normalised-answer agreement (:func:`normalise_answer`); two empty answers do not agree."""
    na, nb = normalise_answer(a), normalise_answer(b)
    return bool(na) and na == nb


def answer_text(answer: dict[str, Any]) -> str:
    """The first choice's text of a chat completion JSON (``message.content``; '' when missing)."""
    choices = answer.get("choices") or [{}]
    msg = choices[0].get("message") or {}
    content = msg.get("content")
    return content if isinstance(content, str) else ""


class Route(Protocol):
    """What the shadow runner reads of a route (:class:`gateway.pipeline.routing.RouteDecision` is one): the
    tier served, why, the router score and the routing window the router scored."""

    @property
    def tier(self) -> TierConfig: ...

    @property
    def reason(self) -> RouteReason: ...

    @property
    def difficulty(self) -> float | None: ...

    @property
    def window(self) -> str | None: ...


#: ``(client body, tier, endpoint) → the body sent to that tier's upstream`` (``pipeline.upstream_body.build``)
BodyBuilder = Callable[[dict[str, Any], TierConfig, WireEndpoint], dict[str, Any]]


class Admit(Protocol):
    """``Accounting.admit``: reserve one call's upper bound at every level it is under, or raise (429/503)."""

    def __call__(self, key: KeyInfo, body: dict[str, Any], record: UsageRecord, tiers: list[TierConfig], /, *,
                 budget_mode: BudgetMode | None = None) -> Awaitable[Any]: ...


class NotAdmitted(Exception):
    """A shadow or judge call that admission refused (its budget or the global one): never sent."""


@dataclass(slots=True)
class ShadowJob:
    """One comparison to run: the client's request ``body``, its usage ``record`` and ``route``, its answer."""

    body: dict[str, Any]
    record: UsageRecord
    route: Route
    answer: str
    higher: TierConfig


@dataclass(slots=True)
class ShadowStats:
    """Counters of this replica (for tests and the bench): started, skipped by reason, failed, outcomes."""

    started: int = 0
    done: int = 0
    failed: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, why: str) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1


class Shadow:
    """The shadow runner of one gateway process (see the module docstring)."""

    def __init__(self, settings: Settings, upstreams: UpstreamPool, handle: RedisHandle, breaker: Breaker,
                 outcomes: OutcomeStore, sinks: list[Any], *, build_body: BodyBuilder,
                 rng: random.Random | None = None,
                 admit: Admit | None = None,
                 write_ahead: Callable[[UsageRecord], Awaitable[None]] | None = None) -> None:
        self.cfg = settings.routing.shadow
        self.routed = list(settings.routing.routed_tiers)
        self.tiers = {t.name: t for t in settings.tiers}
        self.judge_tier = self.tiers.get(self.cfg.judge.removeprefix("tier:")) if self.cfg.judge.startswith(
            "tier:") else None
        if self.cfg.judge.startswith("tier:") and self.judge_tier is None:
            raise ValueError(f"routing.shadow.judge: unknown tier {self.cfg.judge!r}")
        self.references = (References.load(self.cfg.references, self.cfg.verifier)
                           if self.cfg.judge == "verifier" and self.cfg.references is not None else None)
        #: the ``normalised`` judge (gateway/control/shadow_normalised.py), built when configured
        self.normalised = NormalisedJudge(normalise_answer) if self.cfg.judge == "normalised" else None
        self.upstreams = upstreams
        #: the upstream body of a shadow or judge call (the pipeline's builder, passed in by the app)
        self.build_body = build_body
        self.redis = handle.client
        self.keys = RedisKeys.of(handle)
        self.breaker = breaker
        self.outcomes = outcomes
        self.sinks = sinks
        self.rng = rng or random.Random()
        self.budget_micro = int(self.cfg.max_usd_day * Decimal(1_000_000))
        #: admission of each shadow/judge call (``Accounting.admit``; None: no accounting, nothing to admit)
        self.admit = admit
        #: the write-ahead record of each admitted call, before it is sent (``Accounting.write_ahead``; None: off)
        self.write_ahead = write_ahead
        self.key = KeyInfo(id=SHADOW_KEY, budget_usd_day=self.cfg.max_usd_day)
        self.stats = ShadowStats()
        self._inflight = 0
        self._tasks: set[asyncio.Task[None]] = set()

    # --- selection --------------------------------------------------------------------------------------
    def higher_of(self, tier: str) -> TierConfig | None:
        """The next routed tier above ``tier`` (None for the top one or a tier outside ``routed_tiers``)."""
        if tier not in self.routed:
            return None
        i = self.routed.index(tier)
        return self.tiers[self.routed[i + 1]] if i + 1 < len(self.routed) else None

    def sampled(self, route: Route, body: dict[str, Any]) -> bool:
        """Whether this request is shadowed (decided before serving: a router's decision — an explored cheap
        answer is the label exploration exists for; a spot check is on the top tier, which has nothing above —, a
        lower routed tier, one choice, sampled at ``fraction``)."""
        if self.cfg.fraction <= 0 or route.reason not in ROUTER_DECIDED or self.higher_of(route.tier.name) is None:
            return False
        if (body.get("n") or 1) != 1 or not isinstance(body.get("messages"), list):
            return False
        return self.rng.random() < self.cfg.fraction

    def job(self, body: dict[str, Any], record: UsageRecord, route: Route,
            answer: dict[str, Any]) -> ShadowJob | None:
        """The job for a complete answer on ``route`` (None: the answer came from elsewhere — escalated, a
        fallback, a cache hit — or from the top tier)."""
        if route.reason not in ROUTER_DECIDED or record.cached:
            return None
        higher = self.higher_of(route.tier.name)
        if higher is None:
            return None
        return ShadowJob(dict(body), record, route, answer_text(answer), higher)

    # --- running ----------------------------------------------------------------------------------------
    def start(self, job: ShadowJob) -> None:
        """Run ``job`` in the background (returns at once); skipped at ``max_concurrency``."""
        if self._inflight >= self.cfg.max_concurrency:
            self.stats.skip("concurrency")
            return
        self._inflight += 1
        self.stats.started += 1
        task = asyncio.get_running_loop().create_task(self._run(job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def start_after_response(self, job: ShadowJob) -> None:
        """Starlette background hook of a JSON response (runs after its last byte was sent)."""
        self.start(job)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Let running comparisons finish (bounded), then cancel the rest."""
        if not self._tasks:
            return
        _, pending = await asyncio.wait(list(self._tasks), timeout=timeout_s)
        for t in pending:
            t.cancel()

    async def _run(self, job: ShadowJob) -> None:
        try:
            refs = self.references
            ref = refs.find(job.body) if refs is not None else None
            if refs is not None and ref is not None:  # the verifier needs no second answer
                outcome = self.outcomes.outcome_of(job.record, "shadow", sufficed=refs.verdict(ref, job.answer),
                                                   judge="verifier", other_tier=None, cost_micro_usd=0)
                if self.outcomes.cfg.retain_text:
                    outcome.answers = [job.answer]
                await self.outcomes.record(outcome)
                self.stats.done += 1
                return
            if not await self._within_budget():
                return
            higher_answer, cost = await self._call(job.higher, job.body, job)
            if higher_answer is None:
                self.stats.failed += 1
                return
            if self.normalised is not None:
                judge, sufficed = "normalised", self.normalised(job.answer, higher_answer)
            elif self.judge_tier is None:
                judge, sufficed = "agreement", answers_agree(job.answer, higher_answer)
            else:
                verdict, judge_cost = await self._judge(job, higher_answer)
                cost += judge_cost
                if verdict is None:
                    self.stats.failed += 1
                    return
                judge, sufficed = self.cfg.judge, verdict
            outcome = self.outcomes.outcome_of(job.record, "shadow", sufficed=sufficed, judge=judge,
                                               other_tier=job.higher.name, cost_micro_usd=cost)
            if self.outcomes.cfg.retain_text:
                outcome.answers = [job.answer, higher_answer]
            await self.outcomes.record(outcome)
            self.stats.done += 1
        except NotAdmitted:
            self.stats.skip("admission")
        except Exception:
            self.stats.failed += 1
            log.exception("shadow comparison of request %s failed", job.record.request_id)
        finally:
            self._inflight -= 1

    async def spent_today(self) -> int:
        """Today's (UTC) shadow spend in micro-USD: what metering counted for the key ``_shadow`` (its day
        counter's ``cost_micro_usd``; module docstring, step 1). Raises :class:`RedisDown` when Redis does not
        answer in time."""
        name = self.keys.key_day(SHADOW_KEY, time.strftime("%Y-%m-%d", time.gmtime()))
        spent = await self.breaker.call(lambda: self.redis.hget(name, "cost_micro_usd"))
        return int(spent or 0)

    async def _within_budget(self) -> bool:
        try:
            spent = await self.spent_today()
        except RedisDown:  # deliberate: no comparison while the day's spend cannot be read (module docstring)
            self.stats.skip("redis_down")
            return False
        if spent >= self.budget_micro:
            self.stats.skip("budget")
            return False
        return True

    async def _call(self, tier: TierConfig, body: dict[str, Any], job: ShadowJob) -> tuple[str | None, int]:
        """One non-streamed call on ``tier``, metered as ``shadow``; (its answer text or None, its cost)."""
        req = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        built = self.build_body(req, tier, "chat")
        record = UsageRecord(key_id=SHADOW_KEY, endpoint="chat", requested_model=tier.name, tier=tier.name,
                             upstream_model=tier.model, route_reason="shadow", difficulty=job.route.difficulty)
        if self.admit is not None:
            try:
                # hard whatever limits.budget_mode: max_usd_day caps our own spend (module docstring, step 2)
                await self.admit(self.key, built, record, [tier], budget_mode="hard")
            except GatewayError as exc:
                log.info("shadow call on %s not admitted: %s", tier.name, exc.code)
                raise NotAdmitted(exc.code or "refused") from None
        status, text = 200, None
        try:
            if self.write_ahead is not None:  # recorded before it is sent: a crash during it is billed by a reconcile
                await self.write_ahead(record)
            resp = await self.upstreams.open(tier, CHAT_PATH, orjson.dumps(built), stream=False)
            data = orjson.loads(resp.content)
            text = answer_text(data)
            if not record.set_usage(data.get("usage")):  # none to meter: our own spend, estimated, not 0
                record.prompt_tokens = estimate_prompt(built.get("messages"))
                record.set_counted(sum(estimate_tokens(generated_text(c, "chat"))
                                       for c in data.get("choices") or () if isinstance(c, dict)), 0)
        except asyncio.CancelledError:
            # cut by the gateway stopping (close): the call was sent, the upstream read its prompt — metered as a
            # cancelled non-streamed call is (prompt counted, nothing known generated), and its reservation settled
            # now instead of at its TTL; it used to leave no usage event at all
            record.partial, record.error_code = True, "cancelled"
            record.prompt_tokens, record.usage_source = estimate_prompt(built.get("messages")), "counted"
            record.finish(tier, CANCELLED_STATUS)
            self._meter(record)
            raise
        except Exception as exc:
            status = getattr(exc, "status", 502)
            record.error_code = getattr(exc, "code", "upstream_error")
            log.info("shadow call on %s failed: %r", tier.name, exc)
        record.finish(tier, status)
        self._meter(record)  # the one count of its spend: the usage ledger (today's shadow spend reads it)
        return text, record.cost_micro_usd

    def _meter(self, record: UsageRecord) -> None:
        for sink in self.sinks:
            sink(record)

    async def _judge(self, job: ShadowJob, higher_answer: str) -> tuple[bool | None, int]:
        assert self.judge_tier is not None
        question = job.route.window or ""
        prompt = JUDGE_PROMPT.format(question=question, a=job.answer, b=higher_answer)
        body = {"model": self.judge_tier.name, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
                "temperature": 0}
        text, cost = await self._call(self.judge_tier, body, job)
        if text is None:
            return None, cost
        word = normalise_answer(text).split()
        return (word[:1] == ["yes"]) if word else None, cost
