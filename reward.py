"""Answer extraction, math equivalence and reward functions for MuTIS.

The reward is the only training signal, so the grader has to be right and must never hang.
Answers go through three layers, cheapest first:

1. Pre-checks (`_sane`) reject pathological strings (NUL bytes, huge inputs, unbalanced braces,
   power towers) before any parser sees them.
2. A fast path in this process: both answers are normalised (units, \\text, thousands separators,
   degrees, percent, `x =` prefixes, \\dfrac, ...) and compared as strings, as exact numbers
   (Fractions: integers, decimals, scientific notation, repeating decimals, mixed numbers) or with
   relative tolerance 1e-4, and tuples, intervals and answer sets element by element.
3. math-verify (`parse` + `verify`) for whatever the fast path cannot decide, in a worker process
   that is killed and replaced when a comparison exceeds its time limit (infra/grading.py), with
   math-verify's own timeouts disabled (parsing_timeout=None, timeout_seconds=None).

Public API: find_answer, extract_answer, is_equivalent, register, score_batch.
"""
import functools
import os
import re
from collections import namedtuple
from fractions import Fraction

from infra import grading

DEFAULT_TIMEOUT = 1.0  # seconds per comparison
REL_TOL = 1e-4  # relative tolerance once a decimal is involved (Minerva golds are rounded)
MAX_ANSWER_CHARS = 1000  # longer "answers" are rambling or adversarial; the longest gold is ~210
POOL_MIN = 16  # fewer undecided items than this are not worth spreading over processes

INTERVENTIONS = (
    "Warning! Your previous action is invalid. Please try again:",
    "My previous action is invalid. If I want to give the final answer, I should put the answer "
    "between <answer> and </answer>. Let me try again:",
)

# ---------------------------------------------------------------------------------------------
# Extraction

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])\s*")
_ECHO_RE = re.compile(r"<answer>\s*(?:and|or)\s*</answer>")  # prompt text that names the tags
_LINE_RE = re.compile(r"(?im)^[ \t>#*_-]*(?:final\s+)?answer[ \t*_]*:[ \t*_]*(.*\S)|final answer is:?\s*(.*\S)")
_NUM_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_COLON_RE = re.compile(r"(?i)\b(?:final\s+)?answer\s*:")  # the reference's (?:Answer|Final Answer)\s*:
_PLACEHOLDERS = {"", "answer", "your answer", "final answer", "your final answer", "...", "?"}


def _brace_pairs(text):
    """Map each unescaped '{' to its matching '}' in one pass (linear even for 5k open braces)."""
    pairs, stack, i = {}, [], 0
    while i < len(text):
        if text[i] == "\\":
            i += 1  # \{ and \} are literal braces, not groups
        elif text[i] == "{":
            stack.append(i)
        elif text[i] == "}" and stack:
            pairs[stack.pop()] = i
        i += 1
    return pairs


def _strip_math(s):
    """Drop math delimiters, markdown emphasis and the Minerva 'I hope it is correct' frame."""
    s = s.strip().strip("*").strip()
    s = re.sub(r"(?i)^the final answer is:?\s*", "", s)
    s = re.sub(r"(?i)[.\s]*I hope it is correct\.?$", "", s)
    for a, b in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(s) >= len(a) + len(b) and s.startswith(a) and s.endswith(b):
            s = s[len(a):len(s) - len(b)].strip()
    return s.rstrip(".").strip()


# the answer, its form (boxed|tag|line|number), where the turn is cut (`end`: for an 'Answer:' line the end of its
# paragraph, as the reference cuts) and where the answer itself ends (`close`: the end of that line)
Answer = namedtuple("Answer", "text how end close")


def _blank(text):
    """Blank out intervention sentences and tag echoes, keeping every offset in place."""
    for s in INTERVENTIONS:
        text = text.replace(s, " " * len(s))
    return _ECHO_RE.sub(lambda m: " " * len(m.group(0)), text)


def _box_content(text, m, pairs):
    """(content, end) of the \\boxed at match m, or None when its brace is not closed yet."""
    i = m.end()
    if text.startswith("{", i):
        return (_strip_math(text[i + 1:pairs[i]]), pairs[i] + 1) if i in pairs else None
    token = re.match(r"[^\s$]*", text[i:]).group(0)  # \boxed 5
    return _strip_math(token), i + len(token)


