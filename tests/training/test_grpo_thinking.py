"""Who opens the thought (read from real chat-template strings through transformers' own ``apply_chat_template``)
and the rule that a rollout cut by the length cap earns no correctness anywhere — inside the thought or after
``</think>``. The templates are written here (no download): Qwen3's (the model writes ``<think>``; an empty
thought is closed when ``enable_thinking=False``), DeepSeek-R1's first one (the model writes ``<think>``; earlier
thoughts are cut out of the history), DeepSeek-R1's updated one and the shipped tiny model's (the generation
prompt opens ``<think>``), and a plain ChatML one (no thoughts)."""

# ruff: noqa: E501  (QWEN3_TEMPLATE is Qwen3's template line for line: its long lines are kept as they are)

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from training.grpo.config import DEFAULT_MODEL_DIR, RewardSpec
from training.grpo.reward_utils import (
    LengthCap,
    policy_thinks,
    template_opens_thought,
    thought_opener,
)
from training.grpo.rewards import RewardContext, build_rewards

# Qwen3's chat template (Qwen/Qwen3-8B tokenizer_config.json, tool parts kept), as Jinja source.
QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# DeepSeek-R1's first template (tool parts dropped): the model writes <think>; earlier thoughts are cut out.
R1_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(system_prompt='') %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{% set ns.system_prompt = message['content'] %}{%- endif %}{%- endfor %}{{ns.system_prompt}}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{'<\uff5cUser\uff5c>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is not none %}"
    "{% set content = message['content'] %}"
    "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{'<\uff5cAssistant\uff5c>' + content + '<\uff5cend\u2581of\u2581sentence\uff5c>'}}{%- endif %}"
    "{%- endfor -%}"
    "{% if add_generation_prompt %}{{'<\uff5cAssistant\uff5c>'}}{% endif %}"
)
# Its update (2025-02): the generation prompt opens the thought.
R1_UPDATED_TEMPLATE = R1_TEMPLATE.replace(
    "{% if add_generation_prompt %}{{'<\uff5cAssistant\uff5c>'}}{% endif %}",
    "{% if add_generation_prompt %}{{'<\uff5cAssistant\uff5c><think>\\n'}}{% endif %}",
)
# Plain ChatML (Qwen2.5-style, no thoughts).
CHATML_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

EOS = "<|im_end|>"


@pytest.fixture(scope="module")
def base_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


@pytest.fixture()
def tokenizer(base_tokenizer: Any) -> Iterator[Any]:
    shipped = base_tokenizer.chat_template
    yield base_tokenizer
    base_tokenizer.chat_template = shipped


def with_template(tok: Any, template: str | None) -> Any:
    tok.chat_template = template
    return tok


