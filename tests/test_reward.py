"""Tests for reward.py: extraction, equivalence on real gold answers, adversarial inputs, rewards."""
import json
import os
import signal
import threading
import time

import pytest

import reward
from infra import grading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "data")
if not os.path.exists(os.path.join(DATA, "math500.jsonl")):
    DATA = os.path.join(ROOT, "..", "shared", "data")
FILES = {"math500": "math500.jsonl", "minerva": "minerva.jsonl", "olympiad": "olympiadbench.jsonl",
         "aime24": "aime24.jsonl", "gsm8k": "gsm8k_test.jsonl"}
_golds = {}


def gold(name, row_id):
    if name not in _golds:
        with open(os.path.join(DATA, FILES[name])) as f:
            _golds[name] = {r["id"]: r["answer"] for r in map(json.loads, f)}
    return _golds[name][row_id]


PAPER, REFERENCE = reward.INTERVENTIONS

# ------------------------------------------------------------------------------------------------
EXTRACTION = [
    ("nested braces", r"so $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
    ("nested set braces", r"\boxed{\left\{1, 2\right\}}", r"\left\{1, 2\right\}"),
    ("exponent braces", r"The answer is \boxed{x^{2^{3}}} indeed", r"x^{2^{3}}"),
    ("several boxes: last wins", r"first \boxed{1}, then \boxed{2}", "2"),
    ("truncated last box", r"\boxed{3} but wait \boxed{4+", "3"),
    ("fbox", r"hence \fbox{7}", "7"),
    ("boxed without braces", r"hence \boxed 7$", "7"),
    ("empty box is the prompt echo", r"put your final answer within \boxed{}. Ok.", None),
    ("answer tags", "thinking...<answer>42</answer>", "42"),
    ("last answer tag", "<answer>1</answer> no wait <answer> 1/2 </answer>", "1/2"),
    ("unclosed tag cut by stop string", "so <answer>17", "17"),
    ("empty last tag", "<answer>1</answer> then <answer> </answer>", "1"),
    ("box beats tag", r"<answer>3</answer> and \boxed{4}", "4"),
    ("reference intervention only", "I think it is 5 " + REFERENCE, None),
    ("intervention then tag", "long thought " + REFERENCE + " <answer>12</answer>", "12"),
    ("paper intervention then box", "hmm " + PAPER + r" \boxed{5}", "5"),
    ("tag echo", "I should put the answer between <answer> and </answer>.", None),
    ("final answer line", "Final Answer: The final answer is $18$. I hope it is correct.", "18"),
    ("answer line", "work\nAnswer: 7\n", "7"),
    ("markdown answer line", "**Final Answer:** 3/4", "3/4"),
    ("no answer", "I do not know how to solve this.", None),
    ("empty", "", None),
]


@pytest.mark.parametrize("case,text,want", EXTRACTION, ids=[c[0] for c in EXTRACTION])
def test_extract_answer(case, text, want):
    assert reward.extract_answer(text) == want


def test_real_solutions_score_one():
    """AoPS solutions (real text: several boxes, $...$, author tags) against their gold answers."""
    with open(os.path.join(DATA, "aime_1983_2023_train.jsonl")) as f:
        rows = [json.loads(line) for line in f][:300]
    out = reward.score_batch("aime", [r["solution"] for r in rows], [r["answer"] for r in rows], timeout=30)
    assert sum(o["score"] for o in out) >= 297
    shifted = reward.score_batch("aime", [r["solution"] for r in rows[1:]], [r["answer"] for r in rows[:-1]])
    assert sum(o["score"] for o in shifted) <= 10  # other problems' answers: almost all wrong


def test_extract_last_number_is_opt_in():
    text = "She sells 9 eggs for $2 each, so she makes $1,018 every day"
    assert reward.extract_answer(text) is None
    assert reward.extract_answer(text, last_number=True) == "1018"


# ------------------------------------------------------------------------------------------------
# (file, id, prediction, expected): gold answers are read from the data files.
EQUIV = [
    ("math500", "test/counting_and_probability/508.json", "10080", True),       # 10,\!080
    ("math500", "test/counting_and_probability/508.json", "10{,}080", True),
    ("math500", "test/counting_and_probability/508.json", r"10\,080", True),
    ("math500", "test/counting_and_probability/508.json", "10 080", True),
    ("math500", "test/counting_and_probability/508.json", "10180", False),
    ("math500", "test/algebra/2626.json", "32,348 dollars", True),               # \$32,\!348
    ("math500", "test/algebra/2626.json", r"\$32348", True),
    ("math500", "test/algebra/2626.json", "32347", False),
    ("math500", "test/number_theory/417.json", "11111111100", True),             # 11,\! 111,\! 111,\! 100
    ("math500", "test/number_theory/417.json", "11111111110", False),
    ("math500", "test/prealgebra/1003.json", r"\dfrac{270}{7}", True),           # \frac{270}7\text{ degrees}
    ("math500", "test/prealgebra/1003.json", r"\frac{270}{7}^\circ", True),
    ("math500", "test/prealgebra/1003.json", "38.5714", True),
    ("math500", "test/prealgebra/1003.json", r"\frac{270}{17}", False),
    ("math500", "test/prealgebra/1003.json", "38.6", False),
    ("math500", "test/geometry/347.json", "76", True),                           # 76^\circ
    ("math500", "test/geometry/347.json", "76\u00b0", True),
    ("math500", "test/geometry/347.json", "76 degrees", True),
    ("math500", "test/geometry/347.json", r"104^\circ", False),
    ("math500", "test/intermediate_algebra/662.json", r"1-\sqrt{19}, 1+\sqrt{19}", True),  # 1 \pm \sqrt{19}
    ("math500", "test/intermediate_algebra/662.json", r"1+\sqrt{19}", False),
    ("math500", "test/intermediate_algebra/662.json", r"1 \pm \sqrt{17}", False),
    ("math500", "test/precalculus/807.json", r"(3, \pi/2)", True),               # \left( 3, \frac{\pi}{2} \right)
    ("math500", "test/precalculus/807.json", r"\left(3,\dfrac{\pi}{2}\right)", True),
    ("math500", "test/precalculus/807.json", r"(\frac{\pi}{2}, 3)", False),
    ("math500", "test/precalculus/807.json", r"(3, \pi)", False),
    ("math500", "test/intermediate_algebra/428.json", "7, 5, 3", True),         # 3, 5, 7
    ("math500", "test/intermediate_algebra/428.json", r"\{3,5,7\}", True),
    ("math500", "test/intermediate_algebra/428.json", "3, 5", False),
    ("math500", "test/intermediate_algebra/428.json", "3, 5, 9", False),
    ("math500", "test/intermediate_algebra/1102.json", "x=1, x=-2", True),      # -2,1
    ("math500", "test/intermediate_algebra/1102.json", "2, -1", False),
    ("math500", "test/precalculus/819.json", "C", True),                         # \text{(C)}
    ("math500", "test/precalculus/819.json", r"\textbf{(C)}", True),
    ("math500", "test/precalculus/819.json", "(D)", False),
    ("math500", "test/algebra/1349.json", "evelyn", True),                       # \text{Evelyn}
    ("math500", "test/algebra/1349.json", r"\text{Emily}", False),
    ("math500", "test/prealgebra/1044.json", "5.40", True),                      # 5.4 \text{ cents}
    ("math500", "test/prealgebra/1044.json", "54", False),
    ("math500", "test/geometry/473.json", r"864 \text{ in}^2", True),            # 864 \mbox{ inches}^2
    ("math500", "test/geometry/473.json", "846", False),
    ("math500", "test/algebra/2470.json", "137.5", True),                        # 137 \frac{1}{2} (mixed)
    ("math500", "test/algebra/2470.json", r"\frac{275}{2}", True),
    ("math500", "test/algebra/2470.json", "68.5", False),
    ("math500", "test/prealgebra/153.json", r"0.\overline{5}", True),            # \frac 59
    ("math500", "test/prealgebra/153.json", "5/9", True),
    ("math500", "test/prealgebra/153.json", "0.56", False),
    ("math500", "test/prealgebra/153.json", r"\frac{9}{5}", False),
    ("math500", "test/intermediate_algebra/558.json", r"\left(3, 4\right]", True),  # (3,4]
    ("math500", "test/intermediate_algebra/558.json", "(3,4)", False),
    ("math500", "test/intermediate_algebra/558.json", "[3,4]", False),
    ("math500", "test/intermediate_algebra/1981.json", r"(12,102)\cup(2,12)", True),  # (2,12) \cup (12,102)
    ("math500", "test/intermediate_algebra/1981.json", r"(2,12) \cup [12,102)", False),
    ("math500", "test/intermediate_algebra/2015.json", r"-2, 1+\sqrt5, 1-\sqrt5", True),  # \{1\pm\sqrt{5},-2\}
    ("math500", "test/intermediate_algebra/2015.json", r"1+\sqrt{5}, -2", False),
    ("math500", "test/precalculus/323.json", "2x+3", True),                      # y = 2x + 3
    ("math500", "test/precalculus/323.json", "y=3+2x", True),
    ("math500", "test/precalculus/323.json", "y = 2x - 3", False),
    ("math500", "test/algebra/101.json", "[-2, 7]", True),                       # x \in [-2,7]
    ("math500", "test/algebra/101.json", "(-2,7)", False),
    ("math500", "test/precalculus/920.json", r"\begin{bmatrix}-1&0\\0&-1\end{bmatrix}", True),
    ("math500", "test/precalculus/920.json", r"\begin{pmatrix} 1 & 0 \\ 0 & -1 \end{pmatrix}", False),
    ("math500", "test/number_theory/516.json", "2516_{8}", True),                # 2516_8
    ("math500", "test/number_theory/516.json", "2516_9", False),
    ("math500", "test/counting_and_probability/737.json", "58500", True),        # 58,500
    ("math500", "test/counting_and_probability/737.json", "58,000", False),
    ("math500", "test/counting_and_probability/1114.json", "0.30556", True),     # \frac{11}{36}
    ("math500", "test/counting_and_probability/1114.json", r"\frac{11}{63}", False),
    ("math500", "test/algebra/1098.json", "9i+6", True),                         # 6+9i
    ("math500", "test/algebra/1098.json", "6-9i", False),
    ("math500", "test/intermediate_algebra/1217.json", "-1+x-x^2+x^3-x^4+x^5", True),
    ("math500", "test/intermediate_algebra/1217.json", "x^5 - x^4 + x^3 - x^2 + x + 1", False),
    ("math500", "test/algebra/2043.json", r"(3,\infty)\cup(-\infty,2)", True),
    ("math500", "test/algebra/2043.json", r"(-\infty, 2] \cup (3, \infty)", False),
    ("math500", "test/intermediate_algebra/1797.json", r"\sqrt{20}", True),      # 2 \sqrt{5}
    ("math500", "test/intermediate_algebra/1797.json", r"2\sqrt{6}", False),
    ("math500", "test/number_theory/598.json", r"6.72 \times 10^{-5}", True),  # .0000672
    ("math500", "test/number_theory/598.json", ".0000673", False),  # math-verify rounds to 6 places: True
    ("minerva", "minerva-215", r"4.46 \times 10^{19}", True),                    # 4.46e19
    ("minerva", "minerva-215", r"44.6\cdot10^{18}", True),
    ("minerva", "minerva-215", "4.4603e+19", True),
    ("minerva", "minerva-215", "4.47e19", False),
    ("minerva", "minerva-215", "4.46e18", False),
    ("minerva", "minerva-197", r"1.24 \times 10^{-8} \mathrm{~m}", True),        # 1.24e-8
    ("minerva", "minerva-197", "3e-8", False),  # math-verify reads 1.24e-8 as 1.24*E - 8
    ("minerva", "minerva-207", "0.55400", True),                                 # 0.554
    ("minerva", "minerva-207", "0.564", False),
    ("minerva", "minerva-020", "6,630", True),                                    # 6630
    ("minerva", "minerva-020", "6631", False),
    ("minerva", "minerva-079", r"-\frac{1}{5}", True),                           # -0.2
    ("minerva", "minerva-079", "0.2", False),
    ("minerva", "minerva-104", r"\frac{37}{4}m", True),                          # \frac{37}{4} m
    ("minerva", "minerva-104", r"\frac{37}{4}", False),  # m may be a variable: see olympiadbench-2185
    ("minerva", "minerva-136", "10^{11}", True),                                 # 1e11
    ("minerva", "minerva-136", "1e10", False),
    ("olympiad", "olympiadbench-2185", "6m", True),                              # 6m (m is a variable)
    ("olympiad", "olympiadbench-2185", "6", False),
    ("olympiad", "olympiadbench-2276", "8", True),                               # 8 \%
    ("olympiad", "olympiadbench-2276", "0.08", True),
    ("olympiad", "olympiadbench-2276", "8 percent", True),
    ("olympiad", "olympiadbench-2276", r"9\%", False),
    ("olympiad", "olympiadbench-2063", "2n - 1", True),                          # k=2 n-1
    ("olympiad", "olympiadbench-2063", "2n+1", False),
    ("olympiad", "olympiadbench-2171", "f(x)=-x, f(x)=x", True),                 # f(x)=x,f(x)=-x
    ("olympiad", "olympiadbench-2171", "f(x)=x", False),
    ("olympiad", "olympiadbench-1618", "(4,5,7),(1,8,19),(2,7,13)", True),       # (1,8,19), (2,7,13), (4,5,7)
    ("olympiad", "olympiadbench-1618", "(1,8,19),(2,13,7),(4,5,7)", False),
    ("olympiad", "olympiadbench-1618", "(1,8,19),(2,7,13)", False),
    ("olympiad", "olympiadbench-2539", r"0.25, 64", True),                       # 64,\frac{1}{4}
    ("olympiad", "olympiadbench-2539", "64", False),
    ("olympiad", "olympiadbench-2578", "0.6667", True),                          # \frac{2}{3}
    ("olympiad", "olympiadbench-2578", "0.67", False),
    ("olympiad", "olympiadbench-1820", "1+n^2", True),                           # n^{2}+1
    ("olympiad", "olympiadbench-1820", "n^2-1", False),
    ("olympiad", "olympiadbench-1920", "2^k", True),                             # 2^{k}
    ("olympiad", "olympiadbench-1920", "2k", False),
    ("aime24", "aime24-I-02", "025", True),                                      # 25
    ("aime24", "aime24-I-02", "250", False),
    ("aime24", "aime24-I-01", r"204\text{ minutes}", True),                      # 204
    ("aime24", "aime24-I-01", "240", False),
    ("gsm8k", "gsm8k-test-0829", r"\$14,000", True),                             # 14000
    ("gsm8k", "gsm8k-test-0829", "14000.00", True),
    ("gsm8k", "gsm8k-test-0829", r"1.4 \times 10^4", True),
    ("gsm8k", "gsm8k-test-0829", "14001", False),
    ("gsm8k", "gsm8k-test-0000", "17.99", False),                                # 18
]


@pytest.mark.parametrize("name,row_id,pred,want", EQUIV, ids=[f"{c[1]}:{c[2]}" for c in EQUIV])
def test_equivalence_on_real_golds(name, row_id, pred, want):
    assert reward.is_equivalent(pred, gold(name, row_id), timeout=30) is want  # correctness, not speed


def test_every_gold_equals_itself_and_a_list_gold_accepts_any():
    for name, path in FILES.items():
        with open(os.path.join(DATA, path)) as f:
            for r in map(json.loads, f):
                assert reward.is_equivalent(r["answer"], r["answer"]), r["id"]
    assert reward.is_equivalent("3", ["2", "3"]) and not reward.is_equivalent("4", ["2", "3"])


# ------------------------------------------------------------------------------------------------
ADVERSARIAL = [
    ("power tower", "9^{9^{9^{9^{9}}}}"),
    ("100k chars", "1+" * 50000 + "1"),
    ("5000 unbalanced braces", "{" * 5000),
    ("NUL byte", "12\x003"),
    ("tower under the pre-checks", "9^{9^{9}}"),  # reaches the guard; its kill is the limit
]


def _warm():
    """Have a ready worker: the limit counts comparison time, not a (re)start's imports, which
    can take seconds on a loaded machine."""
    assert reward.is_equivalent("x^2", r"x \cdot x", timeout=30)  # generous: other jobs share the CPUs
    return grading._GUARDS[0]["pid"]  # the worker is_equivalent uses


# Wall times are the bench's job (bench/reward_bench.py): these tests bound time with the timeout
# marker and check the mechanism, a worker killed at the limit (a new pid), not how fast it goes.
@pytest.mark.timeout(120)  # a hang is a failure, not a stuck test run
@pytest.mark.parametrize("case,s", ADVERSARIAL, ids=[c[0] for c in ADVERSARIAL])
def test_adversarial_answers_fail_and_grader_survives(case, s):
    for pred, g in ((s, "1"), ("1", s)):
        _warm()
        assert reward.is_equivalent(pred, g) is False, case
    reward.is_equivalent(s, s)  # any verdict, but an answer
    assert reward.is_equivalent("x^3+3x-6", "-6+3x+x^3", timeout=30)  # needs math-verify: still works


@pytest.mark.timeout(120)  # math-verify alone does not finish 9^(9^9) in 30 s: only the kill ends it
def test_a_comparison_over_its_limit_kills_its_worker():
    pid = _warm()
    assert reward.is_equivalent("9^{9^{9}}", "2", timeout=0.5) is False
    assert grading._GUARDS[0]["pid"] != pid  # killed and replaced, not answered
    assert reward.is_equivalent(r"\frac{x^3-1}{x-1}", "x^2+x+1", timeout=30)


@pytest.mark.timeout(120)
def test_time_limit_holds_off_the_main_thread():
    out = {}

    def work():
        pid = _warm()
        out["adv"] = reward.is_equivalent("9^{9^{9}}", "2"), grading._GUARDS[0]["pid"] != pid
        pid = _warm()
        out["slow"] = (reward.is_equivalent(r"\frac{x^3-1}{x-1}", "x^2+x+1", timeout=1e-3),
                       grading._GUARDS[0]["pid"] != pid)
        out["normal"] = reward.is_equivalent(r"\frac{x^3-1}{x-1}", "x^2+x+1", timeout=30)
    t = threading.Thread(target=work)
    t.start()
    t.join(120)
    assert out["adv"] == (False, True)
    assert out["slow"] == (False, True)  # killed at the limit, not answered
    assert out["normal"] is True


def _wait_gone(pid):
    while True:  # killed guards are reaped by the zygote (SIGCHLD ignored), so the pid goes away
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)