def _first_answer(text):
    """The first complete answer in the reference's order (mutis/llm_agent/generation.py,
    _postprocess_responses): the first </answer> with its <answer> content; else the paragraph
    holding the first 'Answer:' / 'Final Answer:'; else the first brace-balanced \\boxed{...}.
    end is where the reference cuts the turn: after </answer>, at the paragraph's end, after the brace."""
    j = text.find("</answer>")
    i = text.rfind("<answer>", 0, j) if j >= 0 else -1
    if i >= 0 and _strip_math(text[i + 8:j]).lower() not in _PLACEHOLDERS:
        return Answer(_strip_math(text[i + 8:j]), "tag", j + len("</answer>"), j + len("</answer>"))
    for m in _COLON_RE.finditer(text):
        end = text.find("\n\n", m.end())
        end = len(text) if end < 0 else end
        lines = [s for s in text[m.end():end].split("\n") if s.strip()]
        content = _strip_math(lines[0]) if lines else ""
        if content.lower() not in _PLACEHOLDERS:
            close = text.find("\n", text.index(lines[0], m.end()))  # the end of the answer's own line
            return Answer(content, "line", end, end if close < 0 or close > end else close)
    pairs = None
    for m in _BOX_RE.finditer(text):
        pairs = _brace_pairs(text) if pairs is None else pairs
        got = _box_content(text, m, pairs)
        if got and got[0].lower() not in _PLACEHOLDERS:
            return Answer(got[0], "boxed", got[1], got[1])
    return None


def _last_answer(text):
    """The last complete \\boxed{...}, else the last <answer>...</answer>, else the last 'Answer:' line."""
    boxes = list(_BOX_RE.finditer(text))
    pairs = _brace_pairs(text) if boxes else {}
    for m in reversed(boxes):  # a truncated last box must not hide an earlier complete one
        got = _box_content(text, m, pairs)
        if got and got[0].lower() not in _PLACEHOLDERS:
            return Answer(got[0], "boxed", len(text), len(text))
    end = len(text)
    while (i := text.rfind("<answer>", 0, end)) >= 0:  # stop strings cut "</answer>": allow none
        j = text.find("</answer>", i, end)
        content = _strip_math(text[i + 8:j if j >= 0 else end])
        if content.lower() not in _PLACEHOLDERS:
            return Answer(content, "tag", len(text), len(text))
        end = i
    for m in reversed(list(_LINE_RE.finditer(text))):
        content = _strip_math(m.group(1) or m.group(2))
        if content.lower() not in _PLACEHOLDERS:
            return Answer(content, "line", len(text), len(text))
    return None


def find_answer(text, first=False, last_number=False):
    """The one answer detector, shared by the turn rule (rollout.py) and the reward -> Answer or None.

    first=True: the first complete answer, as the MuTIS reference cuts turns (`_first_answer`); its
    `end` is where the turn is cut. first=False: the last answer (`_last_answer`), for responses
    kept whole. Only explicit answers count (\\boxed{}, <answer> tags, 'Answer:'); last_number=True
    (GSM8K-style sources, scoring only) falls back to the last number. Intervention sentences are never
    read as answers."""
    if not isinstance(text, str):
        return None
    text = _blank(text)
    found = _first_answer(text) if first else _last_answer(text)
    if found is None and last_number and (nums := _NUM_RE.findall(text)):
        found = Answer(nums[-1].replace(",", "").rstrip("."), "number", len(text), len(text))
    return found


def extract_answer(text, last_number=False, first=False):
    """The final answer's text (see find_answer), or None."""
    found = find_answer(text, first, last_number)
    return found.text if found else None


# ---------------------------------------------------------------------------------------------
# Pre-checks: reject what would make a parser or sympy hang, before either sees it

_CTRL_RE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def _sane(s):
    """False for what no parser should see: control bytes (NUL), more than MAX_ANSWER_CHARS,
    unbalanced or 40-deep braces, power towers 9^{9^{9^{...}}} and huge literal exponents."""
    if not isinstance(s, str) or not s.strip() or len(s) > MAX_ANSWER_CHARS or _CTRL_RE.search(s):
        return False
    stack, i = [], 0  # one flag per open brace: does it open an exponent?
    while i < len(s):
        c = s[i]
        if c == "^":
            level = sum(stack) + 1
            lit = re.match(r"\s*\{?\s*(\d+)", s[i + 1:])
            if level >= 3 or (lit and len(lit.group(1)) > (6 if level == 1 else 2)):
                return False  # sympy would build the integer: 2^{10000000}, 10^{10^{100}}
            if m := re.match(r"\s*\{", s[i + 1:]):
                stack.append(True)
                i += m.end()
        elif c == "{":
            stack.append(False)
        elif c == "}":
            if not stack:
                return False
            stack.pop()
        elif c == "\\":
            i += 1  # \{ and \} are literal braces
        if len(stack) > 40:
            return False
        i += 1
    return not stack


