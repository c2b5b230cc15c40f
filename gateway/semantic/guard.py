"""Text analysis for the semantic cache, pure (no I/O): normalisation and the guard.

**Normalisation** (:func:`normalise`) turns a question into the token list the lexical embedder sketches:
Unicode NFKC, case-folded, number words written as digits (``seventeen`` → ``17``, ``twenty-three`` →
``23``, ``one hundred and five`` → ``105``, ``2 million`` → ``2000000``), thousands separators dropped
(``1,000`` → ``1000``), decimals canonical (``3.50`` → ``3.5``), arithmetic written one way (``17×23``,
``17 * 23``, ``17 x 23``, ``17 times 23``, ``17 \\times 23`` → ``17 × 23``; ``/``, ``÷``, ``divided by``,
``\\div`` → ``÷``; ``**`` → ``^``), every other punctuation mark a space, whitespace collapsed.

**The guard** (:func:`features`, :func:`mismatch`) decides whether two questions that *look* alike may share
an answer. Two questions pass only when they have

- the same multiset of numbers (after the normalisation above; ``17×23`` ≠ ``17×24``, ``3.5`` = ``3.50``);
- the same multiset of operators and brackets (``+ - × ÷ ^ = < > ≤ ≥ % √ ! ( ) [ ]``; ``17+23`` ≠ ``17×23``,
  ``3 + 4 × 2`` ≠ ``(3 + 4) × 2``); superscript exponents are written ``^`` before NFKC (``5²`` is ``5 ^ 2``, not
  ``52``), and a leading decimal point is kept (``.5`` is ``0.5``, not ``5``); every other symbol is an operator
  too (``& # @``, Unicode Sm/So: ``∪ ∩ ⊆ ∧ ∨ ¬ → ≈ | ~``, emoji; a colon with text right after it: ``x[1:]``), only
  punctuation is dropped;
- the same single-letter symbols (``x``, ``n``: ``2x+1`` ≠ ``2y+1``; ``a``/``i`` are words, but symbols beside
  an operator: ``a - i`` ≠ ``i - a``);
- the same quoted strings (``"…"``, ``“…”``, ``«…»``, ``'…'`` up to case and spacing; `` `…` `` code spans
  exactly);
- the same capitalised names: every capitalised word of one that is not a common sentence word (``Alice``,
  ``NASA``, ``Paris``) must occur, case-folded, among the words of the other, both ways — so lower-casing a
  question keeps its names, changing ``Alice`` to ``Maria`` does not;
- the same number of negations (``not``, ``no``, ``never``, ``n't``, ``without``, ``unless``, …), in the same place
  among the content words (the word-order check below);
- where both use one: the same question word (``when`` ≠ ``where``), persons in order (``he`` ≠ ``she``, ``his
  dog … her cat`` ≠ ``her dog … his cat``), tense (``is`` ≠ ``was``), modals (``can`` ≠ ``must``) and quantifiers
  (``all`` ≠ ``some``), the task imperative (``summarize`` ≠ ``translate``, :data:`TASKS`) and ``and``/``or`` —
  common words that still decide what is asked (a new-user helper's wrong hits; a class
  one question does not use, ``Tell me …`` against ``What is …``, is not compared);
- the same comparison words by direction (``many``/``much``/``more``/``greater``/``largest``/``above``/``after`` vs
  ``few``/``little``/``less``/``fewer``/``smallest``/``below``/``before``);
- the same language (script, and for Latin script the dominant function words of en/fr/de/es/it/pt/nl);

and, since a bag of tokens cannot tell ``Subtract 3 from 10`` from ``Subtract 10 from 3`` (issue 25), the same
order and roles:

- the numbers, operators and symbols in the same order (``10 ÷ 2`` ≠ ``2 ÷ 10``, ``120 km in 3 hours`` ≠
  ``3 km in 120 hours``);
- the same word after each number (``5 miles to km`` ≠ ``5 km to miles``);
- the same two ends of every relation word (:data:`RELATIONS`: from, to, of, per, than, before, north…:
  ``Paris north of Madrid`` ≠ ``Madrid north of Paris``, ``north`` ≠ ``south``);
- the same ordinals and multipliers in order (``first`` ≠ ``second``, ``3rd`` ≠ ``4th``, ``half`` ≠ ``twice``),
  the same comparison/superlative words in order (``largest`` ≠ ``heaviest``), the same currency signs;
- the content words and arithmetic both share in the same order (``Alice pays Bob`` ≠ ``Bob pays Alice``,
  ``a cat chases a dog`` ≠ ``a dog chases a cat``), the first and second persons among them (``I owe you`` ≠
  ``you owe me``). A moved clause or sentence is refused too (``If A, B``
  vs ``B if A``): the guard cannot tell a harmless move from a changed role — when in doubt, miss.

With the ``lexical`` embedder it also requires the same content words (every normalised word that is not a
common sentence word, :func:`mismatch` ``same_words``): a lexical similarity cannot tell a synonym from a
changed noun, so a changed word is a different question. With an embedding model (``openai:<tier>``) that
check is off — synonyms are the point — and a changed lower-case noun (``apples`` → ``pears``) or a word of
opposite meaning that is not in the lists here passes the guard; the similarity threshold has to stop those.
The order- and role-aware checks apply in both modes. Features stored by an older guard (no ``v``) are refused.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation


def _words(text: str) -> list[str]:
    return text.split()


UNITS = {w: i for i, w in enumerate(_words(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen"))}
TENS = {w: 10 * (i + 2) for i, w in enumerate(_words("twenty thirty forty fifty sixty seventy eighty ninety"))}
SCALES = {"hundred": 100, "thousand": 1000, "million": 10**6, "billion": 10**9, "trillion": 10**12}
NUMBER_WORDS = UNITS.keys() | TENS.keys() | SCALES.keys()

OPERATOR_WORDS = {"plus": "+", "minus": "-", "times": "×", "multiplied": "×", "divided": "÷", "squared": "^2",
                  "cubed": "^3", "percent": "%", "negative": "-", "equals": "="}
LATEX = [(r"\\times|\\cdot", " × "), (r"\\div", " ÷ "), (r"\\frac", " ÷ "), (r"\\sqrt", " √ "),
         (r"\\leq?|\\leqslant", " ≤ "), (r"\\geq?|\\geqslant", " ≥ "), (r"\\neq?", " ≠ "), (r"\\pm", " ± ")]
_LATEX = [(re.compile(pattern), repl) for pattern, repl in LATEX]
NEGATIONS = frozenset(_words("not no never none nothing nobody nowhere neither nor cannot without unless isnt arent "
                             "wasnt werent dont doesnt didnt wont wouldnt cant couldnt shouldnt hasnt havent "
                             "hadnt mustnt neednt aint shant mightnt"))
#: ``many``/``much`` and ``few``/``little`` ask about amounts by direction too ("did many people support it" /
#: "did few people support it"), like more/less; compared by direction only (``how much in dollars`` = ``how many
#: dollars``), not in the exact comparison words (:data:`DEGREE`).
_AMOUNT = frozenset(("many", "much", "few", "little"))
MORE = frozenset(_words("many much more greater larger bigger higher longer taller older most greatest largest "
                        "biggest highest longest tallest oldest maximum max above after later latest increase "
                        "increased increases heavier heaviest faster fastest"))
LESS = frozenset(_words("few little less fewer smaller lower shorter younger least fewest smallest lowest shortest "
                        "youngest minimum min below before earlier earliest decrease decreased decreases "
                        "lighter lightest slower slowest"))
# Words that are neither names nor content words: sentence starters, question words, and the imperatives that all
# ask for the answer (``find``/``compute``/``determine``, ``explain``/``describe``, ``write``/``compose``…).
COMMON = frozenset(_words("""a an the this that these those there here it its i we you he she they me my our your
his her their what which who whom whose when where why how if then else is are was were be been being am do does did
can could should would will shall may might must has have had let suppose assume consider given find compute
calculate determine solve evaluate express write explain describe give list name show prove state
tell provide answer imagine pretend please now next also so but and or nor yet for of in on at by to from
with without as after before during while because since until unless although though however therefore thus
each every all some any many much most few several both either neither one two three four five six seven eight
nine ten first second third last yes no not okay ok hi hello dear assistant question problem step part
note hint use using based according compose convert read respond reply act embody picture craft share help
define"""))
#: The imperatives that say *what to do* with the rest of the question — ``Summarize``/``Translate``/``Classify``
#: the same paragraph are three questions. Not names when capitalised, but content words (the lexical mode's
#: same-words check, the word order) and, where both questions use one, compared by class in both modes
#: (``task``); spelling variants and synonyms share a class.
TASKS = {**{w: w for w in _words("""create draft generate rewrite identify extract discuss develop design implement
construct translate classify rank rate estimate approximate round factor expand sketch draw complete fill edit revise
return output print suggest recommend compare simplify proofread paraphrase critique review debug refactor fix
optimize optimise correct categorize categorise sort reverse shorten lengthen continue""")},
         "summarize": "summarize", "summarise": "summarize", "analyze": "analyze", "analyse": "analyze",
         "pick": "choose", "choose": "choose", "select": "choose", "graph": "plot", "plot": "plot"}
#: Capitalised words that are not names.
NOT_NAMES = COMMON | TASKS.keys()

_QUOTES = re.compile(r"\"([^\"\n]{1,300})\"|“([^”\n]{1,300})”|«([^»\n]{1,300})»|`([^`\n]{1,300})`"
                     r"|(?:(?<=^)|(?<=[\s(\[]))'([^'\n]{1,300})'(?=[\s.,;:!?)\]]|$)")
_QUOTE_CHARS = frozenset("\"“«`'")  # a text without any of them has no quoted string
_NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+")
_WORD = re.compile(r"[^\W\d_]+(?:['’][^\W\d_]+)*")
_TOKEN = re.compile(r"\d+(?:\.\d+)?|(?<![\d.])\.\d+|[^\W\d_]+|[+\-×÷^=<>≤≥≠±%√!()\[\]]|:(?=\S)|[^\w\s:]")
#: ASCII punctuation that is an operator in code and maths (``5 & 3``, ``C#``, ``A @ B``); every other character
#: that is neither a word, a number nor one of the operators above is kept only if it is a symbol (Unicode
#: categories Sm and So: ``∪ ∩ ⊆ ∧ ∨ ¬ → ≈ ≡ | ~``, ``°``, emoji). A colon is kept when text follows it directly
#: (``x[1:]`` ≠ ``x[:1]``, ``3:2``), not as a sentence's ``Question: …``. Other punctuation (``. , ; ? " …``) is
#: dropped.
_CODE_PUNCT = frozenset("&#@")
_TIMES_X = re.compile(r"(?<=\d)\s*[x×✕*·]\s*(?=[\d(-])")
_WORD_HYPHEN = re.compile(r"(?<=[^\W\d_])-(?=[^\W\d_])")
_BANG = re.compile(r"(?<=\d)!")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")

_SCRIPTS = (("latin", "LATIN"), ("cyrillic", "CYRILLIC"), ("greek", "GREEK"), ("arabic", "ARABIC"),
            ("hebrew", "HEBREW"), ("devanagari", "DEVANAGARI"), ("thai", "THAI"), ("hangul", "HANGUL"),
            ("kana", "HIRAGANA"), ("kana", "KATAKANA"), ("han", "CJK"))
_FUNCTION_WORDS = {
    "en": "the is are what how of and to in which who does many much was with for that",
    "fr": "le la les est sont que quel quelle combien des du et une un dans pour qui avec",
    "de": "der die das ist sind und wie viele was ein eine nicht mit für wer welche",
    "es": "el la los las es son que cuál cuántos cuántas del y una un en para quién con",
    "it": "il lo la gli le è sono che quale quanti quante del e una un in per chi con",
    "pt": "o a os as é são que qual quantos quantas do da e uma um em para quem com",
    "nl": "de het een is zijn wat hoeveel van en in voor wie met niet welke",
}
_FUNCTION = {lang: frozenset(words.split()) for lang, words in _FUNCTION_WORDS.items()}
_FUNCTION_LANGS = {w: tuple(lang for lang, fw in _FUNCTION.items() if w in fw) for fw in _FUNCTION.values() for w in fw}


def _canonical_number(text: str) -> str:
    if text.isdigit() and text.isascii() and (text[0] != "0" or len(text) == 1):
        return text  # the common case: already canonical (Decimal would give the same)
    try:
        value = Decimal(text.replace(",", ""))
    except InvalidOperation:
        return text
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def _words_to_numbers(tokens: list[str]) -> list[str]:
    """Replace runs of number words (and ``<digits> <scale>``) by one digit token."""
    out: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok in NUMBER_WORDS or (tok[:1].isdigit() and i + 1 < len(tokens) and tokens[i + 1] in SCALES):
            total, current, j, seen = 0, 0, i, False
            if tok[:1].isdigit():
                current = int(Decimal(tok)) if "." not in tok else 0
                if current == 0 and "." in tok:  # 2.5 million: keep as is, too rare to fold exactly
                    out.append(tok)
                    i += 1
                    continue
                j, seen = i + 1, True
            while j < len(tokens):
                w = tokens[j]
                if w in UNITS:
                    current += UNITS[w]
                elif w in TENS:
                    current += TENS[w]
                elif w == "hundred":
                    current = max(current, 1) * 100
                elif w in SCALES:
                    total += max(current, 1) * SCALES[w]
                    current = 0
                elif w == "and" and seen and j + 1 < len(tokens) and tokens[j + 1] in NUMBER_WORDS:
                    pass
                else:
                    break
                seen = True
                j += 1
            out.append(str(total + current))
            i = j
        else:
            out.append(tok)
            i += 1
    return out


_SUPERSCRIPT = re.compile("[⁻⁺]?[⁰¹²³⁴⁵⁶⁷⁸⁹]+")
_SUPER_DIGITS = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁻⁺", "0123456789-+")


def _powers(text: str) -> str:
    """Superscript exponents written with ``^`` before NFKC would fold them into the base (``5²`` → ``52``)."""
    return _SUPERSCRIPT.sub(lambda m: "^" + m.group().translate(_SUPER_DIGITS), text)


def _symbolise(text: str) -> str:
    """NFKC + LaTeX and symbol forms of arithmetic written as single operator characters."""
    if not text.isascii():
        text = _powers(text)
    text = unicodedata.normalize("NFKC", text)
    if "\\" in text:
        for pattern, repl in _LATEX:
            text = pattern.sub(repl, text)
    text = text.replace("**", "^").replace("−", "-").replace("–", "-").replace("⁄", "/")  # ½ → 1⁄2 → 1/2
    text = _WORD_HYPHEN.sub(" ", text)  # twenty-three, well-known: words, not a subtraction
    text = _TIMES_X.sub(" × ", text)
    text = _BANG.sub(" ! ", text)
    text = text.replace("*", " × ").replace("/", " ÷ ").replace("·", " × ")
    return _THOUSANDS.sub("", text)


def tokens(text: str) -> list[str]:
    """The normalised tokens of ``text``: words (case-folded, apostrophes dropped), numbers in canonical
    digits, operator characters. ``don't`` → ``dont``; ``17 times 23`` → ``17 × 23``. (Memoised for the last
    texts: a request's question is tokenised by the guard and by the lexical embedder.)"""
    return list(_tokens(text))


