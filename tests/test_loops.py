"""A model that loops after its answer must show it in every number we report: the tokens the engine decoded (not
the ones a turn's cut kept) and `repeated`, in rollouts, training metrics, validation and eval.py; a model that stops
must not. The branches of rollout.sample's bookkeeping run on a scripted engine; eval.py and validation run real
vLLM engines on scripted *models* (conftest.make_scripted_model: real weights whose greedy output loops after
`Answer: 7`, or stops after it), as a model trained into that habit would."""
import json
import os
from types import SimpleNamespace

import pytest
from conftest import run_script
from test_turn_rule import EOS, ids, iv, run, tok  # noqa: F401 (iv, tok: the fixtures, SmolLM2's tokenizer)

import eval as ev
import eval_report
import reward
import rollout
import train_logs
from infra.repetition import repeated

ENV = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}


def loop(tok, text, n):
    """`text` repeated until it fills n tokens (token ids)."""
    one = ids(tok, text)
    return (one * (n // len(one) + 1))[:n]


# ----------------------------------------------------------------------------- rollouts and the training metrics

def test_a_turn_that_loops_after_its_answer_pays_for_every_decoded_token(tok, iv):
    # the answer paragraph, then the same paragraph again until the 64-token budget: the cut keeps the first
    head = ids(tok, "6 + 9 = 15.\nAnswer: 15.")
    script = head + loop(tok, "\n\nAnswer: 15.", 64 - len(head))
    (t,), _ = run(tok, iv, [[script]], turn_tokens=64)
    assert t["response_ids"] == head and t["dropped_ids"] == script[len(head):]
    assert (t["decoded_tokens"], sum(t["action_mask"]), t["stopped"]) == (64, len(head), False)
    assert t["repeated"] and t["repeated_after_answer"] and t["answered"] and not t["hit_cap"]
    # the answer line again and again with no blank line: the reference's cut keeps the whole paragraph
    lines = head + loop(tok, "\nAnswer: 15.", 64 - len(head))
    (u,), _ = run(tok, iv, [[lines]], turn_tokens=64)
    assert u["response_ids"] == lines and u["dropped_ids"] == [] and u["decoded_tokens"] == 64
    assert u["repeated_after_answer"]
    # the same answer, then the model stops: nothing dropped, nothing repeated
    (v,), _ = run(tok, iv, [[head + [EOS]]], turn_tokens=64)
    assert (v["decoded_tokens"], len(v["response_ids"]), v["stopped"], v["repeated"]) == (len(head) + 1,) * 2 + (True, False)
    # two answers, then on to the budget without a loop: decoded, not repeated
    more = head + ids(tok, "\n\nLet me check it once more: six and nine make fifteen, so it is right.")
    (w,), _ = run(tok, iv, [[more]], turn_tokens=len(more) - 1)
    assert w["decoded_tokens"] == len(more) - 1 and not w["stopped"] and not w["repeated"]
    sums = rollout.trajectory_sums([t, u, v, w])
    assert sums["decoded_tokens"] == 64 + 64 + len(head) + 1 + len(more) - 1
    assert sums["kept_tokens"] == len(head) + 64 + len(head) + 1 + len(head)
    assert (sums["repeated"], sums["repeated_after_answer"], sums["intervention_tokens"]) == (2, 2, 0)


def test_interventions_are_counted_apart_and_a_dropped_stop_is_still_decoded(tok, iv):
    first, second = ids(tok, "I think it is four.", EOS), ids(tok, "So \\boxed{4}", EOS)
    (t,), _ = run(tok, iv, [[first, second]], turn_tokens=64)
    assert t["decoded_tokens"] == len(first) + len(second)  # the first turn's EOS was decoded, then dropped
    assert t["turn_spans"] == [[0, len(first)], [len(first) - 1 + len(iv), len(second)]]
    sums = rollout.trajectory_sums([t])
    assert (sums["kept_tokens"], sums["intervention_tokens"]) == (len(first) - 1 + len(second), len(iv))
    # an answerless loop through every turn: repeated, and not after an answer
    ramble = loop(tok, "I think I think ", 70)
    (u,), _ = run(tok, iv, [[ramble] * 3], turn_tokens=70, max_turns=2)
    assert u["hit_cap"] and u["repeated"] and not u["repeated_after_answer"] and u["decoded_tokens"] == 210


def test_the_step_line_and_validation_line_show_kept_tokens_only_where_they_differ():
    keys = {"decoded_tokens": 64.0, "kept_tokens": 17.0, "intervention_tokens": 0.0, "repeated": 0.5,
            "repeated_after_answer": 0.5}
    assert train_logs.format_tokens({f"val/{k}": v for k, v in keys.items()}, "val/") == \
        "tokens 64.0 (kept 17.0)  repeated 50% (after an answer 50%)"
    same = {**keys, "kept_tokens": 64.0, "repeated": 0.0, "repeated_after_answer": 0.0}
    assert train_logs.format_tokens(same) == "tokens 64.0"


def test_repeated_after_an_answer_needs_the_whole_rest_to_loop():
    a, b, c = 11, 12, 13
    head = [1, 2, 3, 4]  # through the answer
    assert repeated(head + [a, b, c] * 4, capped=True, answered_at=4) == "after answer"
    assert repeated(head + [a, b, c] * 3, capped=True, answered_at=4) is None  # three copies: no loop yet
    assert repeated(head + [a, b, c] * 4, capped=False, answered_at=4) is None  # the model ended it
    assert repeated(head + [5, 6, 7, 8, 9] + [a, b, c] * 4, capped=True, answered_at=4) is None  # not all of it
    assert repeated(head, capped=True, answered_at=4) is None
    assert repeated([a, b, c] * 30, capped=True) == "no answer"
    assert repeated([a, b, c] * 4, capped=True) is None  # no answer: 64 tokens at least, as before


def test_require_stop_takes_the_credit_of_answers_a_limit_cut():
    out = reward.score_batch("arith", ["Answer: 7", "Answer: 7", "Answer: 8"], ["7"] * 3, stopped=[True, False, False])
    assert [r["score"] for r in out] == [1.0, 0.0, 0.0] and [r["acc"] for r in out] == [1.0, 1.0, 0.0]


# ----------------------------------------------------------------------------- eval.py and validation, real engines

@pytest.mark.vllm
def test_eval_reports_the_loop_after_the_answer(tmp_path, answer_loop_models):
    """The README's evaluation example on two scripted models side by side (one engine, the second one's weights
    synced in): the looper decodes to the cap after its answer, the stopper stops."""
    out = tmp_path / "eval"
    looper, stopper = answer_loop_models["looper"], answer_loop_models["stopper"]
    sevens = tmp_path / "sevens.jsonl"  # the models' '7' is right for one: the tokens to it are its first 4
    sevens.write_text('{"problem": "What is 3 + 4?", "answer": "7"}\n{"problem": "What is 2 + 3?", "answer": "5"}\n')
    r = run_script("eval.py", stopper, looper, "--benchmarks", f"arith_test,{sevens}", "--limit", 6, "--system-prompt",
                   "answer-line", "--max-response-tokens", 40, "--budgets", "none", "--engine-dtype", "float32",
                   "--enforce-eager", "--out", out, env=ENV, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    results = json.loads((out / "summary.json").read_text())["results"]
    golds = [s["gold"] for s in samples if s["checkpoint"] == looper and s["benchmark"] == "arith_test"]
    for name, decoded, loops in ((looper, 40, 1.0), (stopper, 5, 0.0)):  # 'Answer: 7' is 4 tokens, then EOS
        mine = [s for s in samples if s["checkpoint"] == name]
        assert all(s["decoded_tokens"] == decoded == s["kept_tokens"] for s in mine)
        assert all(s["first_correct_tokens"] == (4 if s["gold"] == "7" else None) for s in mine)
        assert (results[name][str(sevens)]["reaches_correct"], results[name][str(sevens)]["first_correct_tokens"]) \
            == (0.5, 4)
        assert all(s["response_text"].startswith("Answer: 7") for s in mine)
        stats = results[name]["arith_test"]
        assert (stats["reaches_correct"], stats["first_correct_tokens"]) == (0.0, None)  # no gold is 7
        assert (stats["decoded_tokens"], stats["repeated"], stats["repeated_after_answer"]) == (decoded, loops, loops)
        assert stats["truncated"] == 0.0 and stats["accuracy"] == pytest.approx(sum(g == "7" for g in golds) / 6)
    md = (out / "summary.md").read_text()
    assert f"| {looper} | arith_test | 0.0 | 100.0 | 100.0 |" in md
    assert f"| {stopper} | arith_test | 0.0 | 0.0 | 0.0 |" in md
    assert "40 (+35, +700%)" in md  # the looper's tokens against the stopper's
    assert f"| {looper} | {sevens} | 50.0 | 4.0 | 40.0 |" in md  # reach it, tokens to it, decoded


@pytest.mark.vllm
def test_validation_and_multi_turn_eval_count_what_the_cut_dropped(answer_loop_models, tok):
    """Turns cut at their first answer (validation's multi-turn greedy, eval.py --max-turns): the looper keeps 4 tokens
    and decodes the whole turn budget; both figures are reported, and the loop is."""
    import data
    import train
    from infra import engines

    engine = engines.make_engine(answer_loop_models["looper"], kind="vllm", dtype="float32", seed=0,
                                 max_model_len=512, enforce_eager=True, gpu_memory_utilization=0.2)
    try:
        records = data.load_dataset("arith_test", system_prompt="answer-line", limit=4)
        prompts, _ = rollout.tokenize_prompts(tok, records)
        args = train.parse_args(["--data", "arith_test", "--max-turns", "2", "--turn-tokens", "24", "--system-prompt",
                                 "answer-line"])
        fake = SimpleNamespace(engine=engine, val_prompts=prompts, val_records=records, rank=0, world=1, master=False,
                               intervention_ids=rollout.intervention_ids(tok, args.intervention_text),
                               eos_ids=[tok.eos_token_id], device="cpu")
        m = train.validation_metrics(fake, train.validate(fake, args))
        assert (m["val/decoded_tokens"], m["val/kept_tokens"], m["val/intervention_tokens"]) == (24, 4, 0)
        assert (m["val/repeated"], m["val/repeated_after_answer"], m["val/turns"], m["val/answered"]) == (1, 1, 1, 1)

        eargs = SimpleNamespace(**{**vars(ev.parse_args(["x", "--max-turns", "1", "--turn-tokens", "24",
                                                         "--max-response-tokens", "60", "--budgets", "12"])),
                                   "budgets": [12]})
        gen = ev.generate(engine, tok, [{**r, "_benchmark": "arith_test"} for r in records], eargs, prompts=prompts)
        scored = ev.score_generated(gen, eargs, tok)
        for s in scored:
            assert (s["decoded_tokens"], s["kept_tokens"], s["intervention_tokens"]) == (24, 4, 0)
            assert s["repeated"] and s["repeated_after_answer"] and not s["truncated"]
            assert s["response_text"].startswith("Answer: 7\n\nAnswer: 7")  # what was decoded, the cut tail too
        stats = eval_report.summarize([{**s, "checkpoint": "looper"} for s in scored], [12], True)["looper"]["arith_test"]
        assert (stats["decoded_tokens"], stats["kept_tokens"], stats["repeated_after_answer"]) == (24, 4, 1.0)
        assert "| looper | arith_test | 24.0 | 4.0 | 0.0 |" in eval_report.markdown({"looper": {"arith_test": stats}}, [12])
    finally:
        engine.close()
