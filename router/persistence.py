"""Router files: skops (no pickle), a versioned envelope, metadata, and clear errors.

A router file is a skops archive (``skops.io.dump``, zip-deflated) of one dict::

    {"format": "thinkgate-router", "format_version": 1, "pipeline": <fitted sklearn Pipeline>,
     "platt": [a, b], "thresholds": [float, ...], "metadata": "<JSON text>"}

Version 2 (written only for the model-free baselines, so version-1 readers keep reading every learned file)
adds ``"scorer": "length" | "hash"`` with ``"pipeline": None`` (:func:`router.model.length_prior`,
:func:`router.model.hash_score`); this build reads both versions.

Loading never unpickles: skops rebuilds objects from a JSON schema and refuses any type that is not on its
trusted list. We pass exactly :data:`TRUSTED_TYPES` (our two stateless transformers) on top of skops'
defaults, after checking with ``skops.io.get_untrusted_types`` that the file asks for nothing else.
Every failure is a :class:`RouterFileError` whose message names the file and what is wrong.
"""

from __future__ import annotations

import json
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from router.errors import ThinkGateError
from router.model import Platt, TrainedRouter

FORMAT = "thinkgate-router"
FORMAT_VERSION = 2
#: Versions this build reads.
READABLE_VERSIONS = (1, 2)
#: Types outside skops' default trust list that a router file may contain (and nothing else).
TRUSTED_TYPES: tuple[str, ...] = ("router.features.HandFeatures", "router.features.TextClipper")


class RouterFileError(ThinkGateError, RuntimeError):
    """A router file is missing, unreadable, corrupt, untrusted or incompatible. ``path`` names the file."""

    def __init__(self, path: str | Path | None, message: str) -> None:
        self.path = None if path is None else Path(path)
        super().__init__(f"router file {self.path}: {message}" if path is not None else message)


def _compact_vocabularies(pipeline: Any) -> None:
    # skops writes every NumPy scalar as its own .npy member; plain ints keep the file small (~1 MB, not 10).
    for _, step in pipeline.named_steps["features"].transformer_list:
        vocab = getattr(step, "vocabulary_", None)
        if vocab is not None:
            step.vocabulary_ = {str(k): int(v) for k, v in vocab.items()}
        if hasattr(step, "stop_words_"):
            del step.stop_words_


def save_router(router: TrainedRouter, path: str | Path) -> Path:
    """Write ``router`` to ``path`` atomically (temp file + ``os.replace``), so a watcher never reads half a
    file. Returns the path. Raises OSError on write failure."""
    import skops.io as sio

    if router.pipeline is not None:
        _compact_vocabularies(router.pipeline)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    envelope: dict[str, Any] = {
        "format": FORMAT,
        "format_version": 1 if router.scorer == "pipeline" else FORMAT_VERSION,
        "pipeline": router.pipeline if router.scorer == "pipeline" else None,
        "platt": [float(router.platt.a), float(router.platt.b)],
        "thresholds": [float(t) for t in router.thresholds],
        "metadata": json.dumps(router.metadata, sort_keys=True, ensure_ascii=False),
    }
    if router.scorer != "pipeline":
        envelope["scorer"] = router.scorer
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        sio.dump(envelope, tmp, compression=zipfile.ZIP_DEFLATED, compresslevel=9)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a router file is not a secret
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load_router(path: str | Path) -> TrainedRouter:
    """Load and validate a router file; compiles the request-path scorer so a bad file fails here, not on
    the first request. Raises :class:`RouterFileError` (missing, corrupt, untrusted, incompatible)."""
    import skops.io as sio

    path = Path(path)
    if not path.is_file():
        raise RouterFileError(path, "not found")
    try:
        untrusted = sio.get_untrusted_types(file=path)
    except Exception as exc:  # zipfile.BadZipFile, JSON errors, KeyError on a missing schema...
        raise RouterFileError(path, f"corrupt or not a skops archive ({type(exc).__name__}: {exc})") from None
    extra = sorted(set(untrusted) - set(TRUSTED_TYPES))
    if extra:
        raise RouterFileError(path, f"refusing to load untrusted types {extra}")
    try:
        obj = sio.load(path, trusted=list(untrusted))
    except Exception as exc:
        raise RouterFileError(path, f"corrupt ({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise RouterFileError(path, f"not a ThinkGate router (expected format {FORMAT!r})")
    version = obj.get("format_version")
    if version not in READABLE_VERSIONS:
        raise RouterFileError(path, f"incompatible format_version {version!r} (this build reads "
                                    f"{', '.join(map(str, READABLE_VERSIONS))})")
    try:
        metadata = json.loads(obj["metadata"])
        a, b = (float(x) for x in obj["platt"])
        thresholds = [float(t) for t in obj["thresholds"]]
        scorer = obj.get("scorer", "pipeline") if version >= 2 else "pipeline"
        router = TrainedRouter(pipeline=obj["pipeline"], platt=Platt(a, b), thresholds=thresholds, metadata=metadata,
                               scorer=scorer)
        router.fast  # noqa: B018  (compile now: validates the pipeline's shape)
    except (KeyError, TypeError, ValueError) as exc:
        raise RouterFileError(path, f"incompatible contents ({type(exc).__name__}: {exc})") from None
    if thresholds != sorted(thresholds) or any(not 0.0 <= t <= 1.0 for t in thresholds):
        raise RouterFileError(path, f"thresholds must be ascending values in [0, 1], got {thresholds}")
    return router


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata dict of a router file plus its thresholds (loads the file; same errors as load)."""
    r = load_router(path)
    return {**r.metadata, "thresholds": r.thresholds, "platt": [r.platt.a, r.platt.b]}