def forget_tokens() -> None:
    """Drop the memoised tokens of :func:`tokens` (for benchmarks that time the same text repeatedly)."""
    _tokens.cache_clear()


@functools.lru_cache(maxsize=256)
def _tokens(text: str) -> tuple[str, ...]:
    text = _symbolise(text).casefold().replace("'", "").replace("’", "")
    toks = [t for t in _TOKEN.findall(text) if len(t) > 1 or t.isalnum() or t in _OPERATOR_CHARS or _is_symbol(t)]
    # a leading decimal point is a number too (".5" → "0.5"): every later check reads numbers by their first digit
    toks = [_canonical_number(t) if t[:1].isdigit() or (t[:1] == "." and t[1:2].isdigit()) else t for t in toks]
    toks = _words_to_numbers(toks)
    out: list[str] = []
    for i, t in enumerate(toks):
        op = OPERATOR_WORDS.get(t)
        if op is not None and (t not in ("times", "negative", "minus", "plus", "equals")
                               or _numeric_near(toks, i)):
            out.extend(op) if op.startswith("^") else out.append(op)
            continue
        if t == "by" and out and out[-1] in ("×", "÷"):
            continue  # "multiplied by", "divided by"
        out.append(t)
    return tuple(out)


_OPERATOR_CHARS = frozenset("+-×÷^=<>≤≥≠±%√!()[]:")


