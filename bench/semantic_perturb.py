"""Does the semantic cache ever answer a *changed* question, and how many true rephrasings does it still answer?

Real questions from ``data/`` (GSM8K test + train, MATH-500 + train, MT-Bench first turns, SimpleQA) are
stored, one entry each, in one tenant and context of the real index (``gateway/semantic/cache.py``,
``lexical`` embedder, the configured default threshold) on a private ``redis-server``. Then variants made from
them **by rules** are looked up with the real ``SemanticCache.prepare`` + ``lookup``:

- *changed questions* (each must be a miss), by family: ``operand_swap`` (two different numbers trade places),
  ``entity_swap`` (two different names trade places), ``noun_swap`` (two lower-case content words that occur once
  each and follow each other trade places: ``a cat chases a dog`` → ``a dog chases a cat``), ``relation`` (a
  relation word turned round: from↔to, before↔after, north↔south, above↔below, over↔under, more↔less than…),
  ``relation_swap`` (the two ends of a relation word trade places: ``A from B`` → ``B from A``), ``ordinal``
  (first→second, 3rd→4th, half→twice…), ``unit_swap`` (two units of the question trade places: ``5 miles … km`` →
  ``5 km … miles``), ``unit`` (a unit after a number replaced by another of its kind), ``comparative``
  (largest→smallest…), ``number`` (one number changed), ``negation`` (``not`` added or removed),
  ``deciding_word``, ``grouping``, ``task`` (the first task imperative replaced: write→summarize,
  explain→translate, find→estimate…), ``speaker`` (the first and second persons traded: I/me↔you), ``conjunction``
  (one and↔or), ``conditional`` (one if↔unless), ``amount`` (one many↔few, not ``how many``);
- *true rephrasings* (each should hit its own entry): ``lower``, ``spacing``, ``punct``, ``prefix`` (``Please
  answer this: …``, common words only), ``synonym`` (common words: calculate/compute, find/determine,
  each/every…), ``number_words`` (``16`` → ``sixteen``), ``thousands`` (``12000`` → ``12,000``), ``combo`` (prefix
  + lower + punct), ``clause`` (the last sentence moved to the front — kept meaning, but the guard compares order
  and may refuse it: reported on its own, and outside the headline recall).

A *false hit* is a ``hit`` outcome on a changed question, unless the entry hit is a stored question that reads the
same as the variant (the rules can turn one real question into another of the set). For each family the report also
says how many changed questions a similarity-only cache would have served (similarity to the question they came from
≥ the threshold), and which guard check refused them. Then, optionally, lookup latency at a fill size
(``bench.semantic_cache.latency_part``: one tenant and context filled with every real question in ``data/``
and number-changed copies; sequential prepare + lookup, p50/p99).

    python -m bench.semantic_perturb [--per-source 600] [--sizes 100000] [--queries 300] [--write-results]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import itertools
import random
import re
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from bench._lib.results_md import write_section
from bench.gateway_overhead import machine
from bench.semantic_cache import (
    MAX_CHARS,
    _ms,
    _punct,
    _sentences,
    body_of,
    digest_of,
    fill,
    latency_part,
    real_questions,
)
from gateway.config import RedisConfig, SemanticCacheConfig
from gateway.engine.redis_server import start_private
from gateway.semantic.cache import SemanticCache
from gateway.semantic.embed import LexicalEmbedder
from gateway.semantic.guard import COMMON, TENS, UNITS, features
from gateway.state.breaker import Breaker
from gateway.state.cache_policy import tenant_scope
from gateway.state.keys import RedisKeys
from gateway.state.redis import connect

SECTION = "## Semantic cache: changed questions and rephrasings"
CHANGED = ("operand_swap", "entity_swap", "noun_swap", "relation", "relation_swap", "ordinal", "unit_swap", "unit",
           "comparative", "number", "negation", "deciding_word", "grouping", "task", "speaker", "conjunction",
           "conditional", "amount")
REPHRASED = ("lower", "spacing", "punct", "prefix", "synonym", "number_words", "thousands", "combo")
REPORTED_ONLY = ("clause",)

OPPOSITE = {"from": "to", "to": "from", "before": "after", "after": "before", "north": "south", "south": "north",
            "east": "west", "west": "east", "above": "below", "below": "above", "over": "under", "under": "over",
            "into": "out of", "inside": "outside", "outside": "inside", "more than": "less than",
            "less than": "more than", "greater than": "smaller than", "larger than": "smaller than",
            "smaller than": "larger than", "plus": "minus", "minus": "plus", "increased": "decreased",
            "decreased": "increased", "gains": "loses", "loses": "gains", "earlier": "later", "later": "earlier"}
RELATION_RE = re.compile(r"\b(" + "|".join(sorted(map(re.escape, OPPOSITE), key=len, reverse=True)) + r")\b")
SWAP_RE = re.compile(r"\b(\w+)(\s+(?:from|to|than|of|per|before|after|into|over|under|north of|south of|east of|"
                     r"west of|above|below)\s+)(\w+)\b")
ORDINAL_WORDS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth",
                 "last")
MULTIPLIERS = {"half": "twice", "twice": "half", "double": "half", "triple": "double", "thrice": "twice",
               "quarter": "half"}
ORDINAL_RE = re.compile(r"\b(" + "|".join((*ORDINAL_WORDS, *MULTIPLIERS)) + r")\b", re.I)
DIGIT_ORDINAL_RE = re.compile(r"\b(\d+)(st|nd|rd|th)\b")
UNIT_KINDS = [
    ("seconds", "minutes", "hours", "days", "weeks", "months", "years"),
    ("second", "minute", "hour", "day", "week", "month", "year"),
    ("inches", "feet", "yards", "miles", "meters", "km", "kilometers", "centimeters", "cm"),
    ("grams", "kilograms", "kg", "pounds", "ounces", "tons"),
    ("dollars", "cents", "euros"),
    ("liters", "gallons", "cups", "ounces"),
]
UNIT_OF = {u: kind for kind in UNIT_KINDS for u in kind}
UNIT_RE = re.compile(r"(?<=\d )(" + "|".join(sorted(UNIT_OF, key=len, reverse=True)) + r")\b")
ANY_UNIT_RE = re.compile(r"\b(" + "|".join(sorted(UNIT_OF, key=len, reverse=True)) + r")\b")
COMPARATIVE = {"largest": "smallest", "smallest": "largest", "greatest": "least", "least": "greatest",
               "maximum": "minimum", "minimum": "maximum", "longest": "shortest", "shortest": "longest",
               "highest": "lowest", "lowest": "highest", "most": "fewest", "more": "fewer", "fewer": "more",
               "older": "younger", "younger": "older", "oldest": "youngest", "youngest": "oldest",
               "faster": "slower", "slower": "faster", "taller": "shorter", "heavier": "lighter",
               "best": "worst", "worst": "best", "cheapest": "most expensive"}
COMPARATIVE_RE = re.compile(r"\b(" + "|".join(COMPARATIVE) + r")\b")
SYNONYMS = {"calculate": "compute", "compute": "calculate", "find": "determine", "determine": "find",
            "each": "every", "every": "each", "evaluate": "compute", "explain": "describe", "describe": "explain",
            "write": "compose", "give": "provide", "provide": "give", "suppose": "assume", "assume": "suppose",
            "show": "prove"}
#: Prefixes of common words only: the lexical embedder requires the same content words, so "Quick question:"
#: (a new word, "quick") is not a rephrasing it can recognise (``bench/semantic_cache.py`` measures that).
PREFIXES = ("Please answer this: ", "Can you tell me: ", "Question: ", "Hello, please help: ", "Hi! ")
SYNONYM_RE = re.compile(r"\b(" + "|".join(SYNONYMS) + r")\b", re.I)
UNITS_WORDS = sorted(UNITS, key=UNITS.__getitem__)
TENS_WORDS = sorted(TENS, key=TENS.__getitem__)
SMALL_NUMBER_RE = re.compile(r"(?<![\w.,$^{}\\/-])(\d{1,2})(?![\w.,%^{}/-])")
BIG_NUMBER_RE = re.compile(r"(?<![\w.,])(\d{4,7})(?![\w.,])")
NUMBER_RE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.])")
LATEX_DOLLAR = re.compile(r"\$(?!\d)")
AUXILIARIES = re.compile(r"\b(is|are|was|were|does|do|did|can|will|should|has|have)\b")


# --- data -------------------------------------------------------------------------------------------------

def questions(per_source: int, rng: random.Random) -> list[tuple[str, str]]:
    """(source, question): ``per_source`` of each source at most, ≤ MAX_CHARS, deduplicated, shuffled (the test
    and train splits: :func:`bench.semantic_cache.real_questions` with ``with_train``)."""
    return real_questions(per_source, rng, with_train=True)


# --- rules ------------------------------------------------------------------------------------------------

def _swap_spans(text: str, a: re.Match[str], b: re.Match[str]) -> str:
    """``text`` with the spans of ``a`` and ``b`` (``a`` first, not overlapping) exchanged."""
    return text[:a.start()] + b.group(0) + text[a.end():b.start()] + a.group(0) + text[b.end():]


def _names(text: str) -> list[re.Match[str]]:
    names = features(text).names
    return [m for m in re.finditer(r"\b[A-Z][a-zA-Z]+\b", text) if m.group(0).lower() in names]


def _operand_swap(text: str, rng: random.Random) -> str | None:
    nums = list(NUMBER_RE.finditer(text))
    pairs = [(a, b) for a, b in itertools.pairwise(nums) if float(a.group(0)) != float(b.group(0))]
    return _swap_spans(text, *rng.choice(pairs)) if pairs else None


def _entity_swap(text: str, rng: random.Random) -> str | None:
    spots = _names(text)
    pairs = [(a, b) for i, a in enumerate(spots) for b in spots[i + 1:] if a.group(0) != b.group(0)]
    if not pairs:
        return None
    x, y = rng.choice(pairs)
    n1, n2 = x.group(0), y.group(0)
    return re.sub(rf"\b({re.escape(n1)}|{re.escape(n2)})\b", lambda m: n2 if m.group(0) == n1 else n1, text)


def _noun_swap(text: str, rng: random.Random) -> str | None:
    words = [m for m in re.finditer(r"\b[a-z]{4,}\b", text) if m.group(0) not in COMMON]
    once = [m for m in words if sum(w.group(0) == m.group(0) for w in words) == 1]
    pairs = [(a, b) for a, b in itertools.pairwise(once)]
    return _swap_spans(text, *rng.choice(pairs)) if pairs else None


def _replace_one(text: str, rng: random.Random, pattern: re.Pattern[str], mapping: dict[str, str]) -> str | None:
    """``text`` with one match of ``pattern`` (chosen by ``rng``) replaced by its ``mapping`` entry; None when
    there is none."""
    spots = list(pattern.finditer(text))
    if not spots:
        return None
    m = rng.choice(spots)
    return text[:m.start()] + mapping[m.group(0)] + text[m.end():]


def _relation(text: str, rng: random.Random) -> str | None:
    return _replace_one(text, rng, RELATION_RE, OPPOSITE)


def _relation_swap(text: str, rng: random.Random) -> str | None:
    spots = [m for m in SWAP_RE.finditer(text) if m.group(1).lower() != m.group(3).lower()
             and (m.group(1)[:1].isdigit() or m.group(1)[:1].isupper())
             and (m.group(3)[:1].isdigit() or m.group(3)[:1].isupper())]
    if not spots:
        return None
    m = rng.choice(spots)
    return text[:m.start()] + m.group(3) + m.group(2) + m.group(1) + text[m.end():]


def _ordinal(text: str, rng: random.Random) -> str | None:
    words = list(ORDINAL_RE.finditer(text))
    digits = list(DIGIT_ORDINAL_RE.finditer(text))
    if not words and not digits:
        return None
    m = rng.choice(words + digits)
    if m.re is DIGIT_ORDINAL_RE:
        n = int(m.group(1)) + 1
        suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
        new = f"{n}{suffix}"
    else:
        w = m.group(0).lower()
        new = MULTIPLIERS.get(w) or rng.choice([o for o in ORDINAL_WORDS if o != w])
        new = new.capitalize() if m.group(0)[0].isupper() else new
    return text[:m.start()] + new + text[m.end():]


def _unit_swap(text: str, rng: random.Random) -> str | None:
    spots = list(ANY_UNIT_RE.finditer(text))
    pairs = [(a, b) for i, a in enumerate(spots) for b in spots[i + 1:] if a.group(0) != b.group(0)]
    return _swap_spans(text, *rng.choice(pairs)) if pairs else None


def _unit(text: str, rng: random.Random) -> str | None:
    spots = list(UNIT_RE.finditer(text))
    if not spots:
        return None
    m = rng.choice(spots)
    new = rng.choice([u for u in UNIT_OF[m.group(0)] if u != m.group(0)])
    return text[:m.start()] + new + text[m.end():]


def _comparative(text: str, rng: random.Random) -> str | None:
    return _replace_one(text, rng, COMPARATIVE_RE, COMPARATIVE)


def _number(text: str, rng: random.Random) -> str | None:
    nums = list(NUMBER_RE.finditer(text))
    if not nums:
        return None
    m = rng.choice(nums)
    return text[:m.start()] + str(int(float(m.group(0))) + rng.randint(1, 9)) + text[m.end():]


def _negation(text: str, rng: random.Random) -> str | None:
    if re.search(r"\bnot\b", text):
        return re.sub(r"\s*\bnot\b", "", text, count=1)
    a = AUXILIARIES.search(text)
    return text[:a.end()] + " not" + text[a.end():] if a else None


#: Words that decide what a question asks though every style guide calls them common (issue 27's trust
#: review: a helper's wrong hits), each with the word that asks something else.
DECIDING = {"when": "where", "where": "when", "who": "what", "why": "how", "how": "why",
            "is": "was", "was": "is", "are": "were", "were": "are", "does": "did", "did": "does",
            "can": "must", "must": "can", "should": "could", "could": "should", "will": "would",
            "he": "she", "she": "he", "his": "her", "him": "her", "they": "she",
            "all": "some", "some": "all", "every": "some", "each": "any", "any": "every"}
DECIDING_RE = re.compile(r"\b(" + "|".join(DECIDING) + r")\b")


def _deciding_word(text: str, rng: random.Random) -> str | None:
    return _replace_one(text, rng, DECIDING_RE, DECIDING)


def _grouping(text: str, rng: random.Random) -> str | None:
    """Brackets around the first two operands of an arithmetic chain (``3 + 4 × 2`` → ``(3 + 4) × 2``)."""
    m = re.search(r"(\d+(?:\.\d+)?)\s*([-+*/×÷])\s*(\d+(?:\.\d+)?)(?=\s*[-+*/×÷]\s*\d)", text)
    if not m:
        return None
    return text[:m.start()] + "(" + m.group(0) + ")" + text[m.end():]


#: The imperative that says what to do, each with one that asks for something else (an adversary's wrong hits:
#: "Summarize the following paragraph" / "Translate the following paragraph"); the first of the question only.
TASK_SWAP = {"write": "summarize", "explain": "translate", "describe": "classify", "summarize": "translate",
             "list": "rank", "give": "estimate", "compose": "rewrite", "find": "estimate", "calculate": "estimate",
             "compute": "estimate", "simplify": "expand", "evaluate": "estimate", "identify": "extract",
             "create": "edit", "draft": "edit", "rewrite": "translate", "suggest": "rank"}
TASK_RE = re.compile(r"\b(" + "|".join(TASK_SWAP) + r")\b", re.I)
#: The first and second persons traded (who owes whom): every "I"/"me" becomes "you" and every "you" "me".
SPEAKER_RE = re.compile(r"\b(I|me|you|my|your)\b")
SPEAKER_SWAP = {"I": "you", "me": "you", "you": "me", "my": "your", "your": "my"}


def _task(text: str, rng: random.Random) -> str | None:
    m = TASK_RE.search(text)
    if not m:
        return None
    new = TASK_SWAP[m.group(0).lower()]
    return text[:m.start()] + (new.capitalize() if m.group(0)[0].isupper() else new) + text[m.end():]


def _speaker(text: str, rng: random.Random) -> str | None:
    if len(set(SPEAKER_RE.findall(text)) & {"I", "me", "my"}) == 0 or "you" not in text.lower().split():
        return None  # both persons must be there for their roles to trade
    return SPEAKER_RE.sub(lambda m: SPEAKER_SWAP[m.group(0)], text)


def _conjunction(text: str, rng: random.Random) -> str | None:
    return _replace_one(text, rng, re.compile(r"\b(and|or)\b"), {"and": "or", "or": "and"})


def _conditional(text: str, rng: random.Random) -> str | None:
    return _replace_one(text, rng, re.compile(r"\b(if|unless)\b"), {"if": "unless", "unless": "if"})


def _amount(text: str, rng: random.Random) -> str | None:
    return _replace_one(text, rng, re.compile(r"(?<![Hh]ow )\b(many|few)\b"), {"many": "few", "few": "many"})


#: What each rule ``kind`` of :func:`changed` does to a question (None: it does not apply).
CHANGERS: dict[str, Callable[[str, random.Random], str | None]] = {
    "operand_swap": _operand_swap,
    "entity_swap": _entity_swap,
    "noun_swap": _noun_swap,
    "relation": _relation,
    "relation_swap": _relation_swap,
    "ordinal": _ordinal,
    "unit_swap": _unit_swap,
    "unit": _unit,
    "comparative": _comparative,
    "number": _number,
    "negation": _negation,
    "deciding_word": _deciding_word,
    "grouping": _grouping,
    "task": _task,
    "speaker": _speaker,
    "conjunction": _conjunction,
    "conditional": _conditional,
    "amount": _amount,
}


def _plain(text: str) -> str:
    return " ".join(text.split()).casefold()


def changed(kind: str, text: str, rng: random.Random) -> str | None:
    """A variant of ``text`` that asks something else, made by the rule ``kind`` (:data:`CHANGERS`); None when it
    does not apply. Raises ValueError for an unknown kind."""
    rule = CHANGERS.get(kind)
    if rule is None:
        raise ValueError(kind)
    return rule(text, rng)


def _spell(n: int) -> str:
    if n < 20:
        return UNITS_WORDS[n]
    tens, unit = divmod(n, 10)
    return TENS_WORDS[tens - 2] + (f"-{UNITS_WORDS[unit]}" if unit else "")


def rephrased(kind: str, text: str, rng: random.Random) -> str | None:
    """A rephrasing of ``text`` that keeps its meaning, made by the rule ``kind``; None when it does not apply."""
    out: str | None
    if kind == "lower":
        out = text.lower()
    elif kind == "spacing":
        out = re.sub(r" ", lambda _: "  " if rng.random() < 0.3 else " ", text)
        out = re.sub(r"([,.?!])(?=[A-Za-z])", r"\1 ", out) + " \n"
    elif kind == "punct":
        out = _punct(text)
    elif kind == "prefix":
        out = rng.choice(PREFIXES) + text[0].lower() + text[1:]
    elif kind == "synonym":
        spots = list(SYNONYM_RE.finditer(text))
        if not spots:
            return None
        m = rng.choice(spots)
        rep = SYNONYMS[m.group(0).lower()]
        out = text[:m.start()] + (rep.capitalize() if m.group(0)[0].isupper() else rep) + text[m.end():]
    elif kind == "number_words":
        if "\\" in text or LATEX_DOLLAR.search(text):  # inside LaTeX a spelled number is not the same maths
            return None
        spots = list(SMALL_NUMBER_RE.finditer(text))
        if not spots:
            return None
        m = rng.choice(spots)
        out = text[:m.start()] + _spell(int(m.group(1))) + text[m.end():]
    elif kind == "thousands":
        spots = [m for m in BIG_NUMBER_RE.finditer(text) if not 1800 <= int(m.group(1)) <= 2100]
        if not spots:
            return None
        m = rng.choice(spots)
        out = text[:m.start()] + f"{int(m.group(1)):,}" + text[m.end():]
    elif kind == "combo":
        out = _punct(rng.choice(PREFIXES) + text).lower()
    elif kind == "clause":
        sents = _sentences(text)
        out = " ".join([sents[-1], *sents[:-1]]) if len(sents) >= 2 else None
    else:
        raise ValueError(kind)
    return out if out and out != text else None


# --- the run ----------------------------------------------------------------------------------------------

def _variants(texts: list[str], rng: random.Random) -> list[tuple[str, str, str, str]]:
    """(changed|rephrased, family, base digest, text) of every rule that applies to each of ``texts``."""
    queries: list[tuple[str, str, str, str]] = []
    for q in texts:
        for kind in CHANGED:
            v = changed(kind, q, rng)
            if v is not None and v != q:
                queries.append(("changed", kind, digest_of(q), v))
        for kind in (*REPHRASED, *REPORTED_ONLY):
            v = rephrased(kind, q, rng)
            if v is not None:
                queries.append(("rephrased", kind, digest_of(q), v))
    return queries


async def perturb_part(sem: SemanticCache, keys: RedisKeys, per_source: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    bases = questions(per_source, rng)
    scope = tenant_scope("bench-perturb")
    texts = [q for _, q in bases]
    fill_s = await fill(sem, keys, scope, texts)
    emb = LexicalEmbedder()
    queries = _variants(texts, rng)
    base_text = {digest_of(q): q for q in texts}
    n: Counter[str] = Counter()
    hits: Counter[str] = Counter()
    sim_only: Counter[str] = Counter()
    reasons: dict[str, Counter[str]] = defaultdict(Counter)
    outcomes: dict[str, Counter[str]] = defaultdict(Counter)
    false_examples: list[str] = []
    other: Counter[str] = Counter()  # rephrasings served another stored question's answer
    threshold = sem.cfg.threshold
    t0 = time.perf_counter()
    for pol, kind, base, text in queries:
        n[kind] += 1
        probe = await sem.prepare(scope, "chat", "short", body_of(text))
        if probe is None:
            outcomes[kind]["not_eligible"] += 1
            continue
        res = await sem.lookup(probe)
        outcomes[kind][res.outcome] += 1
        if res.guard_reason:
            reasons[kind][res.guard_reason] += 1
        if pol == "changed":
            b = emb.sketch_now(base_text[base])
            if probe.sketch.similarity(b.kind, b.payload) >= threshold:
                sim_only[kind] += 1
            # a hit on a stored question that *is* the variant (a real question of the set: "… Medal in 1953?"
            # made from "… Medal in 1962?") is right, not false
            # (compared as text, case and spacing aside: not through the guard's normalisation under test)
            if res.outcome == "hit" and _plain(base_text.get(res.entry_id or "", "")) != _plain(text):
                hits[kind] += 1
                if len(false_examples) < 12:
                    false_examples.append(f"- `{kind}`: {text[:140]!r}")
        elif res.outcome == "hit" and res.entry_id == base:
            hits[kind] += 1
        elif res.outcome == "hit" and _plain(base_text.get(res.entry_id or "", "")) != _plain(base_text[base]):
            # a rephrasing served *another* stored question's answer: a false hit too
            other[kind] += 1
            if len(false_examples) < 12:
                false_examples.append(f"- `{kind}` (another question's answer): {text[:140]!r}")
    lookup_s = time.perf_counter() - t0
    return {"bases": Counter(s for s, _ in bases), "fill_s": fill_s, "n": n, "hits": hits, "sim_only": sim_only,
            "reasons": reasons, "outcomes": outcomes, "false_examples": false_examples, "other": other,
            "lookup_s": lookup_s,
            "queries": len(queries), "threshold": threshold}


def report(par: dict[str, Any], lat: list[dict[str, Any]], when: str, mach: str, args: argparse.Namespace) -> str:
    n, hits, sim_only, reasons = par["n"], par["hits"], par["sim_only"], par["reasons"]
    n_changed = sum(n[k] for k in CHANGED)
    false_hits = sum(hits[k] for k in CHANGED)
    n_reph = sum(n[k] for k in REPHRASED)
    recalled = sum(hits[k] for k in REPHRASED)
    cmd = (f"python -m bench.semantic_perturb --per-source {args.per_source} --sizes {args.sizes or '-'} "
           f"--queries {args.queries}")
    lines = [SECTION, "",
             f"`{cmd}` — {when}. Real `SemanticCache.prepare` + `lookup` (embedder `lexical`, threshold "
             f"{par['threshold']}, the default), private `redis-server`. Machine: {mach}.", "",
             f"{sum(par['bases'].values())} real questions stored "
             f"({', '.join(f'{k} {v}' for k, v in sorted(par['bases'].items()))}); variants made from them by "
             "rules (`bench/semantic_perturb.py`) looked up.", "",
             f"**Changed questions: {false_hits} false hits of {n_changed:,}.**", "",
             "| family | looked up | false hits | similarity ≥ threshold (a similarity-only cache would serve) "
             "| refused by (guard check: count) |", "|---|---:|---:|---:|---|"]
    for k in CHANGED:
        why = ", ".join(f"{r} {c}" for r, c in reasons[k].most_common(4))
        lines.append(f"| {k} | {n[k]} | {hits[k]} | {sim_only[k]} | {why} |")
    lines += ["", f"**True rephrasings: recall {recalled / max(1, n_reph):.3f}** ({recalled:,} of {n_reph:,} hit "
              f"their own entry; {sum(par['other'].values())} served another stored question's answer).", "",
              "| family | looked up | hits | recall | another question's answer | refused by |",
              "|---|---:|---:|---:|---:|---|"]
    for k in (*REPHRASED, *REPORTED_ONLY):
        why = ", ".join(f"{r} {c}" for r, c in reasons[k].most_common(3))
        mark = " (not in the headline)" if k in REPORTED_ONLY else ""
        lines.append(f"| {k}{mark} | {n[k]} | {hits[k]} | {hits[k] / max(1, n[k]):.3f} | {par['other'][k]} "
                     f"| {why} |")
    if par["false_examples"]:
        lines += ["", "False hits:", *par["false_examples"]]
    if lat:
        lines += ["", "**Lookup latency** (`bench.semantic_cache.latency_part`: one tenant and context; total = "
                  "`prepare` (sketch + guard features) + `lookup`, incl. the answer's GET on a hit):", "",
                  "| entries | fill s | hit p50 ms | hit p99 ms | miss p50 ms | miss p99 ms | hit p50 best of 3 | "
                  "miss p50 best of 3 | prepare p50 ms | `lookup` alone p50 ms hit / miss | "
                  "CPU ms/query p50 hit / miss | lookup script µs (Redis) | load average (start → end) | outcomes |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in lat:
            outs = ", ".join(f"{k} {v}" for k, v in sorted(r["outcomes"].items()))
            p = _ms(r, "hit", "miss", "best_hit", "best_miss", "prep")
            only, cpu = _ms(r["lookup_only"], "hit", "miss"), _ms(r["cpu"], "hit", "miss")
            lines.append(f"| {r['stored']:,} | {r['fill_s']:.0f} | {p['hit', 50]:.2f} | {p['hit', 99]:.2f} "
                         f"| {p['miss', 50]:.2f} | {p['miss', 99]:.2f} | {p['best_hit', 50]:.2f} | "
                         f"{p['best_miss', 50]:.2f} | {p['prep', 50]:.2f} | "
                         f"{only['hit', 50]:.2f} / {only['miss', 50]:.2f} | "
                         f"{cpu['hit', 50]:.2f} / {cpu['miss', 50]:.2f} | {r['script_us']:.0f} | "
                         f"{r['load'][0]:.1f} → {r['load'][1]:.1f} | {outs} |")
    lines += ["", "Reading: a changed question is refused by the guard's order- and role-aware checks (`order`: numbers"
              " and operators in sequence; `units`; `relation`: what stands on each side of "
              "from/to/of/per/than/north of…; `ordinal`; `comparative`; `word_order`: the content words in order) "
              "or, when its numbers are in another order, it is not even a candidate (`miss`: the index buckets are"
              " keyed by the numbers in order). The `clause` rephrasing (a sentence moved) is refused whenever it "
              "moves numbers, names or content words past each other — the guard cannot tell a harmless move from a"
              " changed role, and misses."]
    return "\n".join(lines) + "\n"


async def run(args: argparse.Namespace) -> str:
    proc, url = start_private()
    handle = connect(RedisConfig(url=url, key_prefix="tgperturb:", socket_timeout_s=5.0))
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else []
    try:
        breaker = Breaker(1.0)
        cfg = SemanticCacheConfig(enabled=True, max_chars=MAX_CHARS, max_entries_per_tenant=max([*sizes, 0]) + 10_000)
        sem = SemanticCache(handle, breaker, cfg, LexicalEmbedder())
        keys = RedisKeys.of(handle)
        t0 = time.monotonic()
        par = await perturb_part(sem, keys, args.per_source, args.seed)
        print(f"perturbation part: {time.monotonic() - t0:.0f} s, {par['queries']} lookups", flush=True)
        print(report(par, [], "(partial)", "", args), flush=True)
        lat: list[dict[str, Any]] = []
        if sizes:
            t0 = time.monotonic()
            lat = await latency_part(sem, keys, sizes, args.queries, args.seed)
            print(f"latency part: {time.monotonic() - t0:.0f} s", flush=True)
    finally:
        await handle.close()
        proc.terminate()
        proc.wait(timeout=10)
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return report(par, lat, when, machine(), args)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-source", type=int, default=600, help="questions per source (SimpleQA, GSM8K, MATH…)")
    ap.add_argument("--sizes", default="100000", help="latency fill sizes, comma-separated; empty skips it")
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--seed", type=int, default=25)
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args(argv)
    text = asyncio.run(run(args))
    print(text)
    if args.write_results:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
