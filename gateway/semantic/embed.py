"""Embedders for the semantic cache: text → a :class:`Sketch` (LSH band hashes + a payload to score with).

Two kinds, chosen by ``cache.semantic.embedder``:

- ``lexical`` (:class:`LexicalEmbedder`, built in, no model, no network): the normalised tokens of
  ``gateway/semantic/guard.py`` → a set of features (character 4-grams of each token with word
  boundaries, and word bigrams) → a 128-value MinHash signature (32-bit multiply-shift hashes of CRC-32
  feature ids, fixed seeds, so every replica computes the same one). Similarity = the fraction of equal
  signature values, an unbiased estimate of the Jaccard similarity of the feature sets (±0.04 at 0.8).
- ``openai:<tier>`` (:class:`OpenAIEmbedder`): ``POST {tier.base_url}/embeddings`` with ``model =
  tier.model`` (any OpenAI-compatible server, e.g. vLLM serving an embedding model); the vector is
  L2-normalised and stored as float16. Similarity = cosine. The call's ``usage.prompt_tokens`` are reported
  on the sketch so the caller can meter them at the tier's input price.

Both give 16 band hashes (LSH): MinHash in bands of 8 values, dense vectors as 16 × 8 random-hyperplane bits
(SimHash, fixed seed per dimension). Two texts become lookup candidates when at least one band agrees:
for MinHash that is ``1 − (1 − J⁸)¹⁶`` — 0.95 at Jaccard 0.8, 0.61 at 0.7, under 0.03 at 0.4.
"""

from __future__ import annotations

import hashlib
import itertools
import zlib
from dataclasses import dataclass, replace
from typing import Protocol

import httpx
import numpy as np

from gateway.config import TierConfig
from gateway.openai.usage import estimate_prompt, usage_counts
from gateway.semantic.guard import tokens
from router.errors import ThinkGateError

NUM_PERM = 128
BANDS = 16
ROWS = NUM_PERM // BANDS
_SEED = 0x7467_5345  # "tgSE": the signatures must be the same in every process and release
_MASK64 = (1 << 64) - 1


class EmbedError(ThinkGateError, RuntimeError):
    """The embedder could not produce a sketch (upstream down or answering nonsense): bypass the cache."""


@dataclass(frozen=True, slots=True)
class Sketch:
    """``kind``: ``minhash`` | ``dense``; ``bands``: :data:`BANDS` hex band hashes; ``payload``: the bytes the
    similarity is computed from (uint32 signature, or float16 unit vector); ``tokens``: upstream tokens the
    embedding cost (0 for ``lexical``); ``counted``: the upstream sent no usage to trust, ``tokens`` is the input
    counted by the gateway."""

    kind: str
    bands: tuple[str, ...]
    payload: bytes
    tokens: int = 0
    counted: bool = False

    def similarity(self, other_kind: str, other_payload: bytes) -> float:
        """Similarity in [0, 1] with a stored sketch; 0.0 when the kinds or sizes differ."""
        if other_kind != self.kind or len(other_payload) != len(self.payload):
            return 0.0
        if self.kind == "minhash":
            a = np.frombuffer(self.payload, dtype=np.uint32)
            b = np.frombuffer(other_payload, dtype=np.uint32)
            return float(np.count_nonzero(a == b)) / a.size
        a16 = np.frombuffer(self.payload, dtype=np.float16).astype(np.float32)
        b16 = np.frombuffer(other_payload, dtype=np.float16).astype(np.float32)
        return max(0.0, min(1.0, float(a16 @ b16)))


    def similarities(self, others: list[tuple[str, bytes]]) -> list[float]:
        """:meth:`similarity` with each ``(kind, payload)`` of ``others`` (the same values); MinHash in one
        vectorised pass."""
        if self.kind != "minhash":
            return [self.similarity(kind, payload) for kind, payload in others]
        out = [0.0] * len(others)
        size = len(self.payload)
        same = [i for i, (kind, payload) in enumerate(others) if kind == "minhash" and len(payload) == size]
        if same:
            mine = np.frombuffer(self.payload, dtype=np.uint32)
            theirs = np.frombuffer(b"".join(others[i][1] for i in same), dtype=np.uint32).reshape(len(same), -1)
            for i, equal in zip(same, np.count_nonzero(theirs == mine, axis=1).tolist(), strict=True):
                out[i] = float(equal) / mine.size
        return out


class Embedder(Protocol):
    """``name`` identifies the embedder (and its version) in the index: entries of different embedders never
    meet. ``sketch`` raises :class:`EmbedError` when it cannot answer."""

    name: str
    exact_words: bool  # the guard requires the same content words (a lexical similarity knows no synonyms)

    async def sketch(self, text: str) -> Sketch: ...


def _band_hashes(values: np.ndarray) -> tuple[str, ...]:
    rows = values.reshape(BANDS, -1)
    return tuple(hashlib.blake2b(r.tobytes(), digest_size=8).hexdigest() for r in rows)


def _multiply_shift_params() -> tuple[np.ndarray, np.ndarray]:
    """128 (a odd, b) pairs from BLAKE2b of fixed labels: the same in every process, platform and numpy version
    (numpy's ``Generator`` streams may change between releases; a changed signature would orphan every entry)."""
    def word(label: str) -> int:
        return int.from_bytes(hashlib.blake2b(label.encode(), digest_size=8).digest(), "little")

    a = np.array([word(f"thinkgate-minhash-a-{i}") | 1 for i in range(NUM_PERM)], dtype=np.uint64)
    b = np.array([word(f"thinkgate-minhash-b-{i}") for i in range(NUM_PERM)], dtype=np.uint64)
    return a, b


