"""Every error code the gateway's errors carry is a label value of ``thinkgate_refused_requests_total`` (or of the
upstream-error counter), not ``other``: docs/metering.md says each refusal is counted by its code.

A new user's 400 ``invalid_value`` (a bad ``reasoning_effort``) was counted as ``code="other"``, as were
``unsupported_parameter``, ``unknown_parameter``, ``usage_scan_too_large`` and ``previous_response_not_found``:
the allow-list (which bounds the label's values) had drifted from the codes the gateway raises.
"""

from __future__ import annotations

import re
from pathlib import Path

from gateway.observability.metrics import ERROR_CODES, REFUSAL_CODES

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"
#: codes of failures after admission, of the upstream or the gateway's own calls: the error counter's, by status
UPSTREAM_SIDE = {"client_disconnected", "upstream_connect_timeout", "upstream_auth_failed"}


def _codes() -> set[str]:
    found: set[str] = set()
    for path in GATEWAY.rglob("*.py"):
        text = path.read_text()
        found |= set(re.findall(r'\bcode="([a-z_]+)"', text))
        found |= set(re.findall(r'default_code = "([a-z_]+)"', text))
    return found


def test_every_code_the_gateway_raises_is_counted_by_name() -> None:
    codes = _codes()
    assert "invalid_value" in codes and "tier_not_allowed" in codes  # the scan reads the sources it should
    missing = sorted(c for c in codes if c not in REFUSAL_CODES | ERROR_CODES | UPSTREAM_SIDE)
    assert missing == []
