"""Speed and accuracy of reward.is_equivalent next to math-verify alone, on MATH-500 gold answers.

Pairs: every gold against itself, against rewritten forms (same value in another notation: label
True) and against close-looking wrong answers (label False). Both graders see the same pairs in the
same run, alternating in chunks so machine load hits both alike. math-verify runs in this process as
people use it: verify(parse("\\boxed{gold}"), parse("\\boxed{pred}")) with its defaults. Then the
worst time of one reward.is_equivalent call on each adversarial answer.

    python bench/reward_bench.py [--data data/math500.jsonl] [--show 10]
"""
import argparse
import json
import os
import re
import sys
import time
from fractions import Fraction

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import reward  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_data():
    local = os.path.join(ROOT, "data", "math500.jsonl")
    return local if os.path.exists(local) else os.path.join(ROOT, "..", "shared", "data", "math500.jsonl")


def terminating_decimal(f):
    d = f.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    return None if d != 1 else format(float(f), ".10g")


def is_list(s):
    """A plain comma list of answers (not 10,\\!080, not an interval or a tuple)."""
    return "," in s and not re.search(r"[()\[\]{}!]", s) and not re.fullmatch(r"\d{1,3}(,\d{3})+", s)


def rewrites(g):
    """Same value, other notation: what models actually write."""
    s, out = g.strip(), []
    if re.fullmatch(r"-?\d+", s):
        n = int(s)
        out += [f"{n:,}" if abs(n) >= 1000 else f"{n}.0", f"x = {n}", f"{n} \\text{{ units}}"]
    elif m := re.fullmatch(r"(-?)\\[dt]?frac\s*\{?(\d+)\}?\s*\{?(\d+)\}?", s):
        sign, a, b = m.groups()
        out += [f"{sign}\\dfrac{{{a}}}{{{b}}}", f"{sign}{a}/{b}"]
        dec = terminating_decimal(Fraction(int(a), int(b)))
        out += [sign + dec] if dec else [f"{sign}{float(Fraction(int(a), int(b))):.6f}"]
    elif "^\\circ" in s:
        out += [s.replace("^\\circ", ""), s.replace("^\\circ", "\u00b0")]
    elif m := re.fullmatch(r"\\text\{\(?([^{}]*?)\)?\}", s):
        out += [m.group(1)]
    elif "\\pm" in s and "\\{" not in s:
        out += [s.replace("\\pm", "+", 1) + ", " + s.replace("\\pm", "-", 1)]
    elif is_list(s):
        out += [", ".join(reversed([x.strip() for x in s.split(",")]))]
    if "\\left" in s:
        out += [s.replace("\\left", "").replace("\\right", "")]
    if "\\frac" in s and not out:
        out += [s.replace("\\frac", "\\dfrac")]
    if " " in s and not out:
        out += [s.replace(" ", "")]
    return out


def wrongs(g):
    """Close-looking wrong answers: one digit, sign or element off."""
    s = g.strip()
    if re.fullmatch(r"-?\d+", s):
        return [str(int(s) + 1)]
    if is_list(s):
        return [",".join(s.split(",")[:-1])]
    digits = [i for i, c in enumerate(s) if c.isdigit() and s[i - 1:i] not in ("^", "{")]
    if digits:  # first digit, and last digit unless it is an exponent (inches^2)
        return list({s[:i] + str((int(s[i]) + 1) % 10) + s[i + 1:] for i in (digits[0], digits[-1])})
    if "+" in s:
        return [s.replace("+", "-", 1)]
    return [s + "+1"]


def make_pairs(golds):
    pairs = []
    for g in golds:
        pairs.append((g, g, True, "self"))
        pairs += [(r, g, True, "rewrite") for r in rewrites(g) if r != g]
        pairs += [(w, g, False, "wrong") for w in wrongs(g) if w != g]
    return pairs


ADVERSARIAL = [  # the pre-checks reject the first four; the last reaches math-verify, which alone runs > 30 s
    ("power tower", "9^{9^{9^{9^{9}}}}"),
    ("100k chars", "1+" * 50000 + "1"),
    ("5000 unbalanced braces", "{" * 5000),
    ("NUL byte", "12\x003"),
    ("tower under the pre-checks", "9^{9^{9}}"),
]