@functools.lru_cache(maxsize=1024)
def _is_symbol(ch: str) -> bool:
    """Is ``ch`` (one character that is no word, number or listed operator) a symbol the guard keeps? A text
    differing only in one (``5 & 3`` / ``5 | 3``, ``A ∪ B`` / ``A ∩ B``, ``C#`` / ``C``, 👍 / 👎) asks something
    else; these were dropped as punctuation, so such questions compared identical."""
    return ch in _CODE_PUNCT or unicodedata.category(ch) in ("Sm", "So")


def _numeric_near(toks: list[str], i: int) -> bool:
    """``times`` is multiplication between numbers (``17 times 23``), not in ``three times a day``… it is
    both; keep the rule simple: a number (or an operator) on at least one side."""
    left = toks[i - 1] if i > 0 else ""
    right = toks[i + 1] if i + 1 < len(toks) else ""
    return left[:1].isdigit() or right[:1].isdigit()


def normalise(text: str) -> str:
    """The normalised text (tokens joined by one space); see the module doc."""
    return " ".join(tokens(text))


@functools.lru_cache(maxsize=4096)
def _script(ch: str) -> str:
    """The script label (:data:`_SCRIPTS`) of one letter; ``other`` for the rest."""
    name = unicodedata.name(ch, "")
    return next((label for label, marker in _SCRIPTS if name.startswith(marker)), "other")