# ---------------------------------------------------------------------------------------------
# Normalisation: the fast path's view of an answer

_UNICODE = {"\u2212": "-", "\u2013": "-", "\u00d7": "\\times ", "\u00b7": "\\cdot ", "\u00b0": "^\\circ",
            "\u221e": "\\infty", "\u222a": "\\cup ", "\u2009": " ", "\u202f": " ", "\u00a0": " ",
            "\u2007": " ", "\u200b": ""}
_TEXT_CMD = r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mathit|mbox|rm|operatorname)"
_UNIT_TEXT_RE = re.compile(_TEXT_CMD + r"\s*\{\s*[A-Za-z][A-Za-z ./]*\}(?:\^\{?[23]\}?)?\s*(%?)$")
_UNIT_WORD_RE = re.compile(  # no bare single letters: the gold "6m" is six times m, not 6 metres
    r"^(.+?)\s*(?:cm|mm|km|inch(?:es)?|feet|foot|ft|yards?|meters?|metres?|miles?|mph|kph|hours?|hrs?"
    r"|minutes?|mins?|seconds?|secs?|days?|weeks?|months?|years?|dollars?|cents?|degrees?|units?"
    r"|sq|kg|grams?|lbs?|pounds?|ounces?|oz|liters?|litres?|ml|mL|rad|radians?)(?:\^\{?[23]\}?)?$")
_THOUSANDS_RE = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?%?")
_PREFIX_RE = re.compile(r"^(?:[A-Za-z](?:_\{[^{}]*\}|_[A-Za-z0-9])?(?:\([A-Za-z]\))?|\\[A-Za-z]+)(?:=|\\in(?![a-z]))")


