"""Single-request scoring without sklearn's per-call overhead (~3–8 ms → ~0.1–0.3 ms).

:meth:`FastScorer.compile` reads the fitted Pipeline of :func:`router.model.build_pipeline` (vocabularies,
idf, scaler, coefficients) into flat NumPy arrays; :meth:`FastScorer.score` then computes, for one string,
exactly what ``sigmoid(a · pipeline.decision_function([text])[0] + b)`` computes:

* word block: ``\\w+`` tokens of the lowercased text, n-grams joined by one space (sklearn's
  ``_word_ngrams``); characters block: lowercase, runs of ≥2 whitespace → one space, all n-grams
  (sklearn's ``_char_ngrams``). Both go through an :class:`_NgramTrie`: symbols (tokens / code points) map
  to integer ids, and each n-gram level is one vectorised table lookup — no per-n-gram Python work;
* TF-IDF with sublinear tf and a per-block L2 norm: for a term seen ``c`` times, ``v = (1 + ln c)·idf`` and the
  block contributes ``Σ v·w / ‖v‖``. Sums run over occurrences (``g(c)/c`` per occurrence), so one
  ``bincount`` gives the counts and ``np.add.reduceat`` splits the sums into the word and char blocks;
* hand block: token families from the token ids, then the shared
  :func:`router.features.assemble_hand_features`, standardised (folded into the weights), dotted with ``w``.

The cost is dominated by the number of NumPy calls (a few µs each on a busy host), which is why the code
avoids masks and per-level reductions. Equality with the Pipeline: ``tests/router/test_router_fastpath.py``.

:func:`pipeline_arrays` is the part of the compilation that reads the Pipeline; its output is plain arrays that
router files carry (``"fast"``), so :meth:`FastScorer.from_arrays` builds the scorer without scikit-learn.
"""

from __future__ import annotations

import math
import re
from itertools import pairwise, repeat
from typing import Any

import numpy as np

from router.features import (
    FAMILY_OF,
    HOW_BIGRAMS,
    N_FAMILIES,
    N_QA_CLASSES,
    QA_CLASS_OF,
    VAR_LETTERS,
    WORD_RE,
    assemble_hand_features,
    assemble_qa_features,
    clip_text,
    feature_names,
)

_WHITE_SPACES = re.compile(r"\s\s+")  # sklearn.feature_extraction.text._VectorizerMixin._white_spaces
#: Largest dense transition table (entries) before a level falls back to sorted-key search.
DENSE_LIMIT = 1 << 22
#: Version of the :func:`pipeline_arrays` layout (the ``"fast"`` block of a router file).
FAST_LAYOUT = 1


def _encode_terms(terms: list[str]) -> tuple[np.ndarray, np.ndarray]:
    # UTF-8 bytes of all terms back to back + (n+1) offsets: no separator can collide with a term's characters,
    # and NumPy's fixed-width str arrays would drop trailing NULs.
    blobs = [t.encode("utf-8", "surrogatepass") for t in terms]
    offsets = np.zeros(len(blobs) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in blobs], out=offsets[1:])
    return np.frombuffer(b"".join(blobs), dtype=np.uint8).copy(), offsets


def _decode_terms(data: np.ndarray, offsets: np.ndarray) -> list[str]:
    raw = np.asarray(data, dtype=np.uint8).tobytes()
    ends = np.asarray(offsets, dtype=np.int64).tolist()
    if not ends or ends[0] != 0 or ends[-1] != len(raw) or any(b < a for a, b in pairwise(ends)):
        raise ValueError("term offsets do not match the term bytes")
    return [raw[a:b].decode("utf-8", "surrogatepass") for a, b in pairwise(ends)]


def _terms_by_column(vocabulary: dict[Any, Any]) -> list[str]:
    terms = [""] * len(vocabulary)
    seen = [False] * len(vocabulary)
    for term, col in vocabulary.items():
        c = int(col)
        if not 0 <= c < len(terms) or seen[c]:
            raise ValueError("vocabulary columns are not 0..n-1")
        terms[c], seen[c] = str(term), True
    return terms