def language(text: str) -> str:
    """A coarse language label: the dominant script (``cyrillic``, ``han``, ``kana``…), and for Latin script
    ``en``/``fr``/``de``/``es``/``it``/``pt``/``nl`` by function words of two letters or more (``latin`` when
    fewer than two are found);
    ``und`` without letters."""
    if text.isascii():  # every ASCII letter is Latin script
        if not any(ch.isalpha() for ch in text):
            return "und"
    else:
        counts: Counter[str] = Counter(_script(ch) for ch in text if ch.isalpha())
        if not counts:
            return "und"
        script = counts.most_common(1)[0][0]
        if counts.get("kana"):  # Japanese mixes kana and han
            script = "kana"
        if script != "latin":
            return script
    votes = dict.fromkeys(_FUNCTION, 0)
    for w in _WORD.findall(text):
        if len(w) > 1:
            for lang in _FUNCTION_LANGS.get(w.casefold(), ()):
                votes[lang] += 1
    best = max(votes.values())
    if best < 2:  # one function word is no evidence ("a", "la", "de" are in several languages)
        return "latin"
    leaders = [lang for lang, v in votes.items() if v == best]
    return leaders[0] if len(leaders) == 1 or "en" not in leaders else "en"


# --- the order- and role-aware part of the guard ---------------------------------------------------------
# A bag of tokens cannot tell "Subtract 3 from 10" from "Subtract 10 from 3"; these lists and the features
# below compare where things stand, not only that they occur. Every list errs towards refusing: a word that
# *might* carry direction is in it, and a rephrasing that moves it is a miss, never a wrong answer.