@functools.lru_cache(maxsize=8192)
def _clean(s):
    for k, v in _UNICODE.items():
        s = s.replace(k, v)
    s = _strip_math(s)
    s = re.sub(r",\\!\s*", ",", s).replace("\\!", "")  # 10,\!080 is MATH's thousands separator
    s = re.sub(r"(?<=\d)\{,\}(?=\d)", ",", s)
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = re.sub(r"\\(?:left|right|big|Big|bigg|Bigg)(?![A-Za-z])\.?", "", s)
    s = re.sub(r"(?<!\\)\\[,;: ]|\\q?quad(?![A-Za-z])|~", " ", s)  # not the row break \\
    s = re.sub(r"\\\$|\\dollar(?![A-Za-z])|^\$", "", s)  # currency
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|\\degree", "", s)
    s = re.sub(r"\\%|%|" + _TEXT_CMD + r"\{\s*percent\s*\}|\s*\bpercent\b", "%", s)
    s = re.sub(_TEXT_CMD + r"\{\s*(?:and|or)\s*\}|\s+(?:and|or)\s+", ",", s)
    m = _UNIT_TEXT_RE.search(s)
    if m and s[:m.start()].strip():  # "5\text{ cm}^2" -> 5, but \text{Evelyn} stays
        s = s[:m.start()] + m.group(1)
    s = re.sub(_TEXT_CMD + r"\s*\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)  # \frac12, \frac 59
    s = re.sub(r"\\frac\s*(\{[^{}]*\})\s*([0-9A-Za-z])", r"\\frac\1{\2}", s)  # \frac{270}7
    s = re.sub(r"\\sqrt\s*([0-9A-Za-z])", r"\\sqrt{\1}", s)
    s = re.sub(r"([_^])\{\s*([0-9A-Za-z])\s*\}", r"\1\2", s)  # x^{2} == x^2, 2516_{8} == 2516_8
    s = re.sub(r"\\geqslant|\\ge(?![A-Za-z])", r"\\geq", s)
    s = re.sub(r"\\leqslant|\\le(?![A-Za-z])", r"\\leq", s)
    s = s.replace("bmatrix", "pmatrix").replace("\\infinity", "\\infty")
    spaced_list = bool(re.search(r",\s", s))  # "100, 200" is a list, "100,200" may be a number
    s = re.sub(r"\s+", " ", s).strip()
    s = re.sub(r"(?<![A-Za-z]) | (?![A-Za-z])", "", s)  # math mode ignores spaces, except between letters
    s = s.rstrip(".")
    m = _UNIT_WORD_RE.match(s)
    if m and (_number(m.group(1)) or _THOUSANDS_RE.fullmatch(m.group(1))):  # 5s is not 2x+5s
        s = m.group(1)
    if not spaced_list and _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    s = _drop_prefix(s)
    return s.lower() if re.fullmatch(r"[A-Za-z ]{2,}", s) else s  # words: \text{East} == east


def _drop_prefix(s):
    """x=5 -> 5, f(x)=2x -> 2x, x\\in[1,2] -> [1,2]; an equation with more '=' stays whole."""
    m = _PREFIX_RE.match(s)
    return s[m.end():] if m and m.end() < len(s) and "=" not in s[m.end():] else s


# ---------------------------------------------------------------------------------------------
# Numbers: exact Fractions, so float noise never decides a reward

_DEC = r"(?:\d+(?:\.\d*)?|\.\d+)"
_SCI_RE = re.compile(rf"({_DEC})(?:[eE]|(?:\\times|\\cdot|\*)10\^)\{{?([-+]?\d+)\}}?")
_POW10_RE = re.compile(r"10\^\{?([-+]?\d+)\}?")
_REPEAT_RE = re.compile(r"(\d*)\.(\d*)\\overline\{(\d+)\}")


@functools.lru_cache(maxsize=8192)
def _number(s):
    """-> (Fraction, kind, percent) or None; kind "int" (integer gold: exact match), "frac", "dec"."""
    pct = s.endswith("%")
    s = s[:-1] if pct else s
    sign = -1 if s.startswith("-") else 1
    s = s[1:] if s[:1] in "-+" else s
    val = kind = None
    if re.fullmatch(r"\d+", s):
        val, kind = Fraction(int(s)), "int"  # leading zeros: 025 == 25
    elif re.fullmatch(_DEC, s):
        val, kind = Fraction(s), "dec"
    elif (m := _SCI_RE.fullmatch(s)) and abs(int(m.group(2))) <= 400:
        val, kind = Fraction(m.group(1)) * Fraction(10) ** int(m.group(2)), "dec"
    elif (m := _POW10_RE.fullmatch(s)) and abs(int(m.group(1))) <= 400:
        val, kind = Fraction(10) ** int(m.group(1)), "frac"
    elif m := _REPEAT_RE.fullmatch(s):  # 0.1\overline{6} = 1/6
        a, b, r = m.groups()
        val = int(a or 0) + Fraction(int(b or 0), 10 ** len(b)) + Fraction(int(r), (10 ** len(r) - 1) * 10 ** len(b))
        kind = "frac"
    elif re.fullmatch(r"\d*\\frac\{.*\}", s):
        whole = re.match(r"\d*", s).group(0)  # mixed number: 137\frac{1}{2}
        pairs, i = _brace_pairs(s), len(whole) + 5
        j = pairs.get(i, -2) + 1
        if pairs.get(j) == len(s) - 1:
            n, d = _number(s[i + 1:j - 1]), _number(s[j + 1:-1])
            if n and d and d[0] and not (n[2] or d[2]) and (not whole or 0 <= n[0] < d[0]):
                val, kind = int(whole or 0) + n[0] / d[0], "dec" if "dec" in (n[1], d[1]) else "frac"
    elif s.count("/") == 1:
        a, b = (_number(x) if x else None for x in s.split("/"))
        if a and b and b[0] and not (a[2] or b[2]):
            val, kind = a[0] / b[0], "dec" if "dec" in (a[1], b[1]) else "frac"
    if kind is None:
        return None
    return sign * val, "int" if kind == "frac" and val.denominator == 1 else kind, pct


def _num_eq(p, g):
    """Exact match for integer golds and for two exact values (448/15626 != 448/15625); within
    REL_TOL once a decimal is involved. A '%' also allows the /100 reading (8\\% == 0.08)."""
    tol = g[1] != "int" and "dec" in (p[1], g[1])
    for a in [p[0]] + ([p[0] / 100] if p[2] else []):
        for b in [g[0]] + ([g[0] / 100] if g[2] else []):
            if a == b or (tol and abs(a - b) <= REL_TOL * abs(b)):
                return True
    return False


# ---------------------------------------------------------------------------------------------
# Structure: tuples, intervals, unions and unordered answer lists, compared item by item

_PM_RE = re.compile(r"\\pm|\\mp")


def _split_top(s, sep):
    """Split on sep outside any bracket. Intervals like [2,5) balance because all kinds count."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(s):
        if depth == 0 and s.startswith(sep, i):
            parts.append(s[start:i])
            i = start = i + len(sep)
            continue
        depth += 1 if s[i] in "([{" else -1 if s[i] in ")]}" else 0  # \{ \} count as braces
        i += 1
    return [p for p in parts + [s[start:]] if p]


def _balanced(s):
    """Brackets in s never close more than they opened and end level, so the bracket just
    outside s closes at the very end ("(1,2),(3,4)" is not one tuple)."""
    depth = 0
    for c in s:
        depth += 1 if c in "([{" else -1 if c in ")]}" else 0
        if depth < 0:
            return False
    return depth == 0


def _expand_pm(items):
    """1 \\pm \\sqrt{19} -> 1+\\sqrt{19}, 1-\\sqrt{19} (items with exactly one \\pm)."""
    return [x for it in items
            for x in ((_PM_RE.sub("+", it), _PM_RE.sub("-", it)) if len(_PM_RE.findall(it)) == 1 else (it,))]


def _struct(s):
    """-> (kind, items): "union", "set" (unordered), "seq()", "seq[)", ... (ordered) or "scalar"."""
    if len(parts := _split_top(s, "\\cup")) > 1:
        return "union", parts
    if s.startswith("\\{") and s.endswith("\\}") and _balanced(s[2:-2]):
        return "set", _expand_pm(_split_top(s[2:-2], ","))
    if len(items := _split_top(s, ",")) > 1:
        return "set", _expand_pm(items)
    if s[:1] in "([" and s[-1:] in ")]" and _balanced(s[1:-1]) and len(inner := _split_top(s[1:-1], ",")) > 1:
        return "seq" + s[0] + s[-1], inner
    return ("set", items) if len(items := _expand_pm([s])) == 2 else ("scalar", [s])


def _compare(p, g, leaf, depth=0):
    """True / False, or None when `leaf` could not decide some needed item."""
    if p == g:
        return True
    (pk, pi), (gk, gi) = _struct(p), _struct(g)
    if pk != gk and "scalar" in (pk, gk) and _number(_leaf_norm(p if pk == "scalar" else g)):
        return False  # one number against several items
    if pk != gk or gk == "scalar" or depth > 3 or len(gi) > 40:
        return leaf(p, g)
    if len(pi) != len(gi):
        return False
    if gk.startswith("seq"):
        rs = [_compare(a, b, leaf, depth + 1) for a, b in zip(pi, gi)]
        return False if False in rs else None if None in rs else True
    used, undecided = [False] * len(pi), False  # unordered: greedy matching suffices for an equivalence
    for b in gi:
        for j, a in enumerate(pi):
            if not used[j] and (r := _compare(a, b, leaf, depth + 1)):
                used[j] = True
                break
            undecided |= not used[j] and r is None
        else:
            return None if undecided else False
    return True


_BASE_RE = re.compile(r"((?=[0-9A-Z]*\d)[0-9A-Z]+)_\{?(\d+)\}?")  # 2516_8, 1A_{16}; not x_1


def _base_value(m):
    try:
        return int(m.group(1), int(m.group(2)))
    except ValueError:  # a digit the base does not have
        return None


def _leaf_norm(s):
    s = _drop_prefix(s)  # list items carry their own prefixes: f(x)=x,f(x)=-x
    return s[1:-1] if len(s) > 2 and s[0] + s[-1] == "()" and "," not in s and _balanced(s[1:-1]) else s


def _leaf_fast(p, g):
    p, g = _leaf_norm(p), _leaf_norm(g)
    if p == g:
        return True
    gb = _BASE_RE.fullmatch(g)
    if gb and (gv := _base_value(gb)) is not None:  # math-verify drops the base; a bare 2516 counts
        pb = _BASE_RE.fullmatch(p)
        return _base_value(pb) == gv if pb else p == gb.group(1)
    pn, gn = _number(p), _number(g)
    if pn and gn:
        return _num_eq(pn, gn)
    if pn and re.search(r"[A-Za-z]", re.sub(r"\\[A-Za-z]+", "", g)):
        return False  # gold 6m has a variable; math-verify would strip the m as a unit
    if re.fullmatch(r"[a-z ]{2,}", p) and re.fullmatch(r"[a-z ]{2,}", g):
        return False  # two different words
    return None


def _decide_fast(pred, golds):
    """Fast-path verdict for pred against any of golds: True, False, or None (ask math-verify)."""
    if not _sane(pred):
        return False
    undecided = False
    for g in filter(_sane, golds):
        if r := _compare(_clean(pred), _clean(g), _leaf_fast):
            return True
        undecided |= r is None
    return None if undecided else False


# ---------------------------------------------------------------------------------------------
# The slow path: math-verify, run inside infra/grading.py's killable worker processes

@functools.lru_cache(maxsize=4096)
def _mv_parse(s):
    from math_verify import parse

    # math-verify reads 1.24e-8 as 1.24*E - 8: spell scientific notation out for it
    s = re.sub(r"(?<![A-Za-z\\])(\d+(?:\.\d*)?)[eE]([-+]?\d+)(?![\d.])", r"\1\\times10^{\2}", s)
    return parse("\\boxed{" + s + "}", parsing_timeout=None)


def _leaf_slow(p, g):
    if (r := _leaf_fast(p, g)) is not None:
        return r
    import sympy
    from math_verify import verify
    pp, gp = _mv_parse(_leaf_norm(p)), _mv_parse(_leaf_norm(g))
    if not pp or not gp:
        return False
    a, b = pp[0], gp[0]
    if isinstance(a, sympy.Number) and isinstance(b, sympy.Number) and a.is_finite and b.is_finite:
        # math-verify rounds floats to 6 decimals, so .0000673 "equals" .0000672: use our rule
        fa, fb = (Fraction(int(x.p), int(x.q)) if x.is_Rational else Fraction(str(x)) for x in (a, b))
        return _num_eq((fa, "dec", False), (fb, "int" if b.is_Integer else "dec", False))
    return verify(gp, pp, timeout_seconds=None)


def _slow_equal(pred, golds):
    return any(_compare(_clean(pred), _clean(g), _leaf_slow) for g in golds if _sane(g))


def _grade(tasks, workers, timeout):
    """math-verify's verdicts for tasks [(pred, golds)], in order, in killable worker processes (infra/grading.py)."""
    return grading.run(tasks, workers, timeout, judge="reward:_slow_equal", warmup=("x^2", [r"\frac{x}{1/x}"]))


def is_equivalent(pred, gold, timeout=DEFAULT_TIMEOUT):
    """True if answer `pred` equals gold answer `gold` (a string, or a list of accepted strings).
    Returns False, never hangs, on malformed input and when a comparison takes longer than
    `timeout` seconds per gold (enforced by killing the worker process, so any thread may call
    this). The first call that needs math-verify also waits for it to import (about 1 s), outside
    the limit. Raises RuntimeError only if that fails (math-verify missing)."""
    golds = _golds(gold)
    verdict = _decide_fast(pred, golds)
    if verdict is None:
        verdict = _grade([(pred, [g for g in golds if _sane(g)])], 1, timeout)[0]
    return verdict


# ---------------------------------------------------------------------------------------------
# Rewards

# name -> (fn, batched); None: the built-in math reward
_REGISTRY = {"math": (None, False), "gsm8k": (None, False), "arith": (None, False), "story": (None, False)}
# Built-in sources whose answers are plain numbers in prose: the last number counts when nothing is marked.
LAST_NUMBER_SOURCES = {"gsm8k", "arith", "story"}


def register(name, batched=False):
    """Decorator: use fn for data sources named `name` (or `name_...`, `name-...`, `org/name`).
    Per item: fn(data_source, response, ground_truth) -> dict or float.
    batched=True: fn(predictions, references, data_source) -> list of dicts or floats, where
    predictions are the raw responses and references the ground truths."""
    def deco(fn):
        _REGISTRY[name] = (fn, batched)
        return fn
    return deco


def _lookup(data_source):
    name = str(data_source)
    if name in _REGISTRY:
        return name
    base = name.rsplit("/", 1)[-1].lower()  # "openai/gsm8k" -> "gsm8k"
    hits = [k for k in _REGISTRY if base == k.lower() or re.match(re.escape(k.lower()) + r"[_\-.]", base)]
    return max(hits, key=len) if hits else "math"


def _golds(ground_truth):
    return [str(g) for g in ground_truth] if isinstance(ground_truth, (list, tuple)) else [str(ground_truth)]


def _as_result(x):
    x = x if isinstance(x, dict) else {"score": float(x)}
    return {"acc": x.get("score", 0.0), "has_answer": 0.0, "pred": None, **x}


def _math_result(pred, acc):
    return {"score": float(acc), "acc": float(acc), "has_answer": float(pred is not None), "pred": pred}


def score_batch(data_sources, responses, ground_truths, *, lengths=None, length_coef=0.0, stopped=None, first=False,
                last_number=True, timeout=DEFAULT_TIMEOUT, workers=None):
    """Rewards of a batch of responses, results in input order: dicts with score, acc, has_answer, pred.
    Each data source's registered reward (register), else the paper's math reward: 1.0 if the extracted
    answer equals a gold answer (ground truth: a string or a list of accepted strings), else 0.0. data_sources
    may be one string for the whole batch; first: score the first answer (responses cut at their first answer,
    see find_answer), else the last. last_number: True lets LAST_NUMBER_SOURCES fall back to the
    last number (scoring prose answers); False counts explicit answers only, the paper's training reward
    (no answer = 0; the reference's verl GSM8K reward is 'strict' too). Registered rewards ignore it.

    length_coef > 0 adds the usual length-penalty baseline, a constant cost per response token
    on every response, correct or not: score_i = acc_i - length_coef * lengths[i], with lengths[i]
    the token count of response i (a registered reward's own score pays the same cost). stopped (a bool
    per response: the model ended it, not a token limit): a response a limit cut earns no accuracy credit
    (require_stop). acc is unchanged. What the fast path cannot decide goes to the math-verify worker pool, each item
    limited to `timeout` seconds per gold, spread over `workers` worker processes (default: all
    usable cores); small batches use one worker."""
    n = len(responses)
    sources = [data_sources] * n if isinstance(data_sources, str) else list(data_sources)
    if not len(sources) == len(ground_truths) == n:
        raise ValueError(f"reward.py: score_batch got {len(sources)} data sources, {n} responses and "
                         f"{len(ground_truths)} ground truths")
    if length_coef and (lengths is None or len(lengths) != n):
        raise ValueError(f"reward.py: score_batch(length_coef=...) needs lengths=, the token count of each of "
                         f"the {n} responses")
    out, pending, groups = [None] * n, [], {}
    for i, (src, resp, gt) in enumerate(zip(sources, responses, ground_truths)):
        name = _lookup(src)
        fn, batched = _REGISTRY[name]
        if batched:
            groups.setdefault(src, []).append(i)
        elif fn is not None:
            out[i] = _as_result(fn(src, resp, gt))
        else:
            pred = extract_answer(resp, name in LAST_NUMBER_SOURCES and last_number, first=first)
            verdict = pred is not None and _decide_fast(pred, _golds(gt))
            out[i] = _math_result(pred, bool(verdict))
            if verdict is None:
                pending.append(i)
    for src, idx in groups.items():
        fn = _REGISTRY[_lookup(src)][0]
        for i, s in zip(idx, fn([responses[i] for i in idx], [ground_truths[i] for i in idx], src)):
            out[i] = _as_result(s)
    tasks = [(out[i]["pred"], [g for g in _golds(ground_truths[i]) if _sane(g)]) for i in pending]
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = min(workers, max(1, len(tasks) // 4)) if len(tasks) >= POOL_MIN else 1
    for i, verdict in zip(pending, _grade(tasks, workers, timeout)):
        out[i] = _math_result(out[i]["pred"], verdict)
    for r, length in zip(out, lengths if length_coef else ()):
        r["score"] -= length_coef * length
    if stopped is not None:
        require_stop(out, stopped)
    return out


def require_stop(results, stopped):
    """A response that a token limit cut, not the model, earns no accuracy credit: score -= acc. DAPO's overlong
    punishment (Yu et al. 2025, "DAPO", section 3.4) in its hard form, at the turn budget: a model that answers and
    then runs on (repeating its answer line, say) makes the engine decode to the limit, and a user pays for every
    one of those tokens, while the turn rule's cut hides them from the reward. Off by default (the paper's reward)."""
    for r, ended in zip(results, stopped):
        if not ended:
            r["score"] -= r["acc"]
    return results