@pytest.mark.timeout(120)
def test_dead_worker_and_dead_zygote_are_replaced():
    pid = _warm()
    os.kill(pid, signal.SIGKILL)
    _wait_gone(pid)
    assert reward.is_equivalent("(x+1)^2", "x^2+2x+1", timeout=30)  # a new guard answers
    assert grading._GUARDS[0]["pid"] != pid
    zygote = grading._ZYGOTE["proc"]
    zygote.kill()
    zygote.wait()
    pid = grading._GUARDS[0]["pid"]
    os.kill(pid, signal.SIGKILL)
    _wait_gone(pid)
    assert reward.is_equivalent("(x-1)^2", "x^2-2x+1", timeout=30)  # a new zygote forks a new guard
    assert grading._ZYGOTE["proc"] is not zygote


@pytest.mark.timeout(120)
def test_forked_child_grades_with_its_own_workers():
    parent = _warm()
    child = os.fork()
    if child == 0:  # the parent's guards are not ours: a new zygote, the parent's left alone
        ok = reward.is_equivalent("(x+2)^2", "x^2+4x+4", timeout=30) and grading._GUARDS[0]["pid"] != parent
        os._exit(0 if ok else 1)
    assert os.waitpid(child, 0)[1] == 0
    assert reward.is_equivalent("(x+3)^2", "x^2+6x+9", timeout=30) and grading._GUARDS[0]["pid"] == parent