#: Words that make a relation between what stands left and right of them asymmetric (``3 from 10``,
#: ``Paris north of Madrid``, ``5 miles to km``, ``10 per hour``); operators are handled by the math sequence.
RELATIONS = frozenset(_words("""from to into onto of per by than minus over under above below before after
north south east west northeast northwest southeast southwest northern southern eastern western behind ahead
beyond inside outside within upstream downstream preceding following precedes follows exceeds exceed subtract
subtracted subtracting divide dividing deduct deducted remove removed take taken away off out until till since
toward towards against versus vs via"""))
#: Ordinal and multiplier words: ``first`` ≠ ``second``, ``half`` ≠ ``twice``; compared as a sequence in both
#: modes (``first`` and ``second`` are also common sentence words, so the content-word check never saw them).
ORDINALS = frozenset(_words("""first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth
thirteenth fourteenth fifteenth sixteenth seventeenth eighteenth nineteenth twentieth thirtieth fortieth
fiftieth hundredth thousandth millionth last next previous penultimate final former latter half halves twice
double doubled triple tripled thrice quadruple quarter quarters thirds fourths fifths tenths hundredths once
primary secondary tertiary"""))
_ORDINAL_SUFFIX = frozenset(("st", "nd", "rd", "th"))
#: Comparison and superlative words compared exactly and in order (``largest`` ≠ ``heaviest`` even in the
#: embedding mode, where the content-word check is off); the by-direction count (``polarity``) stays too.
DEGREE = (MORE | LESS) - _AMOUNT | frozenset(_words("""most best worst better worse closest closer nearest nearer
farthest further furthest farther cheapest cheaper richest richer poorest poorer hottest hotter coldest colder warmest
warmer coolest cooler deepest deeper newest newer wider widest narrower narrowest thicker thickest thinner
thinnest stronger strongest weaker weakest louder loudest quieter quietest darker darkest brighter brightest
easier easiest harder hardest simpler simplest safer safest"""))
#: Common words that still decide what is asked; each class is compared when both questions use it (so an
#: imperative "Tell me …" still meets "What is …"): the question word (``when`` ≠ ``where``), the persons in
#: order (``he`` ≠ ``she``, ``his dog … her cat`` ≠ ``her dog … his cat``), the tense (``is`` ≠ ``was``), the
#: modals (``can`` ≠ ``must``) and the quantifiers (``all`` ≠ ``some``; ``each`` = ``every``).
WH = frozenset(_words("what which who whom whose when where why how"))
#: third persons only: "Can you tell me: …" adds a first and a second person to a question without changing it
#: (the first and second persons are in the word order instead, :data:`SPEAKERS`)
PERSONS = {**dict.fromkeys(_words("he him his himself"), "3m"), **dict.fromkeys(_words("she her hers herself"), "3f"),
           **dict.fromkeys(_words("they them their theirs themselves"), "3p")}
TENSES = {**dict.fromkeys(_words("is are am does do has have"), "present"),
          **dict.fromkeys(_words("was were did had"), "past")}
#: The first and second persons: common words, but who does what to whom — "I owe you 10 dollars and you owe me 4"
#: is not "you owe me 10 dollars and I owe you 4". Kept in the word order (``sequence``), so they are compared where
#: both questions use the same one; "Can you tell me: …" before a question without "you" or "me" changes nothing.
SPEAKERS = frozenset(_words("i me my mine myself we us our ours ourselves you your yours yourself yourselves"))
MODALS = frozenset(_words("will shall can could may might must should would ought"))
#: universal or existential ("each" and "every" ask the same; "how many", "few" (polarity) are not here)
QUANTIFIERS = {**dict.fromkeys(_words("all each every both"), "all"),
               **dict.fromkeys(_words("some any several either"), "some")}
#: "and" and "or" (``nor`` is a negation): "how many bought apples and oranges" is not "… apples or oranges", nor
#: "A and B or C" "A or B and C"; compared in order where both questions use one.
CONJUNCTIONS = frozenset(("and", "or"))
_CURRENCY = re.compile(r"[$€£¥₹₽₩¢]")
_SKIP = COMMON | RELATIONS | NEGATIONS | DEGREE | ORDINALS | _ORDINAL_SUFFIX
_WINDOW = 6  # tokens searched on each side of a relation word for its two ends
GUARD_VERSION = 4  # stored features of another version are refused ("when in doubt, miss")


def _is_number(t: str) -> bool:
    return t[:1].isdigit()


def _is_math(t: str) -> bool:
    """Numbers, operator characters and single-letter symbols: the tokens whose order is the arithmetic."""
    return _is_number(t) or (len(t) == 1 and not t.isalnum()) or (len(t) == 1 and t.isalpha() and t not in "ai")


