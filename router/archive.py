"""Read the plain-data part of a skops archive without skops (NumPy and the standard library only).

``skops.io`` imports scikit-learn and SciPy when it is imported (~970 modules, ~250 MiB resident), which the
gateway's request path does not need once a router file carries its fast-path arrays
(:mod:`router.persistence`). :func:`read_plain` reads the archive's ``schema.json`` and builds only what skops'
protocol writes for plain data — ``dict`` with ``str`` keys, ``list``, ``tuple``, JSON scalars (``None``, bool,
int, float, str) and NumPy arrays stored as ``.npy`` members (loaded with ``allow_pickle=False``) — and skips
the top-level keys it is told to skip without looking inside them. Nothing is imported by name and nothing is
unpickled, so it is at least as safe as ``skops.io.load`` with skops' default trusted types.

Anything else (another skops protocol, an object node outside the skipped keys, a missing member) raises
:class:`UnsupportedArchive`; the caller then loads the file with ``skops.io`` itself.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np

#: skops' archive protocols whose plain-data nodes this reader knows (skops 0.10–0.16 write protocol 2).
PROTOCOLS = (2,)


class UnsupportedArchive(ValueError):
    """The archive is not one :func:`read_plain` can read alone (load it with ``skops.io`` instead)."""


NodeType = tuple[str, str, str]  # (module, class, skops loader), e.g. ("sklearn.pipeline", "Pipeline", "ObjectNode")


def read_plain(path: str | Path, skip: Collection[str] = ()) -> tuple[dict[str, Any], dict[str, set[NodeType]]]:
    """The top-level dict of the skops archive at ``path`` without the keys in ``skip`` (never built), and per
    skipped key the set of node types its subtree names (for the caller's trust check; nothing is imported).

    Raises :class:`UnsupportedArchive` for contents outside the plain subset (see the module doc), OSError when
    the file cannot be read and ``zipfile.BadZipFile`` when it is not a zip archive.
    """
    with zipfile.ZipFile(path) as zf:
        try:
            schema = json.loads(zf.read("schema.json"))
        except KeyError:
            raise UnsupportedArchive("no schema.json: not a skops archive") from None
        except ValueError as exc:
            raise UnsupportedArchive(f"schema.json is not JSON: {exc}") from None
        if not isinstance(schema, dict) or schema.get("protocol") not in PROTOCOLS:
            raise UnsupportedArchive(f"skops protocol {schema.get('protocol') if isinstance(schema, dict) else '?'}")
        if schema.get("__loader__") != "DictNode":
            raise UnsupportedArchive("the archive does not hold a dict")
        content = schema.get("content")
        if not isinstance(content, dict):
            raise UnsupportedArchive("malformed top-level dict")
        _check_str_keys(schema, len(content))
        try:
            plain = {k: _node(v, zf) for k, v in content.items() if k not in skip}
            return plain, {k: _types(content[k], set()) for k in skip if k in content}
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, UnsupportedArchive):
                raise
            raise UnsupportedArchive(f"malformed node ({type(exc).__name__}: {exc})") from None


def _types(node: Any, out: set[NodeType]) -> set[NodeType]:
    if isinstance(node, dict):
        if "__loader__" in node:
            out.add((str(node.get("__module__")), str(node.get("__class__")), str(node["__loader__"])))
        for v in node.values():
            _types(v, out)
    elif isinstance(node, list):
        for v in node:
            _types(v, out)
    return out


def _check_str_keys(node: dict[str, Any], n: int) -> None:
    kt = node.get("key_types")
    items = kt.get("content") if isinstance(kt, dict) else None
    if not isinstance(items, list) or len(items) != n or any(
        not isinstance(t, dict) or (t.get("__module__"), t.get("__class__"), t.get("__loader__"))
        != ("builtins", "str", "TypeNode")
        for t in items
    ):
        raise UnsupportedArchive("dict keys that are not str")


def _node(node: Any, zf: zipfile.ZipFile) -> Any:
    if not isinstance(node, dict):
        raise UnsupportedArchive("malformed node")
    loader, module, cls = node.get("__loader__"), node.get("__module__"), node.get("__class__")
    if loader == "JsonNode" and node.get("is_json") is True:
        value = json.loads(node["content"])
        if value is not None and not isinstance(value, bool | int | float | str):
            raise UnsupportedArchive("a JSON node that is not a scalar")
        return value
    if loader in ("ListNode", "TupleNode") and module == "builtins" and cls in ("list", "tuple"):
        items = [_node(x, zf) for x in node["content"]]
        return items if cls == "list" else tuple(items)
    if loader == "DictNode" and module == "builtins" and cls == "dict":
        content = node["content"]
        _check_str_keys(node, len(content))
        return {k: _node(v, zf) for k, v in content.items()}
    if loader == "NdArrayNode" and module == "numpy" and cls == "ndarray" and node.get("type") == "numpy":
        try:
            data = zf.read(node["file"])
        except KeyError:
            raise UnsupportedArchive(f"missing member {node['file']!r}") from None
        return np.load(io.BytesIO(data), allow_pickle=False)
    raise UnsupportedArchive(f"node {module}.{cls} ({loader}) is not plain data")