# ------------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_many_threads_share_the_worker():
    pairs = [("x^3+3x-6", "-6+3x+x^3", True), ("(x+1)^2", "x^2+2x+1", True), ("(x-1)^2", "x^2+2x+1", False)]
    got = {}

    def work(k):
        got[k] = [reward.is_equivalent(p, g, timeout=30) for p, g, _ in pairs]
    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert got == {k: [want for _, _, want in pairs] for k in range(4)}


def score(data_source, response, ground_truth):
    """One response's reward, as score_batch gives it."""
    return reward.score_batch([data_source], [response], [ground_truth])[0]


def test_score_is_binary():
    r = score("math500", r"so \boxed{\dfrac{1}{2}}", "\\frac12")
    assert r == {"score": 1.0, "acc": 1.0, "has_answer": 1.0, "pred": r"\dfrac{1}{2}"}
    assert score("math500", r"\boxed{0.6}", "\\frac12")["score"] == 0.0
    r = score("math500", "no idea", "1")
    assert (r["score"], r["has_answer"], r["pred"]) == (0.0, 0.0, None)
    assert score("math500", "Answer: 3", ["2", "3"])["score"] == 1.0  # any 'Answer:' counts


def test_score_batch_length_cost_on_every_response():
    responses = [r"\boxed{25}", r"so \boxed{24}", "no answer at all", "Answer: 25"]
    lengths = [300, 41, 7, 1200]
    accs = [1.0, 0.0, 0.0, 1.0]  # by hand: which of these say 25
    got = reward.score_batch("aime24", responses, ["25"] * 4, lengths=lengths, length_coef=1e-3)
    assert [r["acc"] for r in got] == accs  # acc is unchanged
    assert [r["score"] for r in got] == pytest.approx([a - 1e-3 * n for a, n in zip(accs, lengths)])
    plain = reward.score_batch("aime24", responses, ["25"] * 4, lengths=lengths)  # no coefficient: no cost
    assert [r["score"] for r in plain] == accs
    with pytest.raises(ValueError, match="lengths"):
        reward.score_batch("aime24", responses, ["25"] * 4, length_coef=1e-3)
    with pytest.raises(ValueError, match="lengths"):
        reward.score_batch("aime24", responses, ["25"] * 4, lengths=lengths[:3], length_coef=1e-3)


