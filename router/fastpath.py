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
"""

from __future__ import annotations

import math
import re
from itertools import repeat
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

        Raises ValueError if the Pipeline does not have that shape (steps, vectorizer settings), so a file
        fitted with other options is refused instead of scored wrongly. Takes ~0.1 s.
        """
        try:
            clip = pipeline.named_steps["clip"]
            union = pipeline.named_steps["features"]
            clf = pipeline.named_steps["clf"]
            parts = dict(union.transformer_list)
            word_vec, char_vec, hand = parts["word"], parts["char"], parts["hand"]
            scaler = hand.named_steps["scale"]
            feature_set = getattr(hand.named_steps["extract"], "feature_set", "base")
            n_expected = len(feature_names(feature_set))
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
        n_word, n_char = len(word_vec.vocabulary_), len(char_vec.vocabulary_)
        n_hand = scaler.mean_.shape[0]
        if coef.shape[0] != n_word + n_char + n_hand or n_hand != n_expected:
            raise ValueError("coefficient count does not match the feature blocks")
        dummy = n_word + n_char
        idf = np.concatenate([word_vec.idf_, char_vec.idf_, [0.0]]).astype(np.float64)
        w = np.concatenate([coef[:dummy], [0.0]])

        # word symbols: tokens of vocabulary terms, plus the hand features' family words and variable letters
        word_ids: dict[str, int] = {}
        extra = (*QA_CLASS_OF, *HOW_BIGRAMS, *(t for v in HOW_BIGRAMS.values() for t in sorted(v))) \
            if feature_set == "qa" else ()
        for tok in (*FAMILY_OF, *sorted(VAR_LETTERS), *extra):
            word_ids.setdefault(tok, len(word_ids) + 1)
        word_terms = []
        for term, col in word_vec.vocabulary_.items():
            toks = tuple(word_ids.setdefault(t, len(word_ids) + 1) for t in str(term).split(" "))
            word_terms.append((toks, int(col)))
        word_trie = _NgramTrie(word_terms, len(word_ids), word_vec.ngram_range, dummy)
        # per token id: family 0..N_FAMILIES-1, N_FAMILIES = variable letter, N_FAMILIES + 1 = neither
        token_attr = np.full(len(word_ids) + 1, N_FAMILIES + 1, dtype=np.int64)
        for tok, i in word_ids.items():
            token_attr[i] = FAMILY_OF.get(tok, N_FAMILIES if tok in VAR_LETTERS else N_FAMILIES + 1)

        # char symbols: code points of vocabulary terms; a LUT maps code point → id (0 beyond its end)
        alphabet = sorted({ord(ch) for term in char_vec.vocabulary_ for ch in str(term)})
        sym = {cp: i + 1 for i, cp in enumerate(alphabet)}
        char_lut = np.zeros((alphabet[-1] + 2) if alphabet else 1, dtype=np.int64)
        for cp, i in sym.items():
            char_lut[cp] = i
        char_terms = [(tuple(sym[ord(ch)] for ch in str(t)), n_word + int(c)) for t, c in char_vec.vocabulary_.items()]
        char_trie = _NgramTrie(char_terms, len(alphabet), char_vec.ngram_range, dummy)

        scale = np.asarray(scaler.scale_, dtype=np.float64) if scaler.with_std else np.ones(n_hand)
        mean = np.asarray(scaler.mean_, dtype=np.float64) if scaler.with_mean else np.zeros(n_hand)
        hand_w = coef[dummy:] / scale  # (x - mean)/scale · w  =  x · (w/scale) - mean · (w/scale)
        levels = sum(n >= 1 for n in range(word_vec.ngram_range[0], word_vec.ngram_range[1] + 1)) + sum(
            n >= 1 for n in range(char_vec.ngram_range[0], char_vec.ngram_range[1] + 1)
        )
        return cls(
            max_chars=int(clip.max_chars),
            word_trie=word_trie,
            word_ids=word_ids,
            token_attr=token_attr,
            char_trie=char_trie,
            char_lut=char_lut,
            n_word_cols=n_word,
            idf_w=idf * w,
            idf_sq=idf * idf,
            # the dummy column may collect every n-gram of every level of the clipped text
            max_count=levels * (int(clip.max_chars) + 2),
            hand_w=hand_w,
            hand_offset=float(mean @ hand_w),
            intercept=float(np.asarray(clf.intercept_).ravel()[0]),
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
