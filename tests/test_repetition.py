"""infra/repetition.py: scripted loops are found with their period, long real text that does not loop is not, and the
detector agrees with a plain re-implementation of its definition on random sequences with planted loops."""
import random
from pathlib import Path

import pytest

import data
from infra.hf import load_tokenizer
from infra.repetition import MIN_REPEATS, MIN_TOKENS, TOLERANCE, loop_period, repeated

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    return load_tokenizer(smollm2_dir)


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def naive_period(x, repeats=MIN_REPEATS, floor=MIN_TOKENS, tolerance=TOLERANCE):
    """The definition, position by position."""
    for p in range(1, len(x) // repeats + 1):
        span = max(repeats * p, floor)
        if span > len(x):
            return None
        bad = sum(x[i] != x[i - p] for i in range(len(x) - span + p, len(x)))
        if bad <= tolerance * (span - p):
            return p
    return None


PREFIX = ("To find the total we first add the apples and the pears, then subtract the ones that were eaten. "
          "Let me set up the equation carefully and check each step. ")
SPAN = "Wait, I need to recompute the sum of the first two numbers before I can divide by the third one. "


def test_a_greedy_loop_is_found_with_the_period_of_its_span(tok):
    span = ids(tok, SPAN)
    for copies in (4, 10, 40):
        seq = ids(tok, PREFIX) + span * copies
        assert loop_period(seq) == len(span), copies
        assert repeated(seq, capped=True) == "no answer" and repeated(seq, capped=False) is None
    # the cap cuts a loop anywhere inside its span: the tail is still periodic
    assert loop_period((ids(tok, PREFIX) + span * 12)[:-7]) == len(span)


def test_three_copies_are_not_a_loop_four_are(tok):
    span = ids(tok, SPAN)
    assert len(span) * MIN_REPEATS > MIN_TOKENS  # the span's own length decides, not the 64-token floor
    text = ids(tok, PREFIX * 3)
    assert loop_period(text + span * 3) is None
    assert loop_period(text + span * 4) == len(span)


def test_short_and_counting_loops(tok):
    assert loop_period([7] * 64) == 1 and loop_period([7] * 63) is None  # the 64-token floor
    assert loop_period(ids(tok, PREFIX) + [5, 9] * 40) == 2
    # a loop with a counter: one token in a period differs from the copy before it
    def steps(n):
        return PREFIX + "".join(f"Step {i}: so we carry the one again and the total stays the same as it was before. "
                                for i in range(10, 10 + n))
    period = len(ids(tok, steps(21))) - len(ids(tok, steps(20)))  # one step's tokens in context
    assert loop_period(ids(tok, steps(30))) == period


def test_a_loop_that_ends_is_not_counted(tok):
    seq = ids(tok, PREFIX) + ids(tok, SPAN) * 10 + ids(tok, (ROOT / "README.md").read_text()[:3000])
    assert loop_period(seq) is None


@pytest.mark.parametrize("source", ["README.md", "docs/results.md", "reward.py", "math500"])
def test_long_text_that_does_not_loop_is_not_repeated(tok, source):
    if source == "math500":  # problems and their worked solutions, one after the other
        text = "\n\n".join(r["problem"] + "\n" + (r.get("solution") or "") for r in data.load_dataset("math500", limit=60))
    else:
        text = (ROOT / source).read_text()
    seq = ids(tok, text)
    assert len(seq) > 4000
    for end in range(1000, len(seq) + 1, 997):  # as if the cap had cut it anywhere
        assert loop_period(seq[:end]) is None, (source, end, tok.decode(seq[end - 200:end]))


def test_agrees_with_the_definition_on_random_planted_loops():
    rng = random.Random(0)
    found = 0
    for trial in range(300):
        head = [rng.randrange(50) for _ in range(rng.randrange(0, 300))]
        p = rng.randrange(1, 60)
        span = [rng.randrange(50) for _ in range(p)]
        tail = span * rng.randrange(0, 24) + span[:rng.randrange(p)]
        noise = rng.choice([0, 0.03, 0.3])  # share of the loop's tokens replaced
        seq = head + [t if rng.random() >= noise else rng.randrange(50) for t in tail]
        got = loop_period(seq)
        assert got == naive_period(seq), trial
        found += got is not None
    assert 50 < found < 250  # both outcomes were exercised
