"""Tokens to the first correct answer: how far a response had to run before it had stated the right answer.

An overthinking model reaches its answer, then checks, restarts and repeats; the tokens it decodes after that point
bought nothing (or, when a re-check slips, cost the answer). Chen et al. 2024 ("Do NOT Think That Much for
2+3=?") measure this as the tokens up to the first correct solution against the whole response. eval.py reports
it per sample (`first_correct_tokens`) and, per benchmark, its mean over the responses that reach a correct answer
anywhere, with the share that do. eval.py turns the character offset into tokens with rollout.tokens_through, the
bisection the turn rule cuts with.

The definition, for numeric golds (None otherwise): the first number that the response states as a result -- right
after '=', 'is', an 'Answer:' marker or '\\boxed{' -- and that equals the gold; its end, in characters, then in
the tokens whose decoded prefix first reaches it. A number is read whole ('= 23' is not the gold 2).
"""
import re

_STATED = re.compile(r"(?:=|\bis\b|\banswer\s*:|\\boxed\{)\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)(?![\d])", re.I)


def _value(s):
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def first_correct_end(text, gold):
    """The character offset where `text` has first stated the numeric `gold` (or one of a list of golds) as a
    result, or None."""
    wants = {_value(str(g).strip()) for g in (gold if isinstance(gold, (list, tuple)) else [gold])} - {None}
    if not wants or not isinstance(text, str):
        return None
    for m in _STATED.finditer(text):
        if _value(m[1].rstrip(".")) in wants:
            return m.end(1)
    return None

