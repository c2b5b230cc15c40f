"""Router files: skops (no pickle), a versioned envelope, metadata, and clear errors.

A router file is a skops archive (``skops.io.dump``, zip-deflated) of one dict::

    {"format": "thinkgate-router", "format_version": 1, "pipeline": <fitted sklearn Pipeline>,
     "platt": [a, b], "thresholds": [float, ...], "metadata": "<JSON text>",
     "fast": {<router.fastpath.pipeline_arrays: str → int | float | str | list | ndarray>}}  # version 1

``"fast"`` (optional; every file written by this build has it) holds the request-path scorer's arrays —
vocabularies, idf, coefficients, the hand-feature scaler —, so that serving
(``load_router(path, pipeline=False)``) reads the file with :func:`router.archive.read_plain` and builds
:class:`router.fastpath.FastScorer` with NumPy only: neither skops.io nor scikit-learn nor SciPy is imported
(~250 MiB less resident memory). It is an additive key: a reader that does not know it ignores it and compiles
the same scorer from the pipeline, so the format version stays 1. A file without it (written before), or one
:func:`router.archive.read_plain` cannot read alone, is loaded through skops as before.

Version 2 (written only for the model-free baselines, so version-1 readers keep reading every learned file)
adds ``"scorer": "length" | "hash"`` with ``"pipeline": None`` and no ``"fast"`` block
(:func:`router.model.length_prior`, :func:`router.model.hash_score`); this build reads both versions, and
serves both without scikit-learn.

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
from typing import TYPE_CHECKING, Any

from router.errors import ThinkGateError
from router.model import Platt, TrainedRouter

if TYPE_CHECKING:
    from router.archive import NodeType
    from router.fastpath import FastScorer

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

    from router.fastpath import pipeline_arrays

    if router.scorer == "pipeline" and router.pipeline is None:
        raise ValueError("cannot save a router loaded without its pipeline (load_router(path, pipeline=False))")
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
    if router.scorer == "pipeline":
        envelope["fast"] = pipeline_arrays(router.pipeline)
    else:
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


def load_router(path: str | Path, *, pipeline: bool = True) -> TrainedRouter:
    """Load and validate a router file; builds the request-path scorer so a bad file fails here, not on the
    first request. Raises :class:`RouterFileError` (missing, corrupt, untrusted, incompatible).

    ``pipeline=False`` (serving): when the file carries its fast-path arrays, read it without skops and return
    a router with ``pipeline=None`` that scores through those arrays (NumPy only); a file without them is
    loaded in full as with ``pipeline=True``. ``pipeline=True``: the skops load with the sklearn Pipeline (the
    batched reference path, refitting, calibration); scoring still uses the stored arrays when present.
    """
    path = Path(path)
    if not path.is_file():
        raise RouterFileError(path, "not found")
    if not pipeline:
        from router.archive import UnsupportedArchive, read_plain

        try:
            obj, skipped = read_plain(path, skip=("pipeline",))
        except (OSError, zipfile.BadZipFile) as exc:
            raise RouterFileError(path, f"corrupt or not a skops archive ({type(exc).__name__}: {exc})") from None
        except UnsupportedArchive:
            obj, skipped = None, {}  # not plain data outside the pipeline: let skops judge it
        # The pipeline is not built here, but a file whose pipeline names anything but what build_pipeline
        # writes goes through skops' own trust check below, so both paths accept and refuse the same files.
        needs_no_pipeline = obj is not None and ("fast" in obj or obj.get("scorer", "pipeline") != "pipeline")
        if needs_no_pipeline and skipped.get("pipeline", set()) <= _known_pipeline_types():
            try:
                return _router_from_envelope(path, obj, None)
            except _FastBlockUnusable:
                pass  # e.g. written by a newer build with another layout: compile from the pipeline instead
    return _router_from_envelope(path, _load_skops(path), _MISSING)


_MISSING: Any = object()  # "take the pipeline from the envelope"


def _known_pipeline_types() -> set[NodeType]:
    # What build_pipeline's fitted Pipeline serialises to (a subset of skops' default trusted types + ours).
    plain = {("builtins", c, loader) for c, loader in (("dict", "DictNode"), ("list", "ListNode"),
                                                        ("tuple", "TupleNode"), ("str", "JsonNode"))}
    plain |= {("builtins", c, "TypeNode") for c in ("str", "int", "float", "bool")}
    plain |= {("numpy", c, loader) for c in ("ndarray", "float64", "int64", "int32", "uint8")
              for loader in ("NdArrayNode", "TypeNode")}
    objects = {
        ("sklearn.pipeline", "Pipeline"), ("sklearn.pipeline", "FeatureUnion"),
        ("sklearn.feature_extraction.text", "TfidfVectorizer"), ("sklearn.feature_extraction.text", "TfidfTransformer"),
        ("sklearn.linear_model._logistic", "LogisticRegression"), ("sklearn.preprocessing._data", "StandardScaler"),
        *(tuple(t.rsplit(".", 1)) for t in TRUSTED_TYPES),
    }
    return plain | {(m, c, "ObjectNode") for m, c in objects}


class _FastBlockUnusable(Exception):
    pass


def _load_skops(path: Path) -> Any:
    import skops.io as sio

    try:
        untrusted = sio.get_untrusted_types(file=path)
    except Exception as exc:  # zipfile.BadZipFile, JSON errors, KeyError on a missing schema...
        raise RouterFileError(path, f"corrupt or not a skops archive ({type(exc).__name__}: {exc})") from None
    extra = sorted(set(untrusted) - set(TRUSTED_TYPES))
    if extra:
        raise RouterFileError(path, f"refusing to load untrusted types {extra}")
    try:
        return sio.load(path, trusted=list(untrusted))
    except Exception as exc:
        raise RouterFileError(path, f"corrupt ({type(exc).__name__}: {exc})") from None


def _router_from_envelope(path: Path, obj: Any, pipeline: Any) -> TrainedRouter:
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
        platt = Platt(a, b)
        scorer = obj.get("scorer", "pipeline") if version >= 2 else "pipeline"
        pipe = obj["pipeline"] if pipeline is _MISSING else pipeline
        if scorer != "pipeline":  # a model-free baseline: nothing to compile
            router = TrainedRouter(pipeline=None, platt=platt, thresholds=thresholds, metadata=metadata,
                                   scorer=scorer)
            router.fast  # noqa: B018
        else:
            try:
                fast = _fast_scorer(obj.get("fast"), platt)
            except ValueError:
                if pipe is None:
                    raise _FastBlockUnusable from None
                fast = None
            if fast is None:  # a file written before the "fast" block: compile it from the pipeline
                router = TrainedRouter(pipeline=pipe, platt=platt, thresholds=thresholds, metadata=metadata)
                router.fast  # noqa: B018  (compile now: validates the pipeline's shape)
            else:
                router = TrainedRouter.from_fast(fast, platt, thresholds, metadata, pipeline=pipe)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise RouterFileError(path, f"incompatible contents ({type(exc).__name__}: {exc})") from None
    if thresholds != sorted(thresholds) or any(not 0.0 <= t <= 1.0 for t in thresholds):
        raise RouterFileError(path, f"thresholds must be ascending values in [0, 1], got {thresholds}")
    return router


def _fast_scorer(arrays: Any, platt: Platt) -> FastScorer | None:
    if arrays is None:
        return None
    from router.fastpath import FastScorer

    if not isinstance(arrays, dict):
        raise ValueError("the 'fast' block is not a dict")
    return FastScorer.from_arrays(arrays, platt)


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata dict of a router file plus its thresholds (loads it for serving; same errors as load)."""
    r = load_router(path, pipeline=False)
    return {**r.metadata, "thresholds": r.thresholds, "platt": [r.platt.a, r.platt.b]}
