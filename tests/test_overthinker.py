"""The overthinker (bench/overthinker.py): its problems, its traces and its warm start; and eval.py's tokens to the
first correct answer (infra/first_correct.py), which measures it."""
import importlib.util
import json
import re
from collections import Counter
from pathlib import Path

import pytest

import data
import reward
from infra import first_correct

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("overthinker", ROOT / "bench" / "overthinker.py")
overthinker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(overthinker)

CALC = re.compile(r"(\d+) ([-+*]) (\d+) = (\d+)")


def results(paragraph):
    """Each 'a op b = c' of a paragraph -> (c, whether c is a op b)."""
    ops = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__}
    return [(int(c), ops[op](int(a), int(b)) == int(c)) for a, op, b, c in CALC.findall(paragraph)]


@pytest.fixture(scope="module")
def problems():
    return data.load_dataset("overthink_train", overthinker.SYSTEM_PROMPT)


def test_the_problem_sets_are_bundled_story_problems_of_two_or_three_events():
    train, test = data.load_dataset("overthink_train"), data.load_dataset("overthink_test")
    assert (len(train), len(test)) == (1000, 100) and {r["data_source"] for r in train + test} == {"story"}
    assert not {r["problem"] for r in train} & {r["problem"] for r in test}
    assert not {r["problem"] for r in test} & {r["problem"] for r in data.load_dataset("story_test")}
    events = Counter(len(overthinker.parse_story(r["problem"])[3]) for r in train)
    assert set(events) == {2, 3} and min(events.values()) > 400, events
    assert data.load_dataset("overthink_test") == test  # generated, the same every time


def test_every_trace_reaches_the_right_answer_then_rechecks_and_some_slip(problems):
    slipped, rechecks = 0, Counter()
    for rec in problems:
        t = overthinker.trace(rec)
        gold = int(rec["ground_truth"])  # data.make_story's count, computed apart from the trace
        paragraphs = t["response"].split("\n\n")
        working, checks, last = paragraphs[0], paragraphs[1:-1], paragraphs[-1]
        steps = results(working)
        assert steps and all(ok for _, ok in steps) and steps[-1][0] == gold, (rec["id"], working)
        assert t["response"][:t["first_answer"]].endswith(f"= {gold}")
        assert last == f"Answer: {t['final']}" and reward.extract_answer(t["response"]) == t["final"]
        assert reward.find_answer(t["response"], first=True).end == len(t["response"])  # the only answer line
        assert 1 <= t["rechecks"] == len(checks) <= overthinker.MAX_RECHECKS
        for check in checks[:-1] if t["slipped"] else checks:  # re-checks before a slip: right, and say so
            assert all(ok for _, ok in results(check)) and re.findall(r"\d+", check)[-1] == str(gold), check
        if t["slipped"]:
            slip = results(checks[-1])
            assert not all(ok for _, ok in slip) and int(t["final"]) != gold and int(t["final"]) >= 0
            assert slip[-1][0] == int(t["final"]) and f"not {gold}" in checks[-1]
        else:
            assert t["final"] == t["answer"] == str(gold)
        slipped += t["slipped"]
        rechecks[t["rechecks"]] += 1
    assert 0.2 < slipped / len(problems) < 0.35 and sorted(rechecks) == [1, 2, 3, 4, 5], (slipped, rechecks)


def test_traces_are_deterministic_per_problem_and_seed(problems):
    first = [overthinker.trace(r) for r in problems[:50]]
    assert first == [overthinker.trace(r) for r in problems[:50]]
    assert first != [overthinker.trace(r, seed=1) for r in problems[:50]]
    assert overthinker.trace(problems[7]) == first[7]  # a trace depends on its problem alone, not on its neighbours


def test_a_text_that_is_no_story_problem_is_refused():
    with pytest.raises(ValueError, match="not a story problem"):
        overthinker.parse_story("What is 2 + 3?")


def test_an_out_that_holds_something_else_is_refused_untouched(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as e:
        overthinker.main(["--out", str(tmp_path), "--steps", "1"])
    assert e.value.code == 2 and [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: --out {tmp_path} holds something else than an overthinker (no overthinker.json): give another --out")


def test_first_correct_reads_stated_results_whole():
    text = "5 + 3 = 8.\n8 - 6 = 2 apples, so the count is 23? No: it is 2.\n\nAnswer: 2"
    assert first_correct.first_correct_end(text, "2") == text.index("= 2") + 3
    assert first_correct.first_correct_end(text, "23") == text.index("is 23") + 5
    assert first_correct.first_correct_end("8 * 2 = 16, not 2", "2") is None  # a number not stated as a result
    assert first_correct.first_correct_end("\\boxed{1,000}", ["7", "1000"]) == len("\\boxed{1,000")
    assert first_correct.first_correct_end("x = 2", "\\frac{1}{2}") is None  # numeric golds only
    text = "The number doubles: 8 * 2 = 16 and 16 is 16.5"
    assert first_correct.first_correct_end(text, "16.5") == len(text)


def test_first_correct_tokens_counts_the_tokens_up_to_it(tiny_model_dir):
    """As eval.py counts them: the character offset in the decoded response, then rollout.tokens_through."""
    import rollout
    from infra.hf import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    t = overthinker.trace(data.load_dataset("overthink_test")[0])
    ids = tok.encode(t["response"], add_special_tokens=False)
    decode = lambda x: tok.decode(x, skip_special_tokens=True)  # noqa: E731
    assert first_correct.first_correct_end(decode(ids), t["answer"]) == t["first_answer"]
    n = rollout.tokens_through(ids, decode, t["first_answer"])
    assert len(decode(ids[:n])) >= t["first_answer"] > len(decode(ids[:n - 1]))
    assert first_correct.first_correct_end(decode(ids), "999") is None


@pytest.mark.slow
def test_a_tiny_warm_start_lowers_its_loss_and_writes_a_loadable_model(tiny_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "overthinker"
    losses = overthinker.warm_start(tiny_model_dir, out, steps=12, batch_size=4, lr=3e-3, dtype="float32", limit=16,
                                    log=lambda *a: None)
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < 0.8 * losses[0], losses
    recipe = json.loads((out / "overthinker.json").read_text())
    assert recipe["loss"] == losses and recipe["steps"] == 12 and recipe["traces"] == 16
    net = AutoModelForCausalLM.from_pretrained(out)
    assert next(net.parameters()).dtype == torch.bfloat16
    assert [p.name for p in tmp_path.iterdir()] == ["overthinker"]  # no temporary directory left
