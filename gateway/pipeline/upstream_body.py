"""Turn a client body into the body sent to one tier's upstream.

``build(body, tier, endpoint)`` returns a new dict (the client's body is never mutated, so a fallback tier
can be built from the same input) with:

- ``model`` = ``tier.model``;
- the tier's ``sampling`` defaults under the client's own fields (the client wins);
- ``max_tokens`` = min(client's ``max_completion_tokens``/``max_tokens``, ``tier.max_tokens``) — sent as
  ``max_tokens``, the field every OpenAI-compatible server accepts, with ``max_completion_tokens`` dropped;
- ``stream_options.include_usage = true`` on streams (the gateway always meters; the proxy strips the usage
  chunk again when the client did not ask for it);
- the tier's thinking budget (:func:`apply_budget`; ``forced`` and ``prompted`` tiers are served by
  ``gateway/thinking/forcing.py``, a ``prompted`` one with its budget in the prompt: ``gateway/thinking/dial.py``);
- on a tier that does not think (``enable_thinking: false``), no client ``reasoning_effort`` other than ``none``
  (the tier's own ``sampling.reasoning_effort``, if the operator set one, is kept).

Every other field — vLLM extras such as ``chat_template_kwargs``, ``top_k``, ``repetition_penalty`` — is
passed through unchanged.
"""

from __future__ import annotations

from typing import Any

from gateway.config import TierConfig
from gateway.ledger.event import WireEndpoint
from gateway.thinking import dial


def apply_budget(body: dict[str, Any], tier: TierConfig, endpoint: WireEndpoint) -> None:
    """Apply ``tier``'s thinking budget to ``body`` in place (native form only, for now).

    - ``budget_mode == "native"`` with a budget: vLLM's per-request ``thinking_token_budget`` (tokens); a
      smaller non-negative budget sent by the client is kept (on an unlimited tier the client's, as sent); either
      clamped into the tier's ``thinking_budget_range`` when it declares one.
    - ``enable_thinking: false`` (chat only): ``chat_template_kwargs.enable_thinking = false``, merged into
      the client's ``chat_template_kwargs``.
    - ``forced`` mode is enforced by two-phase budget forcing in ``gateway/thinking/forcing.py``, not here; the
      body carries the budget its thought phase is cut at (the one ``native`` would send), never sent upstream.
    - ``prompted`` mode: the budget goes into the prompt for a dial model (``gateway/thinking/dial.py``).
    - a tier that does not think (``enable_thinking: false``) or sends no budget (``budget_mode: off``) sends none
      of the client's either (``thinking_token_budget`` removed; Anthropic's ``thinking`` is translated into it).
    """
    if not dial.sends_budget(tier):
        # vLLM would get a budget beside enable_thinking: false (a no_think tier), or an upstream without thinking a
        # field it may refuse; x-thinkgate-thinking-budget says no budget was served, and it is true
        body.pop("thinking_token_budget", None)
        if not tier.enable_thinking and endpoint == "chat":
            kwargs = body.get("chat_template_kwargs")
            body["chat_template_kwargs"] = {**(kwargs if isinstance(kwargs, dict) else {}), "enable_thinking": False}
        return
    if tier.budget_mode == "prompted":
        dial.apply_prompted(body, tier, endpoint)
    if tier.budget_mode == "native":
        budget = dial.requested_budget(body, tier)  # the client's smaller one, else the tier's; in its range
        if budget is not None:
            body["thinking_token_budget"] = budget
    if tier.budget_mode == "forced" and endpoint == "chat" and dial.thinking_off(body):
        body.pop("thinking_token_budget", None)  # no thinking asked: one pass with thinking off (dial.forcing_tier)
        kwargs = body.get("chat_template_kwargs")
        body["chat_template_kwargs"] = {**(kwargs if isinstance(kwargs, dict) else {}), "enable_thinking": False}
    elif tier.budget_mode == "forced":
        # the thought phase's cut, as applied: it is what forcing reads (and never sends on), and the cache key is
        # this body — a request for 448 and one for 100000, both cut at 320, are the same request, and one cut
        # elsewhere is not
        budget = dial.requested_budget(body, tier)
        if budget is not None:
            body["thinking_token_budget"] = budget


def build(body: dict[str, Any], tier: TierConfig, endpoint: WireEndpoint) -> dict[str, Any]:
    """The upstream body for ``tier`` (``endpoint``: ``chat`` or ``completions``); see the module doc."""
    out = {**tier.sampling, **body} if tier.sampling else dict(body)
    out["model"] = tier.model
    if not tier.enable_thinking and body.get("reasoning_effort", "none") != "none":
        # the model is told not to think (chat_template_kwargs.enable_thinking: false): an effort beside it is a
        # contradiction an upstream may refuse or act on (a template that reads the effort and not the switch
        # thinks at it); the budget is dropped for the same reason (apply_budget). "none" says what the tier does.
        if "reasoning_effort" in tier.sampling:
            out["reasoning_effort"] = tier.sampling["reasoning_effort"]
        else:
            del out["reasoning_effort"]
    asked = out.pop("max_completion_tokens", None) or out.get("max_tokens")
    out["max_tokens"] = min(asked, tier.max_tokens) if isinstance(asked, int) else tier.max_tokens
    if out.get("stream") is True:
        opts = dict(out.get("stream_options") or {})
        if not opts.get("include_usage"):
            # vLLM sends per-chunk usage only with include_usage, which the gateway always asks for: a client that
            # did not ask for it must not get it either
            opts.pop("continuous_usage_stats", None)
        out["stream_options"] = {**opts, "include_usage": True}
    apply_budget(out, tier, endpoint)
    return out