def test_registry_and_fallbacks():
    @reward.register("my_source")
    def exact(data_source, response, ground_truth):
        return float(response.strip() == ground_truth)

    @reward.register("my_batch", batched=True)
    def lengths(predictions, references, data_source):
        return [{"score": float(len(p) == len(r))} for p, r in zip(predictions, references)]
    try:
        assert score("my_source", " abc ", "abc")["score"] == 1.0
        assert score("my_source_v2", "abd", "abc")["score"] == 0.0
        assert score("my_batch", "xyz", "abc")["score"] == 1.0
        gsm = "She makes 9 * 2 = 18 dollars every day."
        assert score("gsm8k_test", gsm, "18")["score"] == 1.0  # last-number fallback
        assert score("openai/gsm8k", gsm, "18")["score"] == 1.0
        assert score("math500", gsm, "18")["score"] == 0.0
        assert score("arith", "So 6 * 3 = 18.", "18")["score"] == 1.0  # synthetic sets: same fallback
        assert score("story", "5 + 4 = 9. Tom has 9 apples now.", "9")["score"] == 1.0
        assert reward.score_batch("story", ["Tom has 9 apples now."], ["9"], last_number=False)[0]["score"] == 0.0
        assert [o["score"] for o in reward.score_batch(["arith", "arith"], ["6 * 3 = 18.", "6 * 3 = 19."],
                                                       ["18", "18"])] == [1.0, 0.0]
        assert score("never_registered", r"\boxed{18}", "18")["score"] == 1.0
        out = reward.score_batch(["my_source", "my_batch", "my_batch", "math500"],
                                 ["abc", "xy", "xyz", r"\boxed{2}"], ["abc", "abc", "abc", "3"])
        assert [o["score"] for o in out] == [1.0, 0.0, 1.0, 0.0]
    finally:
        reward._REGISTRY.pop("my_source")
        reward._REGISTRY.pop("my_batch")