def pipeline_arrays(pipeline: Any) -> dict[str, Any]:
    """The plain arrays the fast path needs, read from a fitted :func:`router.model.build_pipeline` Pipeline.

    A dict of str → int / float / str / list / float64 or integer ndarray (skops-safe: no pickle, no sklearn
    types), stored in router files as their ``"fast"`` block (:mod:`router.persistence`) so that serving builds
    :meth:`FastScorer.from_arrays` without scikit-learn. Keys: ``layout`` (:data:`FAST_LAYOUT`), ``max_chars``,
    ``token_pattern``, ``feature_set`` (``"base"`` / ``"qa"``, :func:`router.features.feature_names`),
    ``hand_features`` (names), ``word_ngram_range`` / ``char_ngram_range`` ([lo, hi]),
    ``word_terms`` / ``char_terms`` (uint8: UTF-8 of the vocabulary terms in column order, back to back) with
    ``word_term_offsets`` / ``char_term_offsets`` (int64, n+1), ``word_idf`` / ``char_idf`` (float64, n),
    ``coef`` (float64, n_word + n_char + n_hand), ``intercept`` (float), ``hand_mean`` / ``hand_scale``
    (float64, n_hand: the StandardScaler, 0 / 1 where it does not centre / scale).
    Raises ValueError if the Pipeline does not have that shape (steps, vectorizer settings).
    """
    try:
        clip = pipeline.named_steps["clip"]
        union = pipeline.named_steps["features"]
        clf = pipeline.named_steps["clf"]
        parts = dict(union.transformer_list)
        word_vec, char_vec, hand = parts["word"], parts["char"], parts["hand"]
        scaler = hand.named_steps["scale"]
        feature_set = getattr(hand.named_steps["extract"], "feature_set", "base")
        names = feature_names(feature_set)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a ThinkGate router pipeline: {exc}") from exc
    if [name for name, _ in union.transformer_list] != ["word", "char", "hand"]:
        raise ValueError("feature union must be [word, char, hand]")
    for vec, analyzer in ((word_vec, "word"), (char_vec, "char")):
        if (
            vec.analyzer != analyzer
            or not vec.lowercase
            or vec.strip_accents
            or vec.preprocessor is not None
            or vec.tokenizer is not None
            or vec.stop_words is not None
            or vec.norm != "l2"
            or not vec.use_idf
            or not vec.sublinear_tf
            or vec.binary
        ):
            raise ValueError(f"unsupported {analyzer} vectorizer settings for the fast path")
    if word_vec.token_pattern != WORD_RE.pattern:
        raise ValueError("word vectorizer token_pattern differs from router.features.WORD_PATTERN")
    coef = np.asarray(clf.coef_, dtype=np.float64).ravel()
    n_hand = scaler.mean_.shape[0]
    if n_hand != len(names):
        raise ValueError("coefficient count does not match the feature blocks")
    word_data, word_off = _encode_terms(_terms_by_column(word_vec.vocabulary_))
    char_data, char_off = _encode_terms(_terms_by_column(char_vec.vocabulary_))
    return {
        "layout": FAST_LAYOUT,
        "max_chars": int(clip.max_chars),
        "token_pattern": WORD_RE.pattern,
        "feature_set": feature_set,
        "hand_features": list(names),
        "word_ngram_range": [int(x) for x in word_vec.ngram_range],
        "char_ngram_range": [int(x) for x in char_vec.ngram_range],
        "word_terms": word_data,
        "word_term_offsets": word_off,
        "char_terms": char_data,
        "char_term_offsets": char_off,
        "word_idf": np.asarray(word_vec.idf_, dtype=np.float64),
        "char_idf": np.asarray(char_vec.idf_, dtype=np.float64),
        "coef": coef,
        "intercept": float(np.asarray(clf.intercept_).ravel()[0]),
        "hand_mean": np.asarray(scaler.mean_, dtype=np.float64) if scaler.with_mean else np.zeros(n_hand),
        "hand_scale": np.asarray(scaler.scale_, dtype=np.float64) if scaler.with_std else np.ones(n_hand),
    }




