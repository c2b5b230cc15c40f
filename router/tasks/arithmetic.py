"""Chained small-integer arithmetic: a generated, exactly verifiable reasoning family.

A problem starts from an integer and applies ``difficulty`` operations (add/subtract 1–9, multiply/divide by
2–5), phrased as a natural-language question::

    Start with 7. Add 5, then multiply by 3. What is the result?   → 36

Every intermediate value stays in ``[0, MAX_VALUE]`` and divisions are exact, so each step is one fact from a
small table (≈2,000 facts) that a few-million-parameter model can learn, while chaining many steps without
writing them down is beyond it: that is what makes thinking length matter.

Splits: a problem belongs to ``train`` or ``test`` by a hash of its *content* (start value and operations,
not its wording), so the same arithmetic never appears in both splits whatever the wording or seed; the
random streams of the two splits are also seeded from disjoint seed strings. Generation is deterministic
per ``(split, seed, index)`` (``random.Random`` with a string seed, independent of ``PYTHONHASHSEED``).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from router.tasks.base import Problem, extract_answer, parse_int

SOURCE = "arith"
MAX_VALUE = 99
DEFAULT_DIFFICULTIES: tuple[int, ...] = (1, 2, 3, 4, 5, 6)
#: Percent of the content-hash space reserved for the held-out split.
TEST_PERCENT = 20
SPLITS = ("train", "test")

_SYMBOL = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
_PHRASES = {
    "add": ("add {k}", "increase it by {k}", "add {k} to it"),
    "sub": ("subtract {k}", "take away {k}", "decrease it by {k}"),
    "mul": ("multiply by {k}", "multiply it by {k}", "times {k}"),
    "div": ("divide by {k}", "divide it by {k}", "split it into {k} equal parts and keep one"),
}
_OPENINGS = ("Start with {s}.", "Take the number {s}.", "A counter shows {s}.", "Begin at {s}.")
_QUESTIONS = ("What is the result?", "What number do you get?", "What is the final number?", "What do you get?")


@dataclass(frozen=True)
class Op:
    """One operation: ``kind`` in add|sub|mul|div and its operand ``k``."""

    kind: str
    k: int

    def apply(self, x: int) -> int:
        """The value after applying this operation to ``x`` (exact; division only where divisible)."""
        if self.kind == "add":
            return x + self.k
        if self.kind == "sub":
            return x - self.k
        if self.kind == "mul":
            return x * self.k
        return x // self.k

    @property
    def symbol(self) -> str:
        return _SYMBOL[self.kind]

    @property
    def inverse(self) -> Op:
        """The operation that undoes this one (used by re-checking steps in chains of thought)."""
        inv = {"add": "sub", "sub": "add", "mul": "div", "div": "mul"}[self.kind]
        return Op(inv, self.k)


@dataclass(frozen=True)
class Chain:
    """The content of an arithmetic problem: a start value and its operations."""

    start: int
    ops: tuple[Op, ...]

    def values(self) -> list[int]:
        """All values: ``[start, after op 1, …, after op n]`` (length ``len(ops) + 1``)."""
        out = [self.start]
        for op in self.ops:
            out.append(op.apply(out[-1]))
        return out

    @property
    def answer(self) -> int:
        return self.values()[-1]

    def key(self) -> str:
        """Canonical content string, independent of wording (e.g. ``"7|add5|mul3"``)."""
        return "|".join([str(self.start), *(f"{o.kind}{o.k}" for o in self.ops)])


def split_of(chain: Chain) -> str:
    """``"test"`` for the ``TEST_PERCENT``% of content hashes reserved for evaluation, else ``"train"``."""
    h = int.from_bytes(hashlib.sha256(chain.key().encode()).digest()[:8], "big")
    return "test" if h % 100 < TEST_PERCENT else "train"


def _valid_ops(x: int) -> list[Op]:
    ops: list[Op] = []
    ops += [Op("add", k) for k in range(1, 10) if x + k <= MAX_VALUE]
    ops += [Op("sub", k) for k in range(1, 10) if x - k >= 0]
    ops += [Op("mul", k) for k in range(2, 6) if x > 0 and x * k <= MAX_VALUE]
    ops += [Op("div", k) for k in range(2, 6) if x >= k and x % k == 0]
    return ops


def random_chain(rng: random.Random, difficulty: int) -> Chain:
    """A random chain of ``difficulty`` operations (kinds drawn uniformly among those valid at each value)."""
    if difficulty < 1:
        raise ValueError(f"difficulty must be >= 1, got {difficulty}")
    x = rng.randint(1, 30)
    start, ops = x, []
    for _ in range(difficulty):
        valid = _valid_ops(x)
        kinds = sorted({o.kind for o in valid})
        kind = rng.choice(kinds)
        op = rng.choice([o for o in valid if o.kind == kind])
        ops.append(op)
        x = op.apply(x)
    return Chain(start, tuple(ops))


def phrase(chain: Chain, rng: random.Random) -> str:
    """A natural-language question for ``chain`` (wording drawn from ``rng``)."""
    parts = []
    for op in chain.ops:
        if op.kind == "mul" and op.k == 2 and rng.random() < 0.3:
            parts.append("double it")
        elif op.kind == "div" and op.k == 2 and rng.random() < 0.3:
            parts.append("halve it")
        else:
            parts.append(rng.choice(_PHRASES[op.kind]).format(k=op.k))
    if len(parts) <= 3 and rng.random() < 0.6:
        body = ", then ".join(parts)
        body = body[0].upper() + body[1:] + "."
    else:
        body = " ".join(p[0].upper() + p[1:] + "." for p in parts)
    return f"{rng.choice(_OPENINGS).format(s=chain.start)} {body} {rng.choice(_QUESTIONS)}"


def make_problem(chain: Chain, question: str, pid: str) -> Problem:
    """Wrap a chain and its wording as a :class:`Problem` (``meta["chain"]`` holds the chain)."""
    return Problem(
        id=pid,
        question=question,
        answer=str(chain.answer),
        difficulty=len(chain.ops),
        source=SOURCE,
        meta={"chain": chain},
    )


def sample(split: str, rng: random.Random, difficulty: int, max_tries: int = 1000) -> tuple[Chain, str]:
    """Draw a chain belonging to ``split`` and its wording. Raises RuntimeError after ``max_tries`` rejections."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    for _ in range(max_tries):
        chain = random_chain(rng, difficulty)
        if split_of(chain) == split:
            return chain, phrase(chain, rng)
    raise RuntimeError(f"no {split} chain of difficulty {difficulty} in {max_tries} tries")