@pytest.mark.timeout(300)
def test_score_batch_pool_keeps_order_and_limits():
    with open(os.path.join(DATA, FILES["math500"])) as f:
        golds = [r["answer"] for r in map(json.loads, f)
                 if ("\\sqrt" in r["answer"] or "\\pi" in r["answer"]) and "," not in r["answer"]][:40]
    responses, truths = [], []
    for i, g in enumerate(golds):  # "(g)+0" / "(g)+1" need math-verify, so they go to the pool
        responses.append(r"\boxed{(" + g + ")+" + str(i % 2) + "}")
        truths.append(g)
    responses[6], truths[6] = r"\boxed{9^{9^{9}}}", "5"  # times out inside the pool
    got = reward.score_batch(["math500"] * len(golds), responses, truths, workers=2, timeout=3.0)
    assert [o["score"] for o in got] == [float(i % 2 == 0 and i != 6) for i in range(len(golds))]
    assert [o["pred"] for o in got] == [reward.extract_answer(r) for r in responses]
    assert len(grading._GUARDS) >= 2  # the pool really ran


# ----------------------------------------------------------------------------- first answer (the turn rule's)

@pytest.mark.parametrize("text,want,how,end_text", [
    # the reference's order: a closed <answer> tag, else an 'Answer:' paragraph, else the first closed box
    (r"\boxed{3} then <answer>4</answer> and <answer>5</answer>", "4", "tag", r"\boxed{3} then <answer>4</answer>"),
    ("Answer: 4\n\nno wait, \\boxed{5}", "4", "line", "Answer: 4"),
    ("so the final answer: 7\nnext line\n\nmore", "7", "line", "so the final answer: 7\nnext line"),
    (r"\boxed{1+\frac{1}{2}} and \boxed{2}", r"1+\frac{1}{2}", "boxed", r"\boxed{1+\frac{1}{2}}"),
    (r"\boxed{unclosed and \boxed{6}", "6", "boxed", r"\boxed{unclosed and \boxed{6}"),
    (r"<answer>your answer</answer> then \boxed{8}", "8", "boxed", r"<answer>your answer</answer> then \boxed{8}"),
])
def test_find_answer_first(text, want, how, end_text):
    found = reward.find_answer(text, first=True)
    assert (found.text, found.how, text[:found.end]) == (want, how, end_text)


def test_find_answer_first_needs_an_explicit_answer():
    assert reward.find_answer("I get 4 and then 5", first=True) is None
    assert reward.find_answer("I get 4 and then 5", first=True, last_number=True).text == "5"
    assert reward.find_answer(r"the answer is \boxed{", first=True) is None  # not complete yet
    # an intervention sentence naming the tags is not an answer, and offsets stay those of the text
    text = reward.INTERVENTIONS[1] + r" \boxed{3}"
    found = reward.find_answer(text, first=True)
    assert found.text == "3" and text[:found.end].endswith(r"\boxed{3}")