class _NgramTrie:
    """Vectorised n-gram → column lookup over integer symbol ids (0 = a symbol in no vocabulary term).

    States of level n are the distinct n-prefixes of vocabulary terms (state 0 = dead). Level-1 states are the
    symbol ids; level n is reached from level n-1 by a transition on the n-th symbol, stored as a dense flat
    ``(S_{n-1}+1)·(n_symbols+1)`` int32 table when small (one gather per level), else as sorted int64 keys
    ``state·base + symbol`` searched with ``np.searchsorted``. ``cols[n][state]`` is the (global) column of
    the n-gram, or ``missing`` — a dummy column with zero weight — when that prefix is not itself a term.
    """

    def __init__(
        self, terms: list[tuple[tuple[int, ...], int]], n_symbols: int, ngram_range: tuple[int, int], missing: int
    ) -> None:
        self.min_n, self.max_n = ngram_range
        self.base = n_symbols + 1
        self.cols: dict[int, np.ndarray] = {}
        self.dense: dict[int, np.ndarray] = {}
        self.sorted: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        col1 = np.full(self.base, missing, dtype=np.int64)
        for term, col in terms:
            if len(term) == 1:
                col1[term[0]] = col
        self.cols[1] = col1
        prev_state: dict[tuple[int, ...], int] = {(i,): i for i in range(1, self.base)}
        for n in range(2, self.max_n + 1):
            state: dict[tuple[int, ...], int] = {}
            for term, _ in terms:
                if len(term) >= n and term[:n] not in state:
                    state[term[:n]] = len(state) + 1
            cols = np.full(len(state) + 1, missing, dtype=np.int64)
            for term, col in terms:
                if len(term) == n:
                    cols[state[term]] = col
            self.cols[n] = cols
            src = np.fromiter((prev_state[p[:-1]] for p in state), dtype=np.int64, count=len(state))
            sym = np.fromiter((p[-1] for p in state), dtype=np.int64, count=len(state))
            dst = np.arange(1, len(state) + 1, dtype=np.int64)
            rows = len(prev_state) + 1
            if rows * self.base <= DENSE_LIMIT:
                table = np.zeros(rows * self.base, dtype=np.int32)
                table[src * self.base + sym] = dst
                self.dense[n] = table
            else:
                keys = src * self.base + sym
                order = np.argsort(keys, kind="stable")
                self.sorted[n] = (keys[order], dst[order])
            prev_state = state

    def lookup(self, ids: np.ndarray, out: list[np.ndarray]) -> None:
        """Append to ``out`` the columns of every n-gram (min_n ≤ n ≤ max_n) of ``ids`` (L,), one array per n."""
        s = ids
        if self.min_n <= 1:
            out.append(self.cols[1][s])
        base = self.base
        for n in range(2, self.max_n + 1):
            if s.shape[0] < 2:
                return
            k = s[:-1] * base
            k += ids[n - 1 :]
            table = self.dense.get(n)
            if table is not None:
                s = table[k]
            else:
                keys, dst = self.sorted[n]
                if keys.size == 0:
                    return
                pos = np.minimum(np.searchsorted(keys, k), keys.size - 1)
                s = np.where(keys[pos] == k, dst[pos], 0)
            if n >= self.min_n:
                out.append(self.cols[n][s])