def _anchor(toks: list[str], i: int, step: int) -> str:
    """The nearest token from ``i`` in direction ``step`` that is a number or a content word (``-`` when none
    within :data:`_WINDOW` tokens)."""
    j, seen = i + step, 0
    while 0 <= j < len(toks) and seen < _WINDOW:
        t = toks[j]
        if _is_number(t) or (t.isalpha() and t not in _SKIP and len(t) > 1):
            return t
        j += step
        seen += 1
    return "-"


def _roles(toks: list[str]) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(units, relations, ordinals) of the token list: ``units`` the sorted ``"<number> <word>"`` pairs of each
    number and the content word right after it (``5 miles``); ``relations`` the sorted ``"<left>|<rel>|<right>"``
    triples of each relation word and the nearest number or content word on each side (``3|from|10``);
    ``ordinals`` the ordinal/multiplier words in order, a number followed by ``st``/``nd``/``rd``/``th`` as
    ``<n>th``."""
    units: list[str] = []
    relations: list[str] = []
    ordinals: list[str] = []
    for i, t in enumerate(toks):
        nxt = toks[i + 1] if i + 1 < len(toks) else ""
        if _is_number(t):
            if nxt in _ORDINAL_SUFFIX:
                ordinals.append(t + "th")
            elif nxt.isalpha() and nxt not in _SKIP and len(nxt) > 1:
                units.append(f"{t} {nxt}")
        elif t in ORDINALS:
            ordinals.append(t)
        if t in RELATIONS:
            relations.append(f"{_anchor(toks, i, -1)}|{t}|{_anchor(toks, i, 1)}")
    return tuple(sorted(units)), tuple(sorted(relations)), tuple(ordinals)


@dataclass(frozen=True, slots=True)
class Features:
    """What the guard compares. ``numbers``/``operators``/``symbols``/``quoted``: sorted multisets;
    ``names``: case-folded capitalised non-common words; ``words``: the normalised non-common word tokens
    (for the name check of the other side, and the content-word check); ``negations``: count;
    ``polarity``: (more-words, less-words) counts; ``language``: see :func:`language`.

    The order- and role-aware part: ``math`` the numbers, operators and symbols *in order* (``10 ÷ 2`` ≠
    ``2 ÷ 10``); ``units``, ``relations``, ``ordinals`` see :func:`_roles`; ``degree`` the comparison and
    superlative words in order; ``currency`` the currency signs in order; ``sequence`` the non-common words,
    ordinals and the arithmetic in order (``words`` is the set of its non-common words; the word-order check
    compares what both sides share);
    ``version`` :data:`GUARD_VERSION` (0 for features stored by an older guard, never passed)."""

    numbers: tuple[str, ...]
    operators: tuple[str, ...]
    symbols: tuple[str, ...]
    quoted: tuple[str, ...]
    names: frozenset[str]
    words: frozenset[str]
    negations: int
    polarity: tuple[int, int]
    language: str
    math: tuple[str, ...] = ()
    units: tuple[str, ...] = ()
    relations: tuple[str, ...] = ()
    ordinals: tuple[str, ...] = ()
    degree: tuple[str, ...] = ()
    currency: tuple[str, ...] = ()
    sequence: tuple[str, ...] = ()
    version: int = GUARD_VERSION
    #: the question words, persons (``3m``/``3f``/``3p``), tenses (``present``/``past``), modals and
    #: quantifiers (``all``/``some``), each in order (:data:`WH`, :data:`PERSONS`, :data:`TENSES`, :data:`MODALS`,
    #: :data:`QUANTIFIERS`)
    wh: tuple[str, ...] = ()
    persons: tuple[str, ...] = ()
    tenses: tuple[str, ...] = ()
    modals: tuple[str, ...] = ()
    quantifiers: tuple[str, ...] = ()
    #: ``and``/``or`` in order (:data:`CONJUNCTIONS`)
    conjunctions: tuple[str, ...] = ()

    @property
    def tasks(self) -> tuple[str, ...]:
        """The task imperatives (:data:`TASKS`) by class, in order: ``summarize``, ``translate``…"""
        return tuple(TASKS[t] for t in self.sequence if t in TASKS)

    @property
    def ordered_numbers(self) -> tuple[str, ...]:
        """The numbers in the order they occur (``numbers`` is their sorted multiset)."""
        return tuple(t for t in self.math if _is_number(t))

    def to_json(self) -> dict[str, object]:
        return {"v": self.version, "n": list(self.numbers), "o": list(self.operators), "s": list(self.symbols),
                "q": list(self.quoted), "c": sorted(self.names), "w": list(self.sequence), "g": self.negations,
                "p": list(self.polarity), "l": self.language, "m": list(self.math), "u": list(self.units),
                "r": list(self.relations), "od": list(self.ordinals), "dg": list(self.degree),
                "cu": list(self.currency), "wh": list(self.wh), "pe": list(self.persons), "te": list(self.tenses),
                "mo": list(self.modals), "qu": list(self.quantifiers), "cj": list(self.conjunctions)}

    @classmethod
    def from_json(cls, d: dict[str, object]) -> Features:
        """The inverse of :meth:`to_json`; features stored without a version (the guard before the order-aware
        checks) come back with ``version`` 0, which :func:`mismatch` refuses."""
        def seq(key: str) -> tuple[str, ...]:
            v = d.get(key) or []
            return tuple(str(x) for x in v) if isinstance(v, list) else ()

        pol = d.get("p") or [0, 0]
        p = (int(pol[0]), int(pol[1])) if isinstance(pol, list) and len(pol) == 2 else (0, 0)
        neg = d.get("g", 0)
        version = d.get("v", 0)
        sequence = seq("w")
        words = frozenset(t for t in sequence if t.isalpha() and t not in COMMON)
        return cls(seq("n"), seq("o"), seq("s"), seq("q"), frozenset(seq("c")), words,
                   int(neg) if isinstance(neg, int) else 0, p, str(d.get("l", "und")), seq("m"), seq("u"), seq("r"),
                   seq("od"), seq("dg"), seq("cu"), sequence, version if isinstance(version, int) else 0,
                   seq("wh"), seq("pe"), seq("te"), seq("mo"), seq("qu"), seq("cj"))


def _fold(word: str) -> str:
    return word.casefold().replace("'", "").replace("’", "")


def _quoted(m: re.Match[str]) -> str:
    """A quoted string, whitespace collapsed; case-folded unless it is a backtick code span."""
    i, value = next((i, g) for i, g in enumerate(m.groups()) if g is not None)
    value = " ".join(value.split())
    return "`" + value if i == 3 else value.casefold()


def features(text: str) -> Features:
    """The guard's view of ``text`` (the last user turn)."""
    quoted = tuple(sorted(_quoted(m) for m in _QUOTES.finditer(text))) if _QUOTE_CHARS & set(text) else ()
    raw = _tokens(text)
    # "Hi!" is punctuation, "5!" and "n!" a factorial (tokens() keeps every "!" as an operator)
    toks = [t for i, t in enumerate(raw) if t != "!" or i == 0 or not (raw[i - 1].isalpha() and len(raw[i - 1]) > 1)]
    numbers: list[str] = []
    operators: list[str] = []
    symbols: list[str] = []
    math: list[str] = []
    sequence: list[str] = []
    negations = more = less = 0
    wh: list[str] = []
    persons: list[str] = []
    tenses: list[str] = []
    modals: list[str] = []
    quantifiers: list[str] = []
    conjunctions: list[str] = []
    for i, t in enumerate(toks):  # one pass: the multisets, the arithmetic and the content words in order, counts
        if t[:1].isdigit():
            numbers.append(t)
            math.append(t)
            sequence.append(t)
            continue
        if len(t) == 1 and not t.isalnum():
            operators.append(t)
            math.append(t)
            sequence.append(t)
            continue
        if len(t) == 1 and t.isalpha() and (t not in ("a", "i") or _beside_operator(toks, i)):
            symbols.append(t)  # "a"/"i" are words, but symbols beside an operator ("a - i" ≠ "i - a")
            math.append(t)
            sequence.append(t)
            continue
        if (t.isalpha() and t not in COMMON) or t in ORDINALS or t in NEGATIONS or t in SPEAKERS:
            # content words, ordinals ("second day" ≠ "day second"), negations ("John is not tall and Mary
            # is tall" ≠ "John is tall and Mary is not tall") and the first and second persons ("I owe you" ≠
            # "you owe me") in order; names are never COMMON
            sequence.append(t)
        _classify(t, wh, persons, tenses, modals, quantifiers)
        if t in CONJUNCTIONS:
            conjunctions.append(t)
        negations += t in NEGATIONS
        more += t in MORE
        less += t in LESS
    raw_words = _WORD.findall(_WORD_HYPHEN.sub(" ", unicodedata.normalize("NFKC", text)))
    names = frozenset(f for w in raw_words
                      if w[:1].isupper() and len(w) > 1 and (f := _fold(w)) not in NOT_NAMES
                      and f not in NUMBER_WORDS and f not in OPERATOR_WORDS)
    units, relations, ordinals = _roles(toks)
    words = frozenset(t for t in sequence if t.isalpha() and t not in COMMON)
    return Features(tuple(sorted(numbers)), tuple(sorted(operators)), tuple(sorted(symbols)), quoted, names, words,
                    negations, (more, less), language(text), tuple(math), units, relations, ordinals,
                    tuple(t for t in toks if t in DEGREE), tuple(_CURRENCY.findall(text)), tuple(sequence),
                    GUARD_VERSION, tuple(wh), tuple(persons), tuple(tenses), tuple(modals), tuple(quantifiers),
                    tuple(conjunctions))


