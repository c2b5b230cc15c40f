"""Helpers shared by the HTTP surface's modules."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response


def json_response(data: Any, status: int = 200) -> Response:
    """``data`` as an ``application/json`` response (orjson: datetimes, dataclasses and numpy scalars work)."""
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")
