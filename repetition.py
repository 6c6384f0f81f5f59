"""Repeated responses: a response that the token cap cut before any answer while it was looping.

Under greedy decoding a reasoning model can fall into a loop it never leaves: the same sentence or paragraph
over and over until the token cap (the MuTIS paper counts these "repeated responses": 46.6 % of the untrained
DeepSeek-R1-Distill-Qwen-1.5B's MATH-500 responses, 10.8 % after training). eval.py reports their share per
benchmark and checkpoint (`repeated`, next to `truncated`).

The definition, on token ids:

    repeated = truncated (the cap cut the response before any answer) and loop_period(response ids) is not None

    loop_period: the smallest period p (1 <= p <= MAX_PERIOD) such that the last L = max(MIN_REPEATS * p,
    MIN_TOKENS) tokens repeat with period p -- token i equals token i - p -- at all but a TOLERANCE share of
    the L - p positions compared.

Why this one: a loop is a property of where the response ends (greedy decoding that repeats itself once keeps
repeating), so only the tail is read, and a response that looped for a while and then went on to something else
is not counted. Four copies of the span rule out a phrase that merely recurs (a formula written twice, a list
of two similar steps); the 64-token floor keeps a short run of one token ("0000") from counting. The 10 %
tolerance lets through what greedy loops do with counters ("Step 12: ..., Step 13: ...": one token in a period
differs) without letting ordinary text through: prose, formulas and worked steps match themselves shifted by p
at a few percent of positions (tests/test_repetition.py: long real texts, scripted loops). Requiring `truncated`
keeps the count to the loops that cost the whole budget and lost the answer; a response that loops and still
ends, or ends in a loop of its own answer, is not one. A response shorter than MIN_TOKENS is never counted, so
at caps below 64 tokens the share is 0 by definition.
"""
import numpy as np

MIN_REPEATS = 4     # copies of the span the tail must hold
MIN_TOKENS = 64     # the shortest tail that can count, whatever the period
MAX_PERIOD = 2048   # longest span looked for: a few paragraphs
TOLERANCE = 0.1     # share of compared positions that may differ (counters, a drifting number)


def loop_period(ids, min_repeats=MIN_REPEATS, min_tokens=MIN_TOKENS, max_period=MAX_PERIOD, tolerance=TOLERANCE):
    """The period of the loop `ids` ends in, or None (see the module docstring). ids: token ids (any sequence of
    comparable items: a string works on characters)."""
    x = np.asarray(list(ids) if isinstance(ids, str) else ids)  # [n]
    n = len(x)
    for p in range(1, min(max_period, n // min_repeats) + 1):
        span = max(min_repeats * p, min_tokens)  # the tail read for this period
        if span > n:
            break  # longer periods need longer tails still
        tail = x[n - span:]  # [span]
        if np.count_nonzero(tail[p:] != tail[:-p]) <= tolerance * (span - p):
            return p
    return None


def is_repeated(ids, truncated):
    """A repeated response: cut by the cap before any answer (`truncated`) while looping (loop_period)."""
    return bool(truncated) and loop_period(ids) is not None