def _classify(t: str, wh: list[str], persons: list[str], tenses: list[str], modals: list[str],
              quantifiers: list[str]) -> None:
    """Append token ``t`` to the class of :data:`WH`/:data:`PERSONS`/… words it belongs to, if any (persons,
    tenses and quantifiers as their category: ``3m``, ``past``, ``all``)."""
    if t in WH:
        wh.append(t)
    elif t in PERSONS:
        persons.append(PERSONS[t])
    elif t in TENSES:
        tenses.append(TENSES[t])
    elif t in MODALS:
        modals.append(t)
    elif t in QUANTIFIERS:
        quantifiers.append(QUANTIFIERS[t])


def _beside_operator(toks: list[str], i: int) -> bool:
    """Is the token at ``i`` next to an operator character (``a = 2``, ``a - i``)?"""
    return any(0 <= j < len(toks) and len(toks[j]) == 1 and not toks[j].isalnum() for j in (i - 1, i + 1))


def _class_differs(name: str) -> Callable[[Features, Features], bool]:
    """A class of :data:`WH`/… words differs only when both questions use it (module doc)."""
    def differs(a: Features, b: Features) -> bool:
        x, y = getattr(a, name), getattr(b, name)
        return bool(x) and bool(y) and x != y
    return differs


def _word_order(a: Features, b: Features) -> bool:
    """Do the content words, ordinals and arithmetic both sides share stand in the same order in both?
    ``Paris … Madrid`` vs ``Madrid … Paris`` do not, nor ``a cat chases a dog`` vs ``a dog chases a cat``,
    ``second day`` vs ``day second``, ``\\frac{a}{b}`` with ``b`` and a word swapped, or a clause moved past
    another (``If A, B`` vs ``B if A``: the guard cannot tell a harmless move from a changed role). Words only
    one side has (a synonym, with an embedding model) are left out of the comparison."""
    shared = set(a.sequence) & set(b.sequence)
    return [w for w in a.sequence if w in shared] == [w for w in b.sequence if w in shared]