def stream(split: str, seed: int, difficulties: Iterable[int] = DEFAULT_DIFFICULTIES) -> Iterator[Problem]:
    """An endless deterministic stream of problems of ``split``; difficulty cycles through ``difficulties``.

    The i-th problem depends only on ``(split, seed, i)``; duplicates (same content) are skipped, so every
    problem of one stream is distinct (the stream ends, raising RuntimeError, if a difficulty runs out).
    """
    levels = list(difficulties)
    if not levels:
        raise ValueError("difficulties must not be empty")
    seen: set[str] = set()
    i = 0
    while True:
        d = levels[i % len(levels)]
        rng = random.Random(f"{SOURCE}|{split}|{seed}|{i}")
        for _ in range(200):
            chain, question = sample(split, rng, d)
            if chain.key() not in seen:
                break
        else:
            raise RuntimeError(f"difficulty {d}: no new distinct {split} problem found (space exhausted?)")
        seen.add(chain.key())
        yield make_problem(chain, question, f"{SOURCE}/{split}/{seed}/{i}")
        i += 1


def load(split: str, n: int, seed: int = 0, difficulties: Iterable[int] | None = None) -> list[Problem]:
    """``n`` distinct problems of ``split`` (train|test), difficulties balanced round-robin."""
    it = stream(split, seed, difficulties or DEFAULT_DIFFICULTIES)
    return [next(it) for _ in range(n)]


def verify(problem: Problem, completion: str) -> bool:
    """True when the integer after the last ``</think>`` of ``completion`` equals the reference answer."""
    got = parse_int(extract_answer(completion))
    return got is not None and got == int(problem.answer)
