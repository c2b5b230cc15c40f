"""The cascade's answer checks (pure): abstention phrases on the final-answer part, logprob confidence."""

from __future__ import annotations

import pytest

from gateway.config import TierConfig
from gateway.pipeline.abstention import abstains, cascade_reason, final_part, mean_logprob


@pytest.mark.parametrize("text", [
    "I don't know", "Answer: I don’t know.", "answer:\nI DON'T KNOW<|im_end|>", "", "<|im_end|>",
    "Let me think about the 1930 tournament. Answer: I don't have enough information to answer this question.",
    "I don't have enough info to answer confidently. May I look this up on the web?",
])
def test_abstentions(text: str) -> None:
    assert abstains(text)


@pytest.mark.parametrize("text", [
    "Answer: Paris", "Answer: The Unknown Soldier", "I don't know who said it first, but Answer: Uruguay",
    "Answer: Uruguay<|im_end|>",
])
def test_answers(text: str) -> None:
    assert not abstains(text), "only the final-answer part counts; an answer after a hedge is an answer"


def test_final_part_and_custom_phrases() -> None:
    assert final_part("Thinking... Answer:  Jane\n Ballou<|im_end|>") == "jane ballou"
    assert final_part("x" * 400 + " I don't know")[-12:] == "i don't know"
    assert abstains("Answer: no idea", ["no idea"]) and not abstains("Answer: no idea")


def test_cascade_reason_is_per_condition() -> None:
    idk = {"choices": [{"message": {"content": "I don't know"}}]}
    assert cascade_reason(["abstain"], None, None, idk, "chat") == "abstain"
    assert cascade_reason(["empty_answer"], None, None, idk, "chat") is None, "not listed, not escalated"
    assert cascade_reason(["abstain"], None, None, {"choices": [{"text": "hm </think> I don't know"}]},
                          "completions") == "abstain"
    tokens = [{"token": "Par", "logprob": -2.0}, {"token": "is", "logprob": -1.0}]
    unsure = {"choices": [{"message": {"content": "Paris"}, "logprobs": {"content": tokens}}]}
    assert mean_logprob(unsure["choices"][0]) == -1.5
    assert cascade_reason(["low_confidence"], None, -1.0, unsure, "chat") == "low_confidence"
    assert cascade_reason(["low_confidence"], None, -2.0, unsure, "chat") is None
    assert cascade_reason(["low_confidence"], None, -1.0, {"choices": [{"message": {"content": "Paris"}}]},
                          "chat") is None, "no logprobs returned: no confidence check"


def test_low_confidence_needs_a_threshold() -> None:
    with pytest.raises(ValueError, match="min_answer_logprob"):
        TierConfig(name="t", escalate_on=["low_confidence"])
    assert TierConfig(name="t", escalate_on=["abstain", "low_confidence"], min_answer_logprob=-1.2)
