"""The probe: send problems to OpenAI-compatible targets (gateway tiers, an engine's settings), verify the answers.

One client for every "run problems through tiers and check them" job — ``thinkgate eval tiers``,
``thinkgate router label gateway``, the savings bench and the local model's measurement (``bench/tiny_measure.py``):

- :class:`ProbeClient` — a thread-safe httpx client for ``POST {base}/v1/chat/completions`` and
  ``GET {base}/v1/models``, with retries on connection errors and 429/5xx (backoff 0.5 s · 2^k). The server is
  found like the OpenAI SDK finds its own: :meth:`ProbeClient.from_env` reads ``THINKGATE_URL`` (default
  ``http://127.0.0.1:8080``, with or without ``/v1``) and ``THINKGATE_API_KEY``.
- :class:`Answer` — what came back: HTTP status, answer text, thought (``reasoning`` / ``reasoning_content``),
  ``usage`` (tokens), latency (ms) and the response headers (``x-thinkgate-*``).
- :func:`probe` — problems × targets → :class:`Outcome` rows (verified with the task's exact verifier), in
  parallel; :func:`summarize` / :func:`by_difficulty` — accuracy and reasoning tokens, overall and per level.

Money is not computed here: the router package knows no prices. Callers that need cost price the token counts
(the gateway's ``gateway.ledger.pricing``) or read the metering ledger.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from router.errors import ThinkGateError
from router.tasks.base import Problem

DEFAULT_URL = "http://127.0.0.1:8080"
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


class ProbeError(ThinkGateError, RuntimeError):
    """A probe call failed after its retries (the message names the URL and the cause)."""


def api_base(url: str) -> str:
    """``…/v1`` for a server URL given with or without the ``/v1`` suffix."""
    base = url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


@dataclass(frozen=True, slots=True)
class Answer:
    """One chat completion as the probe saw it. Token counts are the server's ``usage`` (0 when absent)."""

    status: int
    content: str = ""
    reasoning: str | None = None
    finish_reason: str | None = None
    usage: Mapping[str, Any] = field(default_factory=dict)
    latency_ms: float = 0.0
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True for a 200 answer."""
        return self.status == 200

    @property
    def prompt_tokens(self) -> int:
        return int(self.usage.get("prompt_tokens") or 0)

    @property
    def completion_tokens(self) -> int:
        return int(self.usage.get("completion_tokens") or 0)

    @property
    def reasoning_tokens(self) -> int:
        return int((self.usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0)

    @property
    def cached_tokens(self) -> int:
        return int((self.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    @classmethod
    def of(cls, resp: httpx.Response, latency_ms: float) -> Answer:
        """Parse a chat-completions response (any status; a non-JSON or error body gives an empty answer)."""
        try:
            data = resp.json() if resp.status_code == 200 else {}
        except ValueError:
            data = {}
        choice = (data.get("choices") or [{}])[0] if isinstance(data, dict) else {}
        msg = choice.get("message") or {}
        return cls(
            status=resp.status_code,
            content=str(msg.get("content") or ""),
            reasoning=msg.get("reasoning") or msg.get("reasoning_content"),
            finish_reason=choice.get("finish_reason"),
            usage=dict(data.get("usage") or {}) if isinstance(data, dict) else {},
            latency_ms=latency_ms,
            headers=dict(resp.headers),
        )


class ProbeClient:
    """A pooled, thread-safe client of one OpenAI-compatible server (see the module docstring).

    ``headers``: sent with every request (e.g. ``{"cache-control": "no-store"}`` so a rerun measures the engine,
    not the gateway's cache). ``max_retries`` applies to connection errors and 429/5xx answers.
    """

    def __init__(self, base_url: str = DEFAULT_URL, api_key: str | None = None, *, timeout_s: float = 300.0,
                 max_retries: int = 2, headers: Mapping[str, str] | None = None,
                 max_connections: int = 32) -> None:
        self.base_url = api_base(base_url)
        h = dict(headers or {})
        if api_key:
            h["authorization"] = f"Bearer {api_key}"
        self.max_retries = max_retries
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self.client = httpx.Client(base_url=self.base_url, headers=h, timeout=timeout_s, limits=limits,
                                   trust_env=False)

    @classmethod
    def from_env(cls, base_url: str | None = None, api_key: str | None = None, *, require_key: bool = True,
                 **kw: Any) -> ProbeClient:
        """The server at ``base_url`` (else ``THINKGATE_URL``, else :data:`DEFAULT_URL`) with ``api_key`` (else
        ``THINKGATE_API_KEY``). Raises ProbeError when no key is found and ``require_key``."""
        key = api_key if api_key is not None else os.environ.get("THINKGATE_API_KEY")
        if not key and require_key:
            raise ProbeError("set THINKGATE_API_KEY (the dev key: cat .thinkgate/dev-key)")
        return cls(base_url or os.environ.get("THINKGATE_URL") or DEFAULT_URL, key, **kw)

    def __enter__(self) -> ProbeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self.client.close()

    def models(self) -> list[dict[str, Any]]:
        """``GET /v1/models`` → its ``data`` list. Raises ProbeError when the server does not answer."""
        try:
            resp = self.client.get("/models")
            resp.raise_for_status()
            return list(resp.json()["data"])
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            raise ProbeError(f"server at {self.base_url} not reachable: {exc}") from exc

    def chat(self, model: str, messages: list[dict[str, Any]], *, check: bool = True,
             headers: Mapping[str, str] | None = None, **body: Any) -> Answer:
        """One non-streamed chat completion (``body``: extra fields such as ``temperature``).

        ``check``: raise ProbeError when the call still fails after the retries (connection error or non-200);
        with ``check=False`` a failure is returned as an :class:`Answer` with its status (0: no response).
        """
        payload = {"model": model, "messages": messages, "stream": False, **body}
        for attempt in range(self.max_retries + 1):
            t0 = time.perf_counter()
            try:
                resp = self.client.post("/chat/completions", json=payload, headers=headers)
            except httpx.TransportError as exc:
                if attempt < self.max_retries:
                    time.sleep(0.5 * 2**attempt)
                    continue
                if check:
                    raise ProbeError(f"{self.base_url}: {type(exc).__name__}: {exc}") from exc
                return Answer(status=0, latency_ms=(time.perf_counter() - t0) * 1000)
            if resp.status_code in RETRY_STATUS and attempt < self.max_retries:
                time.sleep(0.5 * 2**attempt)
                continue
            answer = Answer.of(resp, (time.perf_counter() - t0) * 1000)
            if check and not answer.ok:
                raise ProbeError(f"{self.base_url}: HTTP {resp.status_code}: {resp.text[:200]}")
            return answer
        raise AssertionError("unreachable")  # the loop returns or raises on its last attempt


@dataclass(frozen=True, slots=True)
class Target:
    """Where a problem is sent: ``model`` (a gateway tier name, or an engine's model) plus extra body fields
    (e.g. ``{"thinking_token_budget": 32}``); ``name`` labels the outcomes (defaults to ``model``)."""

    model: str
    body: Mapping[str, Any] = field(default_factory=dict)
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or self.model


@dataclass(frozen=True, slots=True)
class Outcome:
    """One (target, problem) measurement."""

    target: str
    problem: Problem
    correct: bool
    answer: Answer


def _verify(problem: Problem, content: str) -> bool:
    from router.tasks import verify

    return bool(verify(problem, content))


def probe(client: ProbeClient, problems: Sequence[Problem], targets: Iterable[Target | str], *,
          concurrency: int = 4, verify: Callable[[Problem, str], bool] = _verify,
          on_outcome: Callable[[Outcome], None] | None = None) -> list[Outcome]:
    """Send every problem to every target (single user turn, temperature 0 unless a target sets it) and verify
    the answer text (``content``) with ``verify``; outcomes in (target, problem) order. Raises ProbeError."""
    tlist = [t if isinstance(t, Target) else Target(t) for t in targets]
    jobs = [(t, p) for t in tlist for p in problems]

    def one(job: tuple[Target, Problem]) -> Outcome:
        t, p = job
        answer = client.chat(t.model, [{"role": "user", "content": p.question}], **{"temperature": 0, **t.body})
        out = Outcome(t.label, p, verify(p, answer.content), answer)
        if on_outcome is not None:
            on_outcome(out)
        return out

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        return list(pool.map(one, jobs))


def summarize(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """``{"requests", "accuracy" (fraction), "mean_reasoning_tokens", "max_reasoning_tokens"}`` of a group."""
    n = len(outcomes)
    toks = [o.answer.reasoning_tokens for o in outcomes]
    return {
        "requests": n,
        "accuracy": sum(o.correct for o in outcomes) / n if n else 0.0,
        "mean_reasoning_tokens": sum(toks) / n if n else 0.0,
        "max_reasoning_tokens": max(toks, default=0),
    }


def by_difficulty(outcomes: Sequence[Outcome],
                  extra: Callable[[Sequence[Outcome]], dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Per target: :func:`summarize` (plus ``extra(group)`` when given) and ``by_difficulty`` {level (str): …}."""
    groups: dict[str, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        groups[o.target].append(o)

    def entry(rows: Sequence[Outcome]) -> dict[str, Any]:
        return summarize(rows) | (extra(rows) if extra is not None else {})

    out: dict[str, dict[str, Any]] = {}
    for name, rows in groups.items():
        levels: dict[int, list[Outcome]] = defaultdict(list)
        for o in rows:
            levels[o.problem.difficulty].append(o)
        out[name] = entry(rows) | {"by_difficulty": {str(k): entry(v) for k, v in sorted(levels.items())}}
    return out