class FastScorer:
    """The compiled scorer. Build with :meth:`compile`; read-only afterwards, so thread-safe."""

    def __init__(
        self,
        *,
        max_chars: int,
        word_trie: _NgramTrie,
        word_ids: dict[str, int],
        token_attr: np.ndarray,
        char_trie: _NgramTrie,
        char_lut: np.ndarray,
        n_word_cols: int,
        idf_w: np.ndarray,
        idf_sq: np.ndarray,
        max_count: int,
        hand_w: np.ndarray,
        hand_offset: float,
        intercept: float,
        platt_a: float,
        platt_b: float,
        qa: bool = False,
    ) -> None:
        self.qa = qa
        # QA token classes (N_QA_CLASSES = none) and the how-many bigrams, by token id
        n_ids = token_attr.shape[0]
        self.qa_attr = np.full(n_ids, N_QA_CLASSES, dtype=np.int64)
        self.how_pairs: list[tuple[int, np.ndarray]] = []
        if qa:
            for tok, i in word_ids.items():
                self.qa_attr[i] = QA_CLASS_OF.get(tok, N_QA_CLASSES)
            for first, seconds in HOW_BIGRAMS.items():
                mask = np.zeros(n_ids, dtype=bool)
                mask[[word_ids[t] for t in seconds]] = True
                self.how_pairs.append((word_ids[first], mask))
        self.max_chars = max_chars
        self.word_trie, self.word_ids, self.token_attr = word_trie, word_ids, token_attr
        self.char_trie, self.char_lut = char_trie, char_lut
        self.n_word_cols = n_word_cols
        self.n_cols = idf_w.shape[0]  # word + char + 1 dummy
        self.idf_w, self.idf_sq = idf_w, idf_sq
        c = np.arange(max_count + 1, dtype=np.float64)
        c[0] = 1.0
        f = 1.0 + np.log(c)
        self.f_over_c, self.f2_over_c = f / c, f * f / c
        self.hand_w = [float(x) for x in hand_w]
        self.hand_offset = hand_offset
        self.intercept, self.platt_a, self.platt_b = intercept, platt_a, platt_b

    @classmethod
    def compile(cls, pipeline: Any, platt: Any) -> FastScorer:
        """Read a fitted :func:`router.model.build_pipeline` Pipeline and a :class:`router.model.Platt`.

        Same as ``from_arrays(pipeline_arrays(pipeline), platt)``. Raises ValueError if the Pipeline does not
        have that shape (steps, vectorizer settings), so a file fitted with other options is refused instead of
        scored wrongly. Takes ~0.1 s.
        """
        return cls.from_arrays(pipeline_arrays(pipeline), platt)

    @classmethod
    def from_arrays(cls, arrays: dict[str, Any], platt: Any) -> FastScorer:
        """Build the scorer from :func:`pipeline_arrays` output (as stored in a router file's ``"fast"`` block)
        and a Platt ``(a, b)`` (anything with ``.a`` and ``.b``). NumPy only: no scikit-learn needed.

        Raises ValueError when the arrays were written for another layout, token pattern or hand-feature list
        than this build computes, or their shapes disagree. Takes ~0.1 s (building the n-gram tries).
        """
        try:
            layout = int(arrays["layout"])
            if layout != FAST_LAYOUT:
                raise ValueError(f"fast-path layout {layout} (this build reads {FAST_LAYOUT})")
            if arrays["token_pattern"] != WORD_RE.pattern:
                raise ValueError("token_pattern differs from router.features.WORD_PATTERN")
            feature_set = str(arrays.get("feature_set", "base"))
            names = feature_names(feature_set)  # ValueError for a set this build does not know
            if list(arrays["hand_features"]) != list(names):
                raise ValueError(f"hand feature list differs from router.features.feature_names({feature_set!r})")
            word_vocab = _decode_terms(arrays["word_terms"], arrays["word_term_offsets"])
            char_vocab = _decode_terms(arrays["char_terms"], arrays["char_term_offsets"])
            word_range = (int(arrays["word_ngram_range"][0]), int(arrays["word_ngram_range"][1]))
            char_range = (int(arrays["char_ngram_range"][0]), int(arrays["char_ngram_range"][1]))
            max_chars = int(arrays["max_chars"])
            word_idf = np.asarray(arrays["word_idf"], dtype=np.float64)
            char_idf = np.asarray(arrays["char_idf"], dtype=np.float64)
            coef = np.asarray(arrays["coef"], dtype=np.float64).ravel()
            intercept = float(arrays["intercept"])
            mean = np.asarray(arrays["hand_mean"], dtype=np.float64)
            scale = np.asarray(arrays["hand_scale"], dtype=np.float64)
        except (KeyError, IndexError, TypeError) as exc:
            raise ValueError(f"incomplete fast-path arrays: {type(exc).__name__}: {exc}") from None
        n_word, n_char, n_hand = len(word_vocab), len(char_vocab), len(names)
        if word_idf.shape != (n_word,) or char_idf.shape != (n_char,):
            raise ValueError("idf lengths do not match the vocabularies")
        if coef.shape[0] != n_word + n_char + n_hand or mean.shape != (n_hand,) or scale.shape != (n_hand,):
            raise ValueError("coefficient count does not match the feature blocks")
        dummy = n_word + n_char
        idf = np.concatenate([word_idf, char_idf, [0.0]])
        w = np.concatenate([coef[:dummy], [0.0]])

        # word symbols: tokens of vocabulary terms, plus the hand features' family words and variable letters
        word_ids: dict[str, int] = {}
        extra = (*QA_CLASS_OF, *HOW_BIGRAMS, *(t for v in HOW_BIGRAMS.values() for t in sorted(v))) \
            if feature_set == "qa" else ()
        for tok in (*FAMILY_OF, *sorted(VAR_LETTERS), *extra):
            word_ids.setdefault(tok, len(word_ids) + 1)
        word_terms = []
        for col, term in enumerate(word_vocab):
            toks = tuple(word_ids.setdefault(t, len(word_ids) + 1) for t in term.split(" "))
            word_terms.append((toks, col))
        word_trie = _NgramTrie(word_terms, len(word_ids), word_range, dummy)
        # per token id: family 0..N_FAMILIES-1, N_FAMILIES = variable letter, N_FAMILIES + 1 = neither
        token_attr = np.full(len(word_ids) + 1, N_FAMILIES + 1, dtype=np.int64)
        for tok, i in word_ids.items():
            token_attr[i] = FAMILY_OF.get(tok, N_FAMILIES if tok in VAR_LETTERS else N_FAMILIES + 1)

        # char symbols: code points of vocabulary terms; a LUT maps code point → id (0 beyond its end)
        alphabet = sorted({ord(ch) for term in char_vocab for ch in term})
        sym = {cp: i + 1 for i, cp in enumerate(alphabet)}
        char_lut = np.zeros((alphabet[-1] + 2) if alphabet else 1, dtype=np.int64)
        for cp, i in sym.items():
            char_lut[cp] = i
        char_terms = [(tuple(sym[ord(ch)] for ch in t), n_word + c) for c, t in enumerate(char_vocab)]
        char_trie = _NgramTrie(char_terms, len(alphabet), char_range, dummy)

        hand_w = coef[dummy:] / scale  # (x - mean)/scale · w  =  x · (w/scale) - mean · (w/scale)
        levels = sum(n >= 1 for n in range(word_range[0], word_range[1] + 1)) + sum(
            n >= 1 for n in range(char_range[0], char_range[1] + 1)
        )
        return cls(
            max_chars=max_chars,
            word_trie=word_trie,
            word_ids=word_ids,
            token_attr=token_attr,
            char_trie=char_trie,
            char_lut=char_lut,
            n_word_cols=n_word,
            idf_w=idf * w,
            idf_sq=idf * idf,
            # the dummy column may collect every n-gram of every level of the clipped text
            max_count=levels * (max_chars + 2),
            hand_w=hand_w,
            hand_offset=float(mean @ hand_w),
            intercept=intercept,
            platt_a=float(platt.a),
            platt_b=float(platt.b),
            qa=feature_set == "qa",
        )

    # ---- request path -------------------------------------------------------------------------------------

    def logit(self, text: str) -> float:
        """The Pipeline's ``decision_function`` for one string (float)."""
        text = clip_text(text, self.max_chars)
        lower = text.lower()
        tokens = WORD_RE.findall(lower)
        tok_ids = np.fromiter(map(self.word_ids.get, tokens, repeat(0)), dtype=np.int64, count=len(tokens))
        parts: list[np.ndarray] = []
        self.word_trie.lookup(tok_ids, parts)
        n_word = sum(p.shape[0] for p in parts)  # occurrences [0, n_word) are the word block's
        doc = _WHITE_SPACES.sub(" ", lower)
        if doc:
            lut = self.char_lut
            cps = np.frombuffer(doc.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
            self.char_trie.lookup(lut[np.minimum(cps, lut.shape[0] - 1)], parts)
        z = self.intercept
        if parts:
            cols = np.concatenate(parts)
            cnt = np.bincount(cols, minlength=self.n_cols)[cols]
            num = self.f_over_c[cnt]
            num *= self.idf_w[cols]
            den = self.f2_over_c[cnt]
            den *= self.idf_sq[cols]
            n = cols.shape[0]
            if 0 < n_word < n:
                sums = zip(np.add.reduceat(num, [0, n_word]).tolist(), np.add.reduceat(den, [0, n_word]).tolist(),
                           strict=True)
            else:
                sums = zip([float(num.sum())], [float(den.sum())], strict=True)
            for a, b in sums:
                if b > 0:
                    z += a / math.sqrt(b)
        attr = np.bincount(self.token_attr[tok_ids], minlength=N_FAMILIES + 2).tolist()
        h = assemble_hand_features(text, len(tokens), attr[:N_FAMILIES], attr[N_FAMILIES])
        if self.qa:
            qc = np.bincount(self.qa_attr[tok_ids], minlength=N_QA_CLASSES + 1).tolist()
            how = False
            if tok_ids.shape[0] > 1:
                head, tail = tok_ids[:-1], tok_ids[1:]
                how = any(bool((mask[tail] & (head == first)).any()) for first, mask in self.how_pairs)
            h += assemble_qa_features(text, qc[:N_QA_CLASSES], how)
        return z + sum(map(float.__mul__, h, self.hand_w)) - self.hand_offset

    def score(self, text: str) -> float:
        """P(needs long) in [0, 1] for one string."""
        z = self.platt_a * self.logit(text) + self.platt_b
        if z >= 0:
            return 1.0 / (1.0 + math.exp(-z))
        ez = math.exp(z)
        return ez / (1.0 + ez)
