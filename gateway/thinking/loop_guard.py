"""The loop guard of a forced tier (``loop_guard``): a thought that repeats itself ends its thinking phase early.

An n-gram of ``ngram`` consecutive whitespace words seen ``max_repeats`` times in the streamed thought ends
phase 1 of budget forcing (:mod:`gateway.thinking.forcing`) as if the thinking budget were hit.
"""

from __future__ import annotations

from collections import Counter, deque

from gateway.config import LoopGuard


class LoopDetector:
    """Detects a thought that repeats itself: True once any n-gram of ``ngram`` consecutive whitespace words
    has been seen ``max_repeats`` times. Feed text pieces as they stream (split words across pieces are
    handled by keeping the unfinished tail)."""

    def __init__(self, guard: LoopGuard) -> None:
        self.n = guard.ngram
        self.max_repeats = guard.max_repeats
        self._window: deque[str] = deque(maxlen=self.n)
        self._counts: Counter[tuple[str, ...]] = Counter()
        self._tail = ""

    def feed(self, text: str) -> bool:
        """Add ``text``; return True when the loop threshold is reached."""
        words = (self._tail + text).split(" ")
        self._tail = words.pop()  # the last piece may be an unfinished word
        hit = False
        for chunk in words:
            for w in chunk.split():
                self._window.append(w)
                if len(self._window) == self.n:
                    key = tuple(self._window)
                    self._counts[key] += 1
                    hit = hit or self._counts[key] >= self.max_repeats
        return hit
