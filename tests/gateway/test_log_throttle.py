"""``LogThrottle``: one line per distinct error per interval, with the count of those held back since."""

from __future__ import annotations

from gateway.state.log_throttle import LogThrottle, held_back


def test_one_line_per_error_per_interval_with_the_count_held_back() -> None:
    t = LogThrottle(every_s=60.0)
    assert t.due("a", now=0.0) == 0  # the first line is due, nothing held back
    assert t.due("a", now=1.0) is None and t.due("a", now=59.9) is None  # held back, counted
    assert t.due("b", now=2.0) == 0  # another error has its own minute
    assert t.due("a", now=60.0) == 2  # due again, saying how many were not logged
    assert t.due("a", now=61.0) is None
    assert held_back(2) == " (2 more since the last line)" and held_back(0) == ""


def test_errors_without_end_are_forgotten_not_accumulated() -> None:
    t = LogThrottle(every_s=60.0, max_kinds=3)
    for i in range(3):
        assert t.due(f"key {i}", now=0.0) == 0
    assert t.due("key 0", now=1.0) is None  # a known one is still throttled at the limit
    assert t.due("key 3", now=1.0) == 0  # a new one past the limit: the table starts over…
    assert t.due("key 0", now=2.0) == 0  # …so an old one logs again once rather than the table growing
    assert len(t._seen) <= 3