def test_qwen3_template_renders_as_qwen3_does(tokenizer: Any) -> None:
    """The fixture is the real template: transformers renders Qwen3's prompts, thoughts and thinking switch."""
    tok = with_template(tokenizer, QWEN3_TEMPLATE)
    msgs = [{"role": "user", "content": "2+3?"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n")
    off = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    hist = [*msgs, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n5"}, {"role": "user", "content": "+1?"}]
    assert "add" not in tok.apply_chat_template(hist, tokenize=False)  # earlier thoughts are cut out


@pytest.mark.parametrize(("template", "opener"), [
    (QWEN3_TEMPLATE, "model"),
    (R1_TEMPLATE, "model"),
    (R1_UPDATED_TEMPLATE, "template"),
    (None, "template"),  # the shipped tiny model's own template
    (CHATML_TEMPLATE, None),
])
def test_who_opens_the_thought_is_read_from_the_template(tokenizer: Any, template: str | None, opener: str | None
                                                         ) -> None:
    tok = tokenizer if template is None else with_template(tokenizer, template)
    assert thought_opener(tok) == opener
    assert policy_thinks(tok) is (opener is not None)
    assert template_opens_thought(tok) is (opener == "template")  # the old check: blind to Qwen3 and R1


def test_a_template_that_switches_thinking_off_does_not_think(tokenizer: Any) -> None:
    off = QWEN3_TEMPLATE.replace("{%- if enable_thinking is defined and enable_thinking is false %}",
                                 "{%- if true %}")  # always closes an empty thought
    assert thought_opener(with_template(tokenizer, off)) is None


def test_no_template_is_no_thinking(tokenizer: Any) -> None:
    tok = with_template(tokenizer, None)
    tok.chat_template = None
    assert thought_opener(tok) is None and not policy_thinks(tok)


CORRECTNESS_REWARDS = ["correctness", "l1_max", "kimi_length", "alp_length"]


@pytest.fixture(scope="module")
def row() -> dict[str, Any]:
    """One real arithmetic problem: the task verifier (``router.tasks``) reads a whole text without ``</think>`` as
    the answer, as it must for vLLM's thought-free ``message.content`` — so only the rules here stop a cut-off one."""
    from router import tasks

    p = tasks.load_task("arith", "train", 1, seed=0, difficulties=[2])[0]
    return {"problem_id": p.id, "question": p.question, "answer": p.answer, "difficulty": p.difficulty,
            "source": p.source}


def rewards_of(
    tok: Any, row: dict[str, Any], ids: list[list[int]], cap: int
) -> tuple[list[str], dict[str, list[float]]]:
    """Every correctness-based reward of the registry, built as a GRPO run builds them (``model.thinks`` defaulted
    from ``tok``'s template, the real task verifier), over rollouts ``ids`` sampled under a ``cap``-token limit;
    the completions are their decoded text, as TRL passes them."""
    from training.grpo.reward_utils import task_verifier

    eos_id = tok.convert_tokens_to_ids(EOS)
    ctx = RewardContext(task_verifier(), max_completion_length=cap, num_generations=len(ids),
                        eos_token_ids=frozenset({eos_id}), require_closed_thought=policy_thinks(tok))
    funcs, _ = build_rewards([RewardSpec(name=name) for name in CORRECTNESS_REWARDS], ctx)
    texts = [tok.decode(x, skip_special_tokens=True) for x in ids]
    cols: dict[str, Any] = {k: [v] * len(ids) for k, v in row.items()}
    cols["budget_tokens"] = [cap] * len(ids)
    return texts, {f.__name__: f(prompts=["p"] * len(ids), completions=texts, completion_ids=ids, **cols)
                   for f in funcs}


def test_qwen3_cut_off_thought_earns_no_correctness(tokenizer: Any, row: dict[str, Any]) -> None:
    """The model opened its thought itself and was cut inside it: with Qwen3's template ``model.thinks`` now
    defaults on, so the right answer inside the unfinished thought earns nothing (before, the template check said
    "no thinking" and the verifier read the thought as the answer: 1.0)."""
    tok = with_template(tokenizer, QWEN3_TEMPLATE)
    eos = tok.convert_tokens_to_ids(EOS)
    a = row["answer"]
    cut = tok.encode(f"<think>\nadding them one by one, so far The answer is {a}.", add_special_tokens=False)
    unclosed = [*tok.encode(f"<think>\nThe answer is {a}.", add_special_tokens=False), eos]  # EOS inside the thought
    done = [*tok.encode(f"<think>\nchecked\n</think>\n\nThe answer is {a}.", add_special_tokens=False), eos]
    cap = len(cut)
    assert len(done) <= cap and len(unclosed) < cap
    texts, r = rewards_of(tok, row, [cut, unclosed, done], cap)
    assert texts[0].startswith("<think>") and "</think>" not in texts[0] + texts[1]
    assert r["correctness"] == [0.0, 0.0, 1.0]
    assert r["l1_max"][:2] == [0.0, 0.0] and r["l1_max"][2] > 0


def test_a_rollout_cut_after_its_thought_earns_no_correctness(tokenizer: Any, row: dict[str, Any]) -> None:
    """``finish_reason: length`` after ``</think>``: the answer is unfinished (the model would have gone on)
    whatever it says so far — zero in every correctness-based reward; the same answer ended by EOS is right."""
    from training.grpo.length_penalties import alp_penalties, kimi_length_rewards

    tok = with_template(tokenizer, QWEN3_TEMPLATE)
    eos = tok.convert_tokens_to_ids(EOS)
    a = row["answer"]
    cut = tok.encode(f"<think>\nchecked it twice over\n</think>\n\nThe answer is {a}.", add_special_tokens=False)
    done = [*tok.encode(f"<think>\nchecked\n</think>\n\nThe answer is {a}.", add_special_tokens=False), eos]
    cap = len(cut)  # the cut one fills the cap without EOS
    assert len(done) < cap
    texts, r = rewards_of(tok, row, [cut, done], cap)
    assert "</think>" in texts[0] and texts[0].endswith(f"The answer is {a}.")  # closed thought, right answer
    assert r["correctness"] == [0.0, 1.0]
    assert r["l1_max"][0] == 0.0 and r["l1_max"][1] > 0
    lengths, ok = [len(cut), len(done)], [False, True]
    assert r["kimi_length"] == pytest.approx(kimi_length_rewards(lengths, ok))
    assert r["alp_length"] == pytest.approx(alp_penalties(lengths, ok, 0.5, cap))  # solve rate 1/2, not 1
    assert r["alp_length"] != pytest.approx(alp_penalties(lengths, [True, True], 0.5, cap))


def test_is_correct_refuses_a_cut_rollout_after_the_thought() -> None:
    """The shared decision: ``cut`` makes a closed thought with an answer wrong, whatever the verifier says."""
    from training.grpo.reward_utils import is_correct

    def accept(r: object, t: str) -> bool:
        return True

    text = "<think>\nx\n</think>\n\nThe answer is 5 because"
    assert is_correct(accept, {}, text) and not is_correct(accept, {}, text, cut=True)


def test_length_cap_reads_eos() -> None:
    cap = LengthCap(4, frozenset({9}))
    assert not cap.cut([1, 2, 3])  # stopped before the cap
    assert not cap.cut([1, 2, 3, 9])  # EOS exactly at the cap
    assert cap.cut([1, 2, 3, 4]) and cap.cut([1, 2, 3, 4, 5])
    assert LengthCap(4).cut([1, 2, 3, 4])  # no EOS ids known: reaching the cap is a cut