def feature_set(text: str) -> set[bytes]:
    """The lexical features of ``text``: character 4-grams of each normalised token (``^`` and ``$`` mark the
    word ends; shorter tokens whole) and word bigrams."""
    return {f.encode() for f in _features(text)}


def _features(text: str) -> set[str]:
    """:func:`feature_set` as text (deduplicated before encoding: the sketch's hot loop)."""
    toks = tokens(text)
    ends = [f"^{t}$" for t in toks]
    feats = {w[i:i + 4] for w in ends for i in range(len(w) - 3)}  # a 4-character token: itself
    feats.update([w for w in ends if len(w) < 4])
    feats.update([f"{x} {y}\x01" for x, y in itertools.pairwise(toks)])
    return feats


class LexicalEmbedder:
    """MinHash over character/word n-grams; see the module doc. Stateless apart from its hash parameters."""

    name = "lexical-v1"
    exact_words = True

    def __init__(self) -> None:
        self._a, self._b = _multiply_shift_params()

    def signature(self, text: str) -> np.ndarray:
        """The 128 MinHash values (uint32) of ``text``; all 0xFFFFFFFF for a text without features."""
        feats = _features(text)
        if not feats:
            return np.full(NUM_PERM, 0xFFFFFFFF, dtype=np.uint32)
        h = np.fromiter(map(zlib.crc32, map(str.encode, feats)), dtype=np.uint64, count=len(feats))
        with np.errstate(over="ignore"):
            mixed = (h[:, None] * self._a[None, :] + self._b[None, :]) >> np.uint64(32)
        return mixed.min(axis=0).astype(np.uint32)

    def sketch_now(self, text: str) -> Sketch:
        """:meth:`sketch` without the coroutine (CPU only, ~50 µs for a short question)."""
        sig = self.signature(text)
        return Sketch("minhash", _band_hashes(sig), sig.tobytes())

    async def sketch(self, text: str) -> Sketch:
        return self.sketch_now(text)


class OpenAIEmbedder:
    """An OpenAI-compatible ``/v1/embeddings`` client for one tier (``openai:<tier>``)."""

    def __init__(self, tier: TierConfig, http: httpx.AsyncClient, timeout_s: float = 2.0) -> None:
        self.tier = tier
        self.http = http
        self.timeout_s = timeout_s
        self.name = f"openai-v1:{tier.name}:{tier.model}"
        self.exact_words = False
        self._planes: dict[int, np.ndarray] = {}

    def _hyperplanes(self, dim: int) -> np.ndarray:
        planes = self._planes.get(dim)
        if planes is None:
            # RandomState: numpy keeps its stream stable across releases (unlike Generator's)
            planes = np.random.RandomState(_SEED + dim).standard_normal((NUM_PERM, dim)).astype(np.float32)
            self._planes[dim] = planes
        return planes

    def sketch_vector(self, vector: list[float], tokens_used: int = 0) -> Sketch:
        """The sketch of an embedding ``vector`` (any length ≥ 1); raises EmbedError for a zero vector."""
        v = np.asarray(vector, dtype=np.float32)
        norm = float(np.linalg.norm(v))
        if v.ndim != 1 or v.size == 0 or not np.isfinite(norm) or norm == 0:
            raise EmbedError("the embedding is empty, zero or not finite")
        v = v / norm
        bits = (self._hyperplanes(v.size) @ v > 0).astype(np.uint8)
        return Sketch("dense", _band_hashes(np.packbits(bits)), v.astype(np.float16).tobytes(), tokens_used)

    async def sketch(self, text: str) -> Sketch:
        headers = {"content-type": "application/json"}
        if self.tier.api_key:
            headers["authorization"] = f"Bearer {self.tier.api_key}"
        url = self.tier.base_url.rstrip("/") + "/embeddings"
        try:
            r = await self.http.post(url, json={"model": self.tier.model, "input": text}, headers=headers,
                                     timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            raise EmbedError(f"embedding upstream {url} failed: {exc!r}") from exc
        if r.status_code != 200:
            raise EmbedError(f"embedding upstream {url} answered {r.status_code}")
        try:
            data = r.json()
            vector = data["data"][0]["embedding"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise EmbedError(f"embedding upstream {url} sent an unreadable answer") from exc
        if not isinstance(vector, list):
            raise EmbedError(f"embedding upstream {url} sent a non-list embedding")
        # metered as POST /v1/embeddings is: a usage missing, negative, fractional or absurd is none to trust — the
        # input is counted instead (it was billed as sent: a 500 on a negative count, $0 on none, any sum on 1e12)
        counts = usage_counts(data.get("usage") if isinstance(data, dict) else None, completion=False)
        if counts is None:
            return replace(self.sketch_vector(vector, estimate_prompt(text)), counted=True)
        return self.sketch_vector(vector, counts[0])


def embedder_for(spec: str, tiers: list[TierConfig], http: httpx.AsyncClient, timeout_s: float) -> Embedder:
    """The embedder named by ``cache.semantic.embedder``: ``lexical`` or ``openai:<tier>``.
    Raises ValueError for an unknown spec or tier (the config validation catches both first)."""
    if spec == "lexical":
        return LexicalEmbedder()
    if spec.startswith("openai:"):
        name = spec.removeprefix("openai:")
        for tier in tiers:
            if tier.name == name:
                return OpenAIEmbedder(tier, http, timeout_s)
        raise ValueError(f"cache.semantic.embedder: unknown tier {name!r}")
    raise ValueError(f"cache.semantic.embedder: unknown embedder {spec!r}")
