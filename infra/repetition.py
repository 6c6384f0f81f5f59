"""Repeated responses: the engine ran into the token cap while the response was looping.

Under greedy decoding a reasoning model can fall into a loop it never leaves: the same sentence or paragraph
over and over until the token cap (the MuTIS paper counts these "repeated responses": 46.6 % of the untrained
DeepSeek-R1-Distill-Qwen-1.5B's MATH-500 responses, 10.8 % after training). A loop can start before any answer
(the answer is lost) or after one (the answer is there, but every token up to the cap is decoded and paid: a
model trained to answer may learn to repeat its answer line). Both count; eval.py, validation and the training
metrics report `repeated` (every loop) and `repeated_after_answer` (those that came after an answer).

The definition, on the token ids the engine decoded (a cut tail included):

    repeated = capped (a token limit, not the model, ended the response) and
               no answer:    loop_period(ids) is not None
               after answer: loop_period(tokens after the answer, min_tokens = min(MIN_TOKENS, their number))

    loop_period: the smallest period p (1 <= p <= MAX_PERIOD) such that the last L = max(MIN_REPEATS * p,
    MIN_TOKENS) tokens repeat with period p -- token i equals token i - p -- at all but a TOLERANCE share of
    the L - p positions compared.

Why this one: a loop is a property of where the response ends (greedy decoding that repeats itself once keeps
repeating), so only the tail is read, and a response that looped for a while and then went on to something else
is not counted. Four copies of the span rule out a phrase that merely recurs (a formula written twice, a list
of two similar steps); the 64-token floor keeps a short run of one token ("0000") from counting. The 10 %
tolerance lets through what greedy loops do with counters ("Step 12: ..., Step 13: ...": one token in a period
differs) without letting ordinary text through: prose, formulas and worked steps match themselves shifted by p
at a few percent of positions (tests/test_repetition.py: long real texts, scripted loops). After an answer the
whole rest must be the loop (four copies at least), however short the cap left it: `Answer: 7` written four
times up to a 64-token turn budget is a loop, `Answer: 7` and a sentence after it is not. Requiring `capped`
keeps the count to the loops that cost the whole budget; a response that loops and still ends is not one. A
response without an answer shorter than MIN_TOKENS is never counted.
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


def repeated(ids, capped, answered_at=None):
    """None, 'no answer' or 'after answer' (see the module docstring). ids: every token the engine decoded into the
    response; capped: a token limit ended it, not the model; answered_at: how many of ids run through the end of
    its first answer (None: it has none)."""
    if not capped:
        return None
    if answered_at is None:
        return "no answer" if loop_period(ids) is not None else None
    tail = list(ids[answered_at:])
    return "after answer" if loop_period(tail, min_tokens=min(MIN_TOKENS, len(tail))) is not None else None
