"""Helpers shared by reward functions: completion text, token lengths, group structure, verifiers.

TRL calls a reward as ``fn(prompts=..., completions=..., completion_ids=..., **kwargs)`` with one row per rollout,
prompt-major (the ``num_generations`` rollouts of a prompt are adjacent) and every dataset column passed as a
list-valued keyword. Group-relative rewards must not rely on adjacency alone: :func:`group_indices` groups rows by
the ``problem_id`` column when present.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

# Keyword arguments TRL adds that are not dataset columns.
NON_COLUMN_KWARGS = frozenset({"trainer_state", "log_extra", "log_metric", "environments"})

Verifier = Callable[[Mapping[str, Any], str], bool]
"""``verifier(row, completion_text) -> bool``; ``row`` holds the dataset columns of that rollout."""

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def completion_text(completion: Any) -> str:
    """The text of one completion: a string (standard format) or a list of messages (conversational)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(str(m.get("content") or "") for m in completion if isinstance(m, dict))
    raise TypeError(f"unsupported completion type: {type(completion).__name__}")


def token_lengths(completion_ids: Sequence[Sequence[int]] | None, n: int) -> list[int]:
    """Completion lengths in tokens (what was sampled, EOS included when generated).

    Raises ``ValueError`` when TRL did not pass ``completion_ids``: lengths are never estimated from characters.
    """
    if completion_ids is None:
        raise ValueError("length rewards need completion_ids (token ids); TRL passes them to reward functions")
    if len(completion_ids) != n:
        raise ValueError(f"completion_ids has {len(completion_ids)} rows, completions has {n}")
    return [len(ids) for ids in completion_ids]


@dataclass(frozen=True)
class LengthCap:
    """The generation cap of the rollouts (``trl.max_completion_length``, tokens) and the EOS ids: a rollout that
    reached the cap without ending in EOS was cut by length (``finish_reason: length``)."""

    max_len: int
    eos_token_ids: frozenset[int] | None = None

    def cut(self, ids: Sequence[int]) -> bool:
        """True when ``ids`` hit the cap unfinished (without EOS ids known, reaching the cap counts as cut)."""
        if len(ids) < self.max_len:
            return False
        return self.eos_token_ids is None or not ids or ids[-1] not in self.eos_token_ids


def cut_rows(completion_ids: Sequence[Sequence[int]] | None, n: int, cap: LengthCap | None) -> list[bool]:
    """:meth:`LengthCap.cut` per rollout; all False without a cap or without token ids."""
    if cap is None or completion_ids is None:
        return [False] * n
    if len(completion_ids) != n:
        raise ValueError(f"completion_ids has {len(completion_ids)} rows, completions has {n}")
    return [cap.cut(ids) for ids in completion_ids]