def adversarial_seconds():
    """Worst wall time of reward.is_equivalent per adversarial answer, as prediction, as gold and
    against itself, each after a call that leaves a ready worker (a kill's restart is not counted)."""
    worst = {}
    for name, s in ADVERSARIAL:
        for pred, gold in ((s, "1"), ("1", s), (s, s)):
            reward.is_equivalent("x^2", "x \\cdot x", timeout=30)
            t = time.perf_counter()
            reward.is_equivalent(pred, gold)
            worst[name] = max(worst.get(name, 0.0), time.perf_counter() - t)
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=default_data(), help="jsonl with an 'answer' field per line")
    ap.add_argument("--chunk", type=int, default=50, help="pairs per alternation between graders")
    ap.add_argument("--show", type=int, default=0, help="print this many disagreements per grader")
    args = ap.parse_args()
    try:
        golds = [json.loads(line)["answer"] for line in open(args.data)]
    except (OSError, ValueError, KeyError) as e:
        print(f"reward_bench.py: cannot read answers from {args.data}: {e}", file=sys.stderr)
        raise SystemExit(2)
    from math_verify import parse, verify
    import logging
    logging.disable(logging.WARNING)  # math-verify logs each timeout; we count, not print

    def mv(pred, gold):
        return verify(parse("\\boxed{" + gold + "}"), parse("\\boxed{" + pred + "}"))

    pairs = make_pairs(golds)
    reward.is_equivalent("x^2", "x \\cdot x")  # start the workers outside the timed region
    mv("x^2", "x \\cdot x")
    reward._clean.cache_clear()
    reward._number.cache_clear()
    ours, theirs, s_ours, s_mv = [], [], [], []  # verdicts and seconds per pair
    for k in range(0, len(pairs), args.chunk):
        for grader, verdicts, secs in ((reward.is_equivalent, ours, s_ours), (mv, theirs, s_mv)):
            for p, g, _, _ in pairs[k:k + args.chunk]:
                t = time.perf_counter()
                verdicts.append(grader(p, g))
                secs.append(time.perf_counter() - t)
    n, t_ours, t_mv = len(pairs), sum(s_ours), sum(s_mv)
    slow = [i for i, (p, g, _, _) in enumerate(pairs) if reward._decide_fast(p, [g]) is None]
    print(f"pairs: {n} from {len(golds)} golds "
          + ", ".join(f"{c} {sum(x[3] == c for x in pairs)}" for c in ("self", "rewrite", "wrong")))
    for name, verdicts, secs in (("reward.is_equivalent", ours, t_ours), ("math-verify alone", theirs, t_mv)):
        agree = [v == lab for v, (_, _, lab, _) in zip(verdicts, pairs)]
        per = ", ".join(f"{c} {sum(a for a, x in zip(agree, pairs) if x[3] == c)}/{sum(x[3] == c for x in pairs)}"
                        for c in ("self", "rewrite", "wrong"))
        print(f"{name:22s} {n / secs:9.1f} pairs/s   agreement {sum(agree) / n:.4f} ({per})")
        shown = [x for a, x in zip(agree, pairs) if not a][:args.show]
        for p, g, lab, c in shown:
            print(f"    {c:7s} label={lab!s:5s} pred={p!r} gold={g!r}")
    print(f"speed ratio (ours / math-verify): {t_mv / t_ours:.2f}")
    slow_ours, slow_mv = sum(s_ours[i] for i in slow), sum(s_mv[i] for i in slow)
    print(f"the {len(slow)} pairs the fast path leaves to math-verify workers: reward.is_equivalent "
          f"{len(slow) / slow_ours:.1f} pairs/s, math-verify alone {len(slow) / slow_mv:.1f} pairs/s, "
          f"ratio {slow_mv / slow_ours:.2f}")
    print("adversarial answers, worst seconds per call (limit " + f"{reward.DEFAULT_TIMEOUT:g} s): "
          + ", ".join(f"{k} {v:.2f}" for k, v in adversarial_seconds().items()))


if __name__ == "__main__":
    main()
