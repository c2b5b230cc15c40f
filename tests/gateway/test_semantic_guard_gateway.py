"""Issue 25's wrong answers from the semantic cache, reproduced through a real gateway, the real Redis and the
upstream simulator: each changed question below was served the first question's answer by the guard that
compared sorted numbers and a bag of words (``x-thinkgate-cache: semantic-hit``); now each is a miss answered
by the upstream, and a true rephrasing still hits.

The gateway runs with ``cache.semantic.threshold: 0.7`` rather than the default 0.8: some of the issue's short
questions score 0.74–0.80 with the lexical embedder, so at 0.7 every pair below reaches the guard (each test
checks that it is similar enough and shares an LSH band) and only the guard can stop it. The issue's literal
``Subtract 3 from 10. What is left?`` / ``Subtract 10 from 3. What is left?`` share no LSH band (similarity
0.77), so through the index they were never candidates; the operand-swap row asks them with ``Show your work.``
added (0.86, four bands shared), and ``tests/gateway/test_semantic_cache.py`` checks the literal pair against
the guard itself.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from gateway.semantic.embed import LexicalEmbedder
from tests.fixtures.gateway import SECRETS, accounting_gateway
from tests.fixtures.upstream import GatewayServer, SimProcess

THRESHOLD = 0.7
# (family, stored question, changed question): the changed one must never get the stored one's answer.
CHANGED = [
    ("operand_swap", "Subtract 3 from 10. What is left? Show your work.",
     "Subtract 10 from 3. What is left? Show your work."),
    ("operand_units", "A train travels 120 km in 3 hours at a constant speed. What is its average speed?",
     "A train travels 3 km in 120 hours at a constant speed. What is its average speed?"),
    ("divided_by", "What is 10 divided by 2? Give the answer as a decimal number.",
     "What is 2 divided by 10? Give the answer as a decimal number."),
    ("entity_order", "Is Paris north of Madrid on a map of Europe? Answer yes or no, then explain briefly.",
     "Is Madrid north of Paris on a map of Europe? Answer yes or no, then explain briefly."),
    ("unit_pair", "Convert 5 miles to km and round the result to two decimal places.",
     "Convert 5 km to miles and round the result to two decimal places."),
    ("ordinal", "Who was the first president of the United States of America?",
     "Who was the second president of the United States of America?"),
    # common words that decide the question (a new-user helper's wrong hits; guard v3)
    ("question_word", "In a short paragraph for a school report, explain when Albert Einstein was born.",
     "In a short paragraph for a school report, explain where Albert Einstein was born."),
    ("person", "Translate into Spanish and explain the grammar briefly: he is a doctor at the city hospital.",
     "Translate into Spanish and explain the grammar briefly: she is a doctor at the city hospital."),
    ("grouping", "What is 3 + 4 × 2? Show every step of the calculation and give the final answer.",
     "What is (3 + 4) × 2? Show every step of the calculation and give the final answer."),
    # an adversary's wrong hits (guard v4): symbols dropped as punctuation
    ("symbol", "In Python, what is 5 & 3? Explain the bitwise operation step by step.",
     "In Python, what is 5 | 3? Explain the bitwise operation step by step."),
    ("set_symbol", "Compute {1, 2, 3, 4} ∪ {3, 4, 5, 6} and list the elements in increasing order.",
     "Compute {1, 2, 3, 4} ∩ {3, 4, 5, 6} and list the elements in increasing order."),
    ("emoji", "What does the 👍 emoji usually mean when someone sends it in a work chat?",
     "What does the 👎 emoji usually mean when someone sends it in a work chat?"),
    # the task imperative was a common word
    ("task", "Summarize the following paragraph: The mitochondria is the powerhouse of the cell, producing energy "
     "through respiration.", "Translate the following paragraph: The mitochondria is the powerhouse of the cell, "
     "producing energy through respiration."),
    # the first and second persons were outside the word order
    ("speakers", "If I owe you 10 dollars and you owe me 4 dollars, who pays whom and how much?",
     "If you owe me 10 dollars and I owe you 4 dollars, who pays whom and how much?"),
    # "and"/"or" were common words
    ("conjunction", "A store sells apples and oranges. How many customers bought apples and oranges if 30 bought "
     "apples, 20 bought oranges?", "A store sells apples and oranges. How many customers bought apples or oranges "
     "if 30 bought apples, 20 bought oranges?"),
    ("unless", "You will pass the exam if you study every day for 3 weeks before the test. True or false?",
     "You will pass the exam unless you study every day for 3 weeks before the test. True or false?"),
    ("amount", "In the survey of 200 voters in the town, did many people support the new park proposal or not?",
     "In the survey of 200 voters in the town, did few people support the new park proposal or not?"),
]


@pytest.fixture(scope="module")
def gw(upstream_sim: SimProcess, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path_factory.mktemp("semguard"),
                            cache={"semantic": {"enabled": True, "threshold": THRESHOLD}}) as g:
        yield g


def _ask(gw: GatewayServer, question: str, tag: str) -> Any:
    c = openai.OpenAI(base_url=gw.base_url, api_key=SECRETS["alice"], max_retries=0, timeout=30)
    return c.chat.completions.with_raw_response.create(
        model="short", messages=[{"role": "user", "content": question}], temperature=0,
        extra_body={"sim": {"tag": tag}})


def _attempts(sim: SimProcess, tag: str) -> int:
    """How often the upstream simulator was really called with ``tag``."""
    state = sim.tag(tag)
    assert state is not None
    return int(state["attempts"])


@pytest.mark.parametrize(("family", "stored", "changed"), CHANGED, ids=[c[0] for c in CHANGED])
def test_changed_question_is_not_served_the_stored_answer(gw: GatewayServer, upstream_sim: SimProcess, family: str,
                                                          stored: str, changed: str) -> None:
    emb = LexicalEmbedder()
    a, b = emb.sketch_now(stored), emb.sketch_now(changed)
    # the precondition: similar enough, and an LSH band in common, so the pair reaches the guard
    assert a.similarity(b.kind, b.payload) >= THRESHOLD
    assert any(x == y for x, y in zip(a.bands, b.bands, strict=True))
    tag = uuid.uuid4().hex
    first = _ask(gw, stored, tag)
    assert first.headers["x-thinkgate-cache"] == "miss"
    second = _ask(gw, changed, tag)
    assert second.headers["x-thinkgate-cache"] == "miss", family
    assert second.parse().choices[0].message.content == f"echo: {changed}"
    assert _attempts(upstream_sim, tag) == 2  # the changed question reached the upstream
    # ...and the stored question is still served to its own rephrasing
    again = _ask(gw, stored.lower(), tag)
    assert again.headers["x-thinkgate-cache"] == "semantic-hit"
    assert again.parse().choices[0].message.content == f"echo: {stored}"


def test_readme_rephrasing_still_hits(gw: GatewayServer, upstream_sim: SimProcess) -> None:
    tag = uuid.uuid4().hex
    assert _ask(gw, "What is 17 * 23?", tag).headers["x-thinkgate-cache"] == "miss"
    r = _ask(gw, "what is 17×23 ?", tag)
    assert r.headers["x-thinkgate-cache"] == "semantic-hit"
    assert r.parse().choices[0].message.content == "echo: What is 17 * 23?"
    assert _attempts(upstream_sim, tag) == 1


# --- what is not the question: the context and the tenant (an adversary's checks; each held) -----------------

CONTEXT_Q = ("Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for "
             "her friends every day with four. How many eggs are left each day?")
TOOL = {"type": "function", "function": {"name": "calc", "description": "evaluate arithmetic",
                                         "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}


def _chat(gw: GatewayServer, messages: list[dict[str, Any]], tag: str, who: str = "alice", **extra: Any) -> Any:
    c = openai.OpenAI(base_url=gw.base_url, api_key=SECRETS[who], max_retries=0, timeout=30)
    body: dict[str, Any] = {"temperature": 0, **extra}
    extra_body = {"sim": {"tag": tag}, **body.pop("extra_body", {})}
    return c.chat.completions.with_raw_response.create(model="short", messages=messages,  # type: ignore[arg-type]
                                                       extra_body=extra_body, **body)


@pytest.mark.parametrize(("what", "messages", "extra"), [
    ("system prompt", [{"role": "system", "content": "Answer in French."}], {}),
    ("earlier turn", [{"role": "user", "content": "Count the eggs of Maria's hens instead."},
                      {"role": "assistant", "content": "Sure."}], {}),
    ("tools", [], {"tools": [TOOL]}),
    ("response_format", [], {"response_format": {"type": "json_object"}}),
    ("sampling", [], {"temperature": 0.9, "seed": 7}),
    ("top_p", [], {"top_p": 0.5}),
    ("n", [], {"n": 2}),
    ("thinking budget", [], {"extra_body": {"thinking_token_budget": 4}}),  # below the tier's own 8
    ("other key", [], {"who": "bob"}),
])
def test_a_rephrasing_in_another_context_or_tenant_is_not_served(gw: GatewayServer, upstream_sim: SimProcess,
                                                                  what: str, messages: list[dict[str, Any]],
                                                                  extra: dict[str, Any]) -> None:
    """The same question, rephrased (similarity ≥ the threshold, the guard passes it), asked with another system
    prompt, earlier turn, tools, response format, sampling, ``n``, thinking budget or API key: never served the
    stored answer (the index is partitioned by tenant and context), while the plain rephrasing is."""
    tag = uuid.uuid4().hex
    assert _chat(gw, [{"role": "user", "content": CONTEXT_Q}], tag).headers["x-thinkgate-cache"] == "miss"
    para = [{"role": "user", "content": CONTEXT_Q.lower()}]
    r = _chat(gw, [*messages, *para], tag, **extra)
    assert r.headers["x-thinkgate-cache"] == "miss", what
    assert _attempts(upstream_sim, tag) == 2
    assert _chat(gw, para, tag).headers["x-thinkgate-cache"] == "semantic-hit"


def test_keys_share_semantic_entries_only_through_a_configured_namespace(upstream_sim: SimProcess, redis_url: str,
                                                                         tmp_path: Any) -> None:
    """alice and bob sharing a ``cache_namespace`` share entries (configured on purpose); a third key outside
    it does not."""
    from tests.fixtures.gateway import keys_config
    auth = keys_config(alice={"cache_namespace": "team"}, bob={"cache_namespace": "team"})
    carol = "tg-carol-secret-00000000000"
    auth["keys"].append({"id": "carol", "secret": carol, "tags": {"team": "c"}})
    with accounting_gateway(upstream_sim.base_url, redis_url, tmp_path, auth=auth,
                            cache={"semantic": {"enabled": True, "threshold": THRESHOLD}}) as g:
        tag = uuid.uuid4().hex
        assert _chat(g, [{"role": "user", "content": CONTEXT_Q}], tag).headers["x-thinkgate-cache"] == "miss"
        para = [{"role": "user", "content": CONTEXT_Q.lower()}]
        assert _chat(g, para, tag, who="bob").headers["x-thinkgate-cache"] == "semantic-hit"
        c = openai.OpenAI(base_url=g.base_url, api_key=carol, max_retries=0, timeout=30)
        r = c.chat.completions.with_raw_response.create(model="short", messages=para,  # type: ignore[arg-type]
                                                        temperature=0, extra_body={"sim": {"tag": tag}})
        assert r.headers["x-thinkgate-cache"] == "miss"
        assert _attempts(upstream_sim, tag) == 2


def test_a_stored_conversation_is_part_of_the_context(gw: GatewayServer) -> None:
    """``/v1/responses`` with ``previous_response_id``: the same last question after another stored earlier turn
    is not served the first conversation's answer; after the same earlier turn its rephrasing is."""
    c = openai.OpenAI(base_url=gw.base_url, api_key=SECRETS["alice"], max_retries=0, timeout=30)
    salt = uuid.uuid4().hex[:8]
    q = f"Given what I told you before, how many eggs are left each day for the farmers market stall {salt}?"
    heads = [c.responses.create(model="short", input=f"My ducks lay {n} eggs a day and I eat three.", temperature=0,
                                store=True) for n in (16, 19)]
    first = c.responses.with_raw_response.create(model="short", input=q, temperature=0,
                                                 previous_response_id=heads[0].id)
    assert first.headers["x-thinkgate-cache"] == "miss"
    other = c.responses.with_raw_response.create(model="short", input=q.lower(), temperature=0,
                                                 previous_response_id=heads[1].id)
    assert other.headers["x-thinkgate-cache"] == "miss"
    same = c.responses.with_raw_response.create(model="short", input=q.lower(), temperature=0,
                                                previous_response_id=heads[0].id)
    assert same.headers["x-thinkgate-cache"] == "semantic-hit"
