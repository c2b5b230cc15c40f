"""The ``index`` of an upstream chat-completion chunk's choice or tool call, as the translators read it.

Shared by the wire translators (``gateway.anthropic.messages``, ``gateway.openai.responses``), which may not import
each other (the import-linter layers): one rule for both.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import UpstreamError


def stream_index(part: dict[str, Any], what: str) -> int:
    """The ``index`` of a streamed choice or tool call (``part``; ``what`` names it in the error): absent or null is
    0, as the relay's tally and assembler read it. Raises :class:`~gateway.errors.UpstreamError` for an index that
    is no integer ("x", "0", 0.5, true): which choice or call the delta belongs to is unknown — relayed under a guess
    it is spliced into another one, skipped it is dropped while the answer ends looking whole."""
    index = part.get("index")
    if index is None:
        return 0
    if not isinstance(index, int) or isinstance(index, bool):
        raise UpstreamError(f"the upstream sent a {what} index that is no integer")
    return index
