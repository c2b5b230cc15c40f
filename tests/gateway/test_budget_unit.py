"""Budget forcing building blocks: request rewriting, usage merging, loop detection, escalation rules."""

from __future__ import annotations

from gateway.config import LoopGuard, TierConfig
from gateway.openai.usage import merge_usage
from gateway.pipeline.escalation import escalation_reason
from gateway.thinking.forcing import answer_request, thought_request
from gateway.thinking.loop_guard import LoopDetector


def _tier(**kw: object) -> TierConfig:
    return TierConfig(name="t", budget_mode="forced", thinking_budget=32, max_tokens=100, **kw)


def test_thought_request_caps_at_budget_and_stops_at_marker() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "q"}], "max_tokens": 100, "stop": ["X"],
            "thinking_token_budget": 5, "n": 2}
    out = thought_request(body, _tier())
    assert out["max_tokens"] == 5  # the request's (or its key's cap's) smaller budget cuts the thought
    assert thought_request({**body, "thinking_token_budget": 50}, _tier())["max_tokens"] == 32  # never above the tier's
    assert out["stop"] == ["</think>"]
    assert out["n"] == 1
    assert "thinking_token_budget" not in out
    assert body["stop"] == ["X"], "the client's body must not be mutated"


def test_thought_request_never_exceeds_max_tokens() -> None:
    body = {"messages": [], "max_tokens": 10}
    assert thought_request(body, _tier())["max_tokens"] == 10


def test_answer_request_continues_the_assistant_turn() -> None:
    body = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 100, "stop": ["X"]}
    cut = answer_request(body, _tier(), "chat", "3+4=7", closed_naturally=False, used=32)
    assert cut["messages"][-1] == {"role": "assistant", "content": "<think>\n3+4=7\n</think>\n\n"}
    assert cut["continue_final_message"] is True and cut["add_generation_prompt"] is False
    assert cut["chat_template_kwargs"] == {"enable_thinking": False}
    assert cut["max_tokens"] == 68
    assert cut["stop"] == ["X"]
    natural = answer_request(body, _tier(), "chat", "3+4=7\n", closed_naturally=True, used=5)
    assert natural["messages"][-1]["content"] == "<think>\n3+4=7\n</think>\n\n"
    comp = answer_request({"prompt": "P<think>\n", "max_tokens": 50}, _tier(), "completions", "t", False, 10)
    assert comp["prompt"] == "P<think>\nt\n</think>\n\n" and comp["max_tokens"] == 40


def test_merge_usage_sums_phases_and_counts_thought_as_reasoning() -> None:
    u = merge_usage(
        {"prompt_tokens": 10, "completion_tokens": 32, "total_tokens": 42},
        {"prompt_tokens": 45, "completion_tokens": 6, "prompt_tokens_details": {"cached_tokens": 40}},
        32,
    )
    assert u == {
        "prompt_tokens": 55,
        "completion_tokens": 38,
        "total_tokens": 93,
        "completion_tokens_details": {"reasoning_tokens": 32},
        "prompt_tokens_details": {"cached_tokens": 40},
    }


def test_loop_detector_fires_on_repetition_only() -> None:
    d = LoopDetector(LoopGuard(ngram=3, max_repeats=3))
    assert not d.feed("2 + 3 = 5. 5 * 4 = 20. 20 - 1 = 19. ")
    fired = [d.feed(piece) for piece in ["check: 19 ", "is ", "right. check: 19 is right. ", "check: 19 is right. "]]
    assert fired[-1] is True and not any(fired[:-1])


def test_loop_detector_joins_words_split_across_pieces() -> None:
    d = LoopDetector(LoopGuard(ngram=2, max_repeats=2))
    assert not d.feed("abc de")
    assert not d.feed("f abc ")
    assert d.feed("def ")  # "abc def" twice, the first one split as "de" + "f"


def test_escalation_reasons() -> None:
    tier = _tier(escalate_on=["empty_answer", "length_in_thought"])
    cut = {"choices": [{"message": {"content": None, "reasoning": "2+2"}, "finish_reason": "length"}]}
    empty = {"choices": [{"message": {"content": "  ", "reasoning": "x"}, "finish_reason": "stop"}]}
    fine = {"choices": [{"message": {"content": "The answer is 4."}, "finish_reason": "stop"}]}
    assert escalation_reason(tier, cut, "chat") == "length_in_thought"
    assert escalation_reason(tier, empty, "chat") == "empty_answer"
    assert escalation_reason(tier, fine, "chat") is None
    assert escalation_reason(_tier(), cut, "chat") is None, "no escalate_on, no escalation"
    only_length = _tier(escalate_on=["length_in_thought"])
    assert escalation_reason(only_length, empty, "chat") is None
    text_cut = {"choices": [{"text": "<think>\n2+2", "finish_reason": "length"}]}
    text_ok = {"choices": [{"text": "2+2</think>\n\nThe answer is 4.", "finish_reason": "stop"}]}
    assert escalation_reason(tier, text_cut, "completions") == "length_in_thought"
    assert escalation_reason(tier, text_ok, "completions") is None
