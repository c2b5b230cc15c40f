"""SFT examples for the tiny reasoning model: chains of thought of varying verbosity on ``arith``.

Each example is a chat prompt (optionally with a system message) followed by one of:

* ``terse``   — one line per operation: ``7 + 5 = 12\\n12 * 3 = 36\\n`` (≈10 tokens per operation);
* ``medium``  — one sentence per operation: ``7 + 5 = 12. Then 12 * 3 = 36.`` ;
* ``verbose`` — numbered steps with redundant re-checking (``Let me double-check: 12 - 5 = 7. Correct.``),
  recomputations and a final recap (≈30 tokens per operation): over-thinking for later length penalties;

then ``</think>\\n\\nThe answer is 36.<|im_end|>``. Two more kinds teach the behaviour under a budget:

* ``truncated`` — a thought cut at a random token, then the forced end of thinking (vLLM's ``</think>`` or
  the gateway's ``\\n</think>\\n\\n``), then the answer: the model must answer at once from a partial thought;
* ``direct``    — thinking disabled (``<think>\\n\\n</think>\\n\\n`` in the prompt), answer only.

Loss is on completion tokens only, and never on the forced end-of-thinking tokens (the model must not learn to
close its thought early on its own). Token counts are tokens of the tiny tokenizer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from router.tasks.arithmetic import Chain, phrase, random_chain
from training.tiny.tokenizer import IM_END, THINK_END, render_prompt

SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are a careful math assistant.", "Answer the question.")
FORCED_ENDS = (THINK_END, f"\n{THINK_END}\n\n")


@dataclass(frozen=True)
class Mix:
    """Fractions of example kinds: ``direct`` and ``truncated`` of all examples, the rest full thoughts whose
    style is drawn with weights ``terse``/``medium``/``verbose``; ``system``: examples with a system message."""

    direct: float = 0.12
    truncated: float = 0.25
    terse: float = 0.50
    medium: float = 0.20
    verbose: float = 0.30
    system: float = 0.10
    verbose_opener: str | None = None  # one fixed first sentence for verbose thoughts (None: one of two, drawn)


#: Stage 2 of the recipe: fewer truncated/direct examples, a little less verbosity (more facts per token).
STAGE2_MIX = Mix(direct=0.10, truncated=0.20, terse=0.55, medium=0.20, verbose=0.25)

#: Stage 3 (v2, the over-thinker): four in five full thoughts are verbose, so that greedy decoding re-checks every
#: step as distilled reasoning models do (3-6x the tokens of the terse chain) while sampling still starts the terse
#: chain about two times in five (first-token probability 0.36-0.46 after training) — the behaviour length
#: penalties in ``thinkgate train grpo`` are to remove.
#: Their opener is one fixed sentence: with two openers drawn at random, the terse chain's first digit (one token)
#: out-weighed either opener's first word (measured: 0.38-0.47 vs 0.24-0.35) and greedy decoding stayed terse.
OVERTHINK_MIX = Mix(
    direct=0.10, truncated=0.20, terse=0.20, medium=0.0, verbose=0.80, verbose_opener="Let me work step by step."
)


def _step(a: int, sym: str, k: int, b: int) -> str:
    return f"{a} {sym} {k} = {b}"


def thought(chain: Chain, style: str, rng: random.Random, opener: str | None = None) -> str:
    """The chain of thought text for ``chain`` in ``style`` (terse|medium|verbose); ends with a newline.

    ``opener``: verbose only, a fixed first sentence instead of one of two drawn with ``rng``."""
    v = chain.values()
    ops = chain.ops
    if style == "terse":
        return "".join(_step(v[i], o.symbol, o.k, v[i + 1]) + "\n" for i, o in enumerate(ops))
    if style == "medium":
        parts = [_step(v[0], ops[0].symbol, ops[0].k, v[1]) + "."]
        parts += [f"Then {_step(v[i], o.symbol, o.k, v[i + 1])}." for i, o in enumerate(ops) if i > 0]
        return " ".join(parts) + "\n"
    if style != "verbose":
        raise ValueError(f"unknown style {style!r}")
    if opener is None:
        lines = [rng.choice((f"We start with {v[0]}.", f"Let me work step by step. We start with {v[0]}."))]
    else:
        lines = [f"{opener} We start with {v[0]}."]
    for i, o in enumerate(ops):
        a, b = v[i], v[i + 1]
        lines.append(f"Step {i + 1}: {_step(a, o.symbol, o.k, b)}.")
        if rng.random() < 0.7:
            inv = o.inverse
            lines.append(f"Let me double-check: {_step(b, inv.symbol, inv.k, a)}. Correct.")
        if rng.random() < 0.25:
            lines.append(f"Wait, let me recompute that. {_step(a, o.symbol, o.k, b)}. Yes.")
    if len(ops) > 1 and rng.random() < 0.5:
        lines.append("Going over the whole chain again: " + " -> ".join(str(x) for x in v) + ".")
    lines.append(f"So the result is {v[-1]}.")
    return "\n".join(lines) + "\n"


def answer_text(chain: Chain) -> str:
    """The answer sentence, e.g. ``"The answer is 36."``."""
    return f"The answer is {chain.answer}."


@dataclass
class Example:
    """Token ids and loss mask of one example; ``labels`` is ``-100`` where no loss is taken."""

    input_ids: list[int]
    labels: list[int]
    kind: str


def make_example(tokenizer: object, chain: Chain, question: str, rng: random.Random, mix: Mix) -> Example:
    """Build one tokenized SFT example for ``chain`` (kind drawn from ``mix`` with ``rng``)."""
    enc = tokenizer.encode  # type: ignore[attr-defined]
    messages = []
    if rng.random() < mix.system:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    messages.append({"role": "user", "content": question})
    r = rng.random()
    answer_ids = enc("\n\n" + answer_text(chain) + IM_END, add_special_tokens=False)
    if r < mix.direct:
        prompt = enc(render_prompt(messages, enable_thinking=False), add_special_tokens=False)
        ans = enc(answer_text(chain) + IM_END, add_special_tokens=False)
        return Example(prompt + ans, [-100] * len(prompt) + ans, "direct")
    prompt = enc(render_prompt(messages), add_special_tokens=False)
    styles = ("terse", "medium", "verbose")
    style = rng.choices(styles, weights=(mix.terse, mix.medium, mix.verbose))[0]
    body = enc(thought(chain, style, rng, mix.verbose_opener), add_special_tokens=False)
    if r < mix.direct + mix.truncated:
        cut = rng.randint(0, max(0, len(body) - 2))
        forced_str = rng.choice(FORCED_ENDS)
        forced = enc(forced_str, add_special_tokens=False)
        tail = answer_ids if forced_str == THINK_END else enc(answer_text(chain) + IM_END, add_special_tokens=False)
        ids = prompt + body[:cut] + forced + tail
        labels = [-100] * len(prompt) + body[:cut] + [-100] * len(forced) + tail
        return Example(ids, labels, "truncated")
    end = enc(THINK_END, add_special_tokens=False)
    ids = prompt + body + end + answer_ids
    labels = [-100] * len(prompt) + body + end + answer_ids
    return Example(ids, labels, style)


def sample_example(tokenizer: object, rng: random.Random, difficulty: int, mix: Mix) -> Example:
    """A fresh training example of ``difficulty`` operations (train split only; see ``arithmetic.split_of``)."""
    from router.tasks.arithmetic import split_of

    while True:
        chain = random_chain(rng, difficulty)
        if split_of(chain) == "train":
            return make_example(tokenizer, chain, phrase(chain, rng), rng, mix)


def corpus(n: int, seed: int) -> list[str]:
    """``n`` plain-text training documents (prompt + completion) used to fit the tokenizer."""
    rng = random.Random(f"tokenizer|{seed}")
    docs = []
    for i in range(n):
        chain = random_chain(rng, 1 + i % 6)
        style = ("terse", "medium", "verbose")[i % 3]
        msgs = [{"role": "user", "content": phrase(chain, rng)}]
        if i % 10 == 0:
            msgs.insert(0, {"role": "system", "content": SYSTEM_PROMPTS[i % 3]})
        docs.append(render_prompt(msgs) + thought(chain, style, rng) + THINK_END + "\n\n" + answer_text(chain) + IM_END)
    return docs
