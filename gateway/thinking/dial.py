"""``budget_mode: prompted``: tell a dial model its thinking budget in the prompt; forcing is the hard stop.

A dial model (``models/thinkgate-tiny-dial``, trained by ``thinkgate train dial-sft`` / ``train grpo
--config training/configs/dial.yaml``) reads "Think for N tokens." at the end of the user's question and fills
about N thinking tokens. On a ``prompted`` tier the gateway:

- takes the **requested budget** N (tokens): the request's own ``thinking_token_budget`` when it is below the
  tier's ``thinking_budget``, else the tier's (``reasoning_effort`` picks the tier, so it picks the tier's budget);
  None (unlimited tier, no request budget) sends no instruction and the model thinks as long as it likes; a
  tier with ``thinking_budget_range`` (the dial model's ``budget_range``, the budgets it was trained to follow)
  clamps N into it — a model whose counter reads three digits cannot follow "Think for 100000 tokens.";
- appends ``tier.budget_prompt.format(budget=N)`` to the **last user message** (chat; a string content gets
  ``" " + instruction``, a list of parts one more text part) — nothing else in the body changes, and the
  request's ``thinking_token_budget`` is not sent on (the model's own count is the budget; vLLM's native cut
  would stop it one token short);
- N = 0 turns thinking off (``chat_template_kwargs.enable_thinking: false``), as the dial model's direct mode;
- stops a model that overruns its requested budget at :func:`hard_stop` (N) tokens, where it answers:
  ``hard_stop: forced`` (the default, any OpenAI-compatible upstream) serves the tier by two-phase budget
  forcing (:mod:`gateway.thinking.forcing`) with that forcing budget — phase 2 sends the prompt again, so a
  budgeted call bills its prompt twice; ``hard_stop: native`` sends it as the request's ``thinking_token_budget``
  (vLLM's own cut: one pass, the prompt billed once). An unlimited call (N None) takes one pass either way.

The completions endpoint carries a rendered prompt the gateway cannot edit safely: it gets the hard stop only.
"""

from __future__ import annotations

from typing import Any

from gateway.config import TierConfig, prompted_hard_stop
from gateway.ledger.event import WireEndpoint

hard_stop = prompted_hard_stop


def requested_budget(body: dict[str, Any], tier: TierConfig) -> int | None:
    """The budget (tokens) a ``prompted`` tier asks the model for (and the one a ``native`` tier sends, a
    ``forced`` tier cuts at, ``x-thinkgate-thinking-budget`` reports): the request's smaller non-negative
    ``thinking_token_budget``, else ``tier.thinking_budget`` (None = unlimited) — clamped into the tier's
    ``thinking_budget_range`` when it declares one (:meth:`~gateway.config.TierConfig.applied_budget`)."""
    asked = body.get("thinking_token_budget")
    if isinstance(asked, int) and not isinstance(asked, bool) and asked >= 0:
        cap = tier.thinking_budget
        if cap is None or asked < cap:
            return tier.applied_budget(asked)
    return tier.applied_budget(tier.thinking_budget)


def instruction(tier: TierConfig, budget: int) -> str:
    """The dial prompt text for ``budget`` tokens (``tier.budget_prompt`` filled in)."""
    return tier.budget_prompt.format(budget=budget)


def _append_to_last_user(messages: list[Any], text: str) -> list[Any]:
    out = list(messages)
    for i in range(len(out) - 1, -1, -1):
        m = out[i]
        if not isinstance(m, dict) or m.get("role") != "user":
            continue
        content = m.get("content")
        if isinstance(content, str):
            out[i] = {**m, "content": f"{content} {text}" if content else text}
        elif isinstance(content, list):
            out[i] = {**m, "content": [*content, {"type": "text", "text": f" {text}"}]}
        else:
            continue
        return out
    return out


def apply_prompted(body: dict[str, Any], tier: TierConfig, endpoint: WireEndpoint) -> None:
    """Put the requested budget of ``tier`` into ``body`` (in place) as the module doc says."""
    budget = requested_budget(body, tier)
    body.pop("thinking_token_budget", None)
    if budget is not None and budget > 0 and tier.hard_stop == "native":
        body["thinking_token_budget"] = hard_stop(budget)
    if endpoint != "chat" or budget is None:
        return
    if budget == 0:
        kwargs = body.get("chat_template_kwargs")
        body["chat_template_kwargs"] = {**(kwargs if isinstance(kwargs, dict) else {}), "enable_thinking": False}
        return
    messages = body.get("messages")
    if isinstance(messages, list):
        body["messages"] = _append_to_last_user(messages, instruction(tier, budget))


def thinking_off(body: dict[str, Any]) -> bool:
    """Whether a chat body asks for no thinking: ``thinking_token_budget: 0`` (or a key's cap of 0), or
    ``chat_template_kwargs.enable_thinking: false`` (the client's, or an Anthropic request's ``thinking: disabled``)."""
    kwargs = body.get("chat_template_kwargs")
    off = isinstance(kwargs, dict) and kwargs.get("enable_thinking") is False
    return body.get("thinking_token_budget") == 0 or off


def sends_budget(tier: TierConfig) -> bool:
    """Whether ``tier`` applies a thinking budget at all: False when its model does not think
    (``enable_thinking: false``) or its ``budget_mode`` is ``off`` — then no budget, the client's included, is sent
    upstream, forced or stated, and none is reported (``x-thinkgate-thinking-budget``)."""
    return tier.enable_thinking and tier.budget_mode != "off"


def forcing_tier(tier: TierConfig, client_body: dict[str, Any]) -> TierConfig | None:
    """The tier that two-phase budget forcing runs with, None when the call takes one pass: a ``forced`` tier as
    it is; a ``prompted`` one with ``hard_stop: forced`` and a requested budget gets :func:`hard_stop` of that
    budget as its ``thinking_budget``; an unlimited ``prompted`` call, a ``hard_stop: native`` one and any other
    budget mode take one pass. ``client_body``: the request as the client sent it (its ``thinking_token_budget``
    is still there)."""
    if not sends_budget(tier):
        return None  # nothing to cut: the model does not think
    if tier.budget_mode == "forced":
        # a chat request that asks for no thinking (or whose key's cap is 0) is one pass with thinking off
        # (gateway/pipeline/upstream_body.py), where phase 1 would still think a token and phase 2 bill the prompt
        return None if "messages" in client_body and thinking_off(client_body) else tier
    if tier.budget_mode != "prompted" or tier.hard_stop == "native":
        return None
    budget = requested_budget(client_body, tier)
    if budget is None:
        return None  # nothing to stop: phase 2 would only send the prompt again
    # the hard stop lies above the requested budget on purpose: it is not a budget for the model to follow
    return tier.model_copy(update={"thinking_budget": hard_stop(budget), "thinking_budget_range": None})