def _field(name: str) -> Callable[[Features, Features], bool]:
    def differs(a: Features, b: Features) -> bool:
        return bool(getattr(a, name) != getattr(b, name))
    return differs


#: The guard's checks after ``version``, in the order :func:`mismatch` reports them: (reason, differs).
_CHECKS: tuple[tuple[str, Callable[[Features, Features], bool]], ...] = (
    ("language", _field("language")), ("numbers", _field("numbers")), ("operators", _field("operators")),
    ("symbols", _field("symbols")), ("quoted", _field("quoted")),
    ("names", lambda a, b: not a.names <= b.words or not b.names <= a.words),
    ("negation", _field("negations")), ("polarity", _field("polarity")),
    # the order- and role-aware checks
    ("order", _field("math")), ("units", _field("units")), ("relation", _field("relations")),
    ("ordinal", _field("ordinals")), ("comparative", _field("degree")), ("currency", _field("currency")),
    ("word_order", lambda a, b: not _word_order(a, b)),
    ("question_word", _class_differs("wh")), ("person", _class_differs("persons")),
    ("tense", _class_differs("tenses")), ("modal", _class_differs("modals")),
    ("quantifier", _class_differs("quantifiers")), ("task", _class_differs("tasks")),
    ("conjunction", _class_differs("conjunctions")),
)


def mismatch(a: Features, b: Features, same_words: bool = False) -> str | None:
    """Why ``a`` and ``b`` may not share an answer, or None when the guard passes. The first that differs of
    ``version`` (features stored by an older guard), ``language``, ``numbers``, ``operators``, ``symbols``,
    ``quoted``, ``names``, ``negation``, ``polarity``, then the order- and role-aware checks: ``order`` (the
    numbers, operators and symbols in sequence), ``units`` (the word after each number), ``relation`` (what
    stands on each side of ``from``/``to``/``of``/``per``/``than``/``north of``…), ``ordinal`` (``first`` ≠
    ``second``, ``half`` ≠ ``twice``), ``comparative`` (the comparison and superlative words in order),
    ``currency``, ``word_order`` (the content words both share, in order: names and nouns around a verb
    ``Alice pays Bob`` / ``Bob pays Alice``, a moved clause), then — where both questions use one —
    ``question_word``, ``person``, ``tense``, ``modal``, ``quantifier``, ``task``, ``conjunction``; and with
    ``same_words``, ``words``.

    ``same_words`` also requires the same set of content words (normalised tokens that are not common
    sentence words): for a lexical similarity, which cannot tell a synonym (``buy`` → ``purchase``) from a
    changed noun (``apples`` → ``pears``, ``km`` → ``miles``), the only safe reading of a changed word."""
    if a.version != GUARD_VERSION or b.version != GUARD_VERSION:
        return "version"
    for reason, differs in _CHECKS:
        if differs(a, b):
            return reason
    if same_words and a.words != b.words:
        return "words"
    return None