def rows_from_kwargs(n: int, kwargs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per-rollout dicts of the dataset columns TRL passed as list-valued keywords."""
    cols = {k: v for k, v in kwargs.items() if k not in NON_COLUMN_KWARGS and isinstance(v, list) and len(v) == n}
    return [{k: v[i] for k, v in cols.items()} for i in range(n)]


def group_indices(
    n: int, problem_ids: Sequence[Any] | None = None, num_generations: int | None = None
) -> list[list[int]]:
    """Row indices of each group.

    By ``problem_id`` when given (rows of one prompt form one group wherever they sit; order of first appearance),
    else consecutive chunks of ``num_generations`` (``n`` must be a multiple). One of the two is required.
    """
    if problem_ids is not None:
        if len(problem_ids) != n:
            raise ValueError(f"problem_id has {len(problem_ids)} rows, expected {n}")
        groups: dict[Any, list[int]] = {}
        for i, pid in enumerate(problem_ids):
            groups.setdefault(pid, []).append(i)
        return list(groups.values())
    if num_generations is None or num_generations < 1:
        raise ValueError("group_indices needs problem_ids or num_generations")
    if n % num_generations:
        raise ValueError(f"{n} rows is not a multiple of num_generations={num_generations}")
    return [list(range(s, s + num_generations)) for s in range(0, n, num_generations)]


def split_thought(text: str) -> tuple[str, str, bool]:
    """``(thought, answer, closed)``: text before/after the last ``</think>`` (a leading ``<think>`` is dropped).

    ``closed`` is False when the completion never closed its thought (then everything is thought, answer is "").
    """
    body = text.lstrip()
    if body.startswith(THINK_OPEN):
        body = body[len(THINK_OPEN) :]
    if THINK_CLOSE not in body:
        return body, "", False
    thought, _, answer = body.rpartition(THINK_CLOSE)
    return thought, answer, True


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def exact_answer_verifier(row: Mapping[str, Any], text: str) -> bool:
    """A minimal verifier for tests and toy data: the answer after ``</think>`` equals ``row['answer']``.

    Compares the first number of the answer when the reference is numeric, else the stripped strings.
    """
    _, answer, closed = split_thought(text)
    if not closed:
        return False
    ref = str(row["answer"]).strip()
    if _NUMBER.fullmatch(ref):
        m = _NUMBER.search(answer)
        return m is not None and float(m.group()) == float(ref)
    return answer.strip() == ref


def task_verifier() -> Verifier:
    """The verifier of ``router.tasks`` (arithmetic, GSM8K, MATH with math-verify), adapted to rows.

    Rows carry ``problem_id, question, answer, difficulty, source`` (see ``training.grpo.data``).
    ``router.tasks.verify`` reads the whole text as the answer when there is no ``</think>`` (it also serves
    vLLM's ``message.content``, which has the thought removed): rewards and evaluation therefore call it through
    :func:`is_correct`, which scores a cut-off thought wrong first.
    """
    from router import tasks  # lazy: owned by the tasks package

    def verify(row: Mapping[str, Any], text: str) -> bool:
        problem = tasks.Problem(
            id=row["problem_id"],
            question=row["question"],
            answer=row["answer"],
            difficulty=row["difficulty"],
            source=row["source"],
        )
        return bool(tasks.verify(problem, text))

    return verify


def is_correct(
    verifier: Verifier, row: Mapping[str, Any], text: str, require_closed_thought: bool = True, cut: bool = False
) -> bool:
    """The correctness decision shared by every reward and the held-out evaluation.

    False when the completion was cut by the training length cap (``cut``, which the rewards pass: anywhere —
    inside the thought or after ``</think>``, where the answer itself is unfinished; the held-out evaluation
    reports its own cap's cuts apart, as ``truncated``), when ``require_closed_thought`` and it never closed its
    thought (no ``</think>``) — whatever the verifier would say about the text — and when the verifier raises;
    else ``verifier(row, text)``. The policy thinks by construction (the generation prompt opens ``<think>``, or
    the model writes it), so the default is on for rewards and evaluation alike.
    """
    if cut or (require_closed_thought and not split_thought(text)[2]):
        return False
    try:
        return bool(verifier(row, text))
    except Exception:
        return False


def verify_rows(
    verifier: Verifier,
    completions: Sequence[Any],
    kwargs: Mapping[str, Any],
    require_closed_thought: bool = True,
    completion_ids: Sequence[Sequence[int]] | None = None,
    cap: LengthCap | None = None,
) -> list[bool]:
    """:func:`is_correct` for every rollout (a cut-off thought, a rollout cut by ``cap`` — given its
    ``completion_ids`` — or a verifier exception counts as incorrect)."""
    rows = rows_from_kwargs(len(completions), kwargs)
    cut = cut_rows(completion_ids, len(completions), cap)
    return [
        is_correct(verifier, row, completion_text(c), require_closed_thought, k)
        for row, c, k in zip(rows, completions, cut, strict=True)
    ]


_MARKER = "\u2063q\u2063"


def _generation_tail(tokenizer: Any, **template_kwargs: Any) -> str | None:
    """What the chat template adds after a user turn with ``add_generation_prompt`` (None: no usable template)."""
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": _MARKER}], add_generation_prompt=True, tokenize=False, **template_kwargs
        )
    except Exception:
        return None
    return str(text).rsplit(_MARKER, 1)[-1]


def _opens(tail: str) -> bool:
    return THINK_OPEN in tail and THINK_CLOSE not in tail.rpartition(THINK_OPEN)[2]


def _template_source(tokenizer: Any) -> str:
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):
        return "\n".join(str(v) for v in tpl.values())
    return str(tpl or "")


def template_opens_thought(tokenizer: Any) -> bool:
    """True when the tokenizer's chat template makes the model think: the generation prompt (after the user turn)
    opens ``<think>`` without closing it, so the completion starts inside a thought. False without a template."""
    tail = _generation_tail(tokenizer)
    return tail is not None and _opens(tail)


def thought_opener(tokenizer: Any) -> Literal["template", "model"] | None:
    """Who opens the thought, read from the tokenizer's chat template.

    ``"template"``: the generation prompt opens ``<think>`` (the completion starts inside the thought; the
    shipped tiny model, DeepSeek-R1's updated template). ``"model"``: the generation prompt does not, but the
    template knows thoughts — it names ``</think>`` (Qwen3 and DeepSeek-R1 cut the thought out of earlier
    assistant turns, Qwen3 closes an empty one when ``enable_thinking=False``) — so the model writes ``<think>``
    itself (Qwen3 with thinking on, DeepSeek-R1's original template). None: the generation prompt closes the
    thought already (thinking switched off), or the template has no thoughts (or there is no template).
    """
    tail = _generation_tail(tokenizer)
    if tail is None:
        return None
    if _opens(tail):
        return "template"
    if THINK_CLOSE in tail:  # "<think>\n\n</think>": the template switched thinking off
        return None
    off = _generation_tail(tokenizer, enable_thinking=False)
    hybrid = off is not None and off != tail and THINK_CLOSE in off  # Qwen3: off closes an empty thought
    return "model" if hybrid or THINK_CLOSE in _template_source(tokenizer) else None


def policy_thinks(tokenizer: Any) -> bool:
    """The default of ``model.thinks``: True when :func:`thought_opener` finds a thought, opened by the template or
    by the model (a completion without ``</think>`` is then a cut-off thought)."""
    return thought_opener(tokenizer) is not None
