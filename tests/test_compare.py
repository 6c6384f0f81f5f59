"""bench/compare.py's pure parts: the runs' arguments (checked by train.py's and eval.py's own parsers), the cap,
standard errors, seed aggregation, the table and the gathering of finished runs."""
import importlib.util
import json
import math
from pathlib import Path

import pytest

import eval as eval_lib
import train

_spec = importlib.util.spec_from_file_location("compare", Path(__file__).resolve().parents[1] / "bench" / "compare.py")
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)

BASE = ("--model smollm2 --data arith_train --val-data arith_test --system-prompt answer-line --steps 12 "
        "--batch-size 4 --samples-per-prompt 6 --max-turns 2 --turn-tokens 64 --adv grpo --temperature 0.8 "
        "--enforce-eager --out runs/demo --val-freq 4 --val-limit 50").split()


def test_response_cap_counts_every_turn_and_intervention():
    import rollout
    import train

    cap = lambda argv: rollout.sample_kwargs(train.parse_args(argv), [7] * 36)["max_response_tokens"]  # noqa: E731
    assert cap(BASE) == 3 * 64 + 2 * 36
    assert cap(BASE + ["--max-turns", "0", "--turn-tokens", "100"]) == 100
    assert cap(BASE + ["--max-response-tokens", "200"]) == 200


def test_runs_parse_with_train_py_and_set_their_budget():
    T, cap = 64, 264
    seen = {}
    for name, (why, extra) in compare.RUNS.items():
        assert why
        seen[name] = train.parse_args(BASE + extra(T, cap) + ["--seed", "1", "--out", "/tmp/x"])
    assert (seen["mutis"].max_turns, seen["mutis"].turn_tokens, seen["mutis"].max_response_tokens) == (2, 64, None)
    assert (seen["single_cap"].max_turns, seen["single_cap"].turn_tokens,
            seen["single_cap"].max_response_tokens) == (0, cap, cap)
    assert (seen["single_hard"].max_turns, seen["single_hard"].turn_tokens,
            seen["single_hard"].max_response_tokens) == (0, T, T)
    lp = seen["length_penalty"]
    assert (lp.max_turns, lp.turn_tokens, lp.max_response_tokens) == (0, cap, cap)
    assert lp.length_coef * cap == pytest.approx(0.5, rel=1e-5)   # a full-cap response costs half a correct one
    for name in ("mutis", "single_cap", "single_hard"):
        assert getattr(seen[name], "length_coef", 0) == 0
    # the same seed, steps and rollouts per step in every run
    assert {(a.seed, a.steps, a.batch_size, a.samples_per_prompt, a.data) for a in seen.values()} == \
        {(1, 12, 4, 6, "arith_train")}


def test_length_penalty_at_other_costs():
    T, cap = 64, 264
    for name, cost in (("length_penalty", 0.5), ("length_penalty_0.1", 0.1), ("length_penalty_2", 2.0)):
        why, extra = compare.run_spec(name)
        a = train.parse_args(BASE + extra(T, cap))
        assert (a.max_turns, a.max_response_tokens) == (0, cap) and a.length_coef * cap == pytest.approx(cost, rel=1e-5)
        assert f"costs {cost:g} of a correct answer" in why
    assert compare.run_spec("length_penalty_x") is None and compare.run_spec("nope") is None
    names = ["length_penalty_2", "mutis", "length_penalty_0.1", "single_cap", "length_penalty"]
    assert sorted(names, key=compare.run_order) == ["mutis", "single_cap", "length_penalty_0.1", "length_penalty",
                                                    "length_penalty_2"]


def test_parse_train_returns_the_error_line_instead_of_exiting():
    args, err = compare.parse_train(BASE)
    assert err is None and args.turn_tokens == 64
    args, err = compare.parse_train(BASE + ["--no-such-flag", "1"])
    assert args is None and "--no-such-flag" in err and not err.startswith("error:")


def test_binomial_se():
    assert compare.binomial_se(0.5, 100) == pytest.approx(0.05)
    assert compare.binomial_se(0.82, 100) == pytest.approx(math.sqrt(0.82 * 0.18) / 10)
    assert compare.binomial_se(1.0, 50) == 0


def test_aggregate_means_over_seeds_and_keeps_the_range():
    a = compare.aggregate([{"seed": 0, "acc": 0.5, "n": 100, "decoded_tokens": 10, "truncated": None, "val_acc": 0.4},
                           {"seed": 1, "acc": 0.7, "n": 100, "decoded_tokens": 20, "truncated": None}])
    assert a["acc"] == pytest.approx(0.6) and a["decoded_tokens"] == pytest.approx(15)
    assert (a["acc_min"], a["acc_max"], a["seeds"], a["n"]) == (0.5, 0.7, 2, 100)
    assert a["truncated"] is None and a["val_acc"] == pytest.approx(0.4)   # only the seeds that have it
    assert "seed" not in a
    assert a["acc_se"] == pytest.approx(math.sqrt(0.02 / 2 + 0.6 * 0.4 / 100))
    assert a["tok_se"] == pytest.approx(math.sqrt(50) / math.sqrt(2))       # stdev of 10 and 20 over sqrt(2)
    one = compare.aggregate([{"seed": 0, "acc": 0.5, "n": 100, "decoded_tokens": 10}])
    assert one["acc_se"] == pytest.approx(0.05) and one["tok_se"] is None  # one seed: the problems' error only


def _cells(md, row):
    return [c.strip() for c in md.splitlines()[row].strip("|").split("|")]


def test_table_cells():
    one = compare.aggregate([{"acc": 0.82, "n": 100, "acc_at_T": 0.8, "decoded_tokens": 16.54, "median_decoded_tokens": 15,
                              "at_cap": 0.0, "unfinished": 0.02, "repeated": 0.1, "repeated_after_answer": 0.07,
                              "first_correct_tokens": 12.4, "val_acc": 0.8, "val_tokens": 17.2, "val_turns": 1.0, "wall_s": 390}])
    two = compare.aggregate([{"acc": 0.5, "n": 100, "decoded_tokens": 100, "median_decoded_tokens": 90, "at_cap": 0.25},
                             {"acc": 0.7, "n": 100, "decoded_tokens": 120, "median_decoded_tokens": 110, "at_cap": 0.35}])
    md = compare.table([("mutis", one), ("single_cap", two)], 64)
    head = _cells(md, 0)
    assert "acc % at 64 tok" in head
    rows = [dict(zip(head, _cells(md, i))) for i in (2, 3)]
    assert all(len(_cells(md, i)) == len(head) for i in range(4))
    assert rows[0] == {"run": "mutis", "seeds": "1", "acc %": "82.0", "± SE": "3.8", "seed range": "–",
                       "acc % at 64 tok": "80.0", "mean tok": "17", "median tok": "15", "tok to 1st right": "12",
                       "at cap %": "0",
                       "unfinished %": "2", "repeated % (after answer)": "10 (7)",
                       "val acc % (own)": "80.0", "val tok (own)": "17", "val turns (own)": "1.00", "train min": "6.5"}
    # two seeds: the seeds' variance over 2 plus the binomial variance of 100 problems
    seeds_var = ((0.5 - 0.6) ** 2 + (0.7 - 0.6) ** 2) / (2 - 1) / 2
    assert rows[1]["acc %"] == "60.0" and rows[1]["± SE"] == f"{100 * math.sqrt(seeds_var + 0.6 * 0.4 / 100):.1f}" \
        == "11.1"
    assert rows[1]["seed range"] == "50.0–70.0" and rows[1]["at cap %"] == "30" and rows[1]["unfinished %"] == "–"
    assert rows[1]["repeated % (after answer)"] == "– (–)"
    assert rows[1]["val acc % (own)"] == rows[1]["train min"] == rows[1]["tok to 1st right"] == rows[1]["acc % at 64 tok"] == "–"


def test_eval_argv_parses_with_eval_py():
    ta = train.parse_args(BASE)
    argv = compare.eval_argv(ta, ["smollm2", "runs/compare/mutis-s0/latest"], 264, 64, 0, None, "runs/compare/eval")
    e = eval_lib.parse_args(argv)
    assert e.checkpoints == ["smollm2", "runs/compare/mutis-s0/latest"] and e.benchmarks == "arith_test"
    assert (e.max_turns, e.max_response_tokens, e.temperature, e.budgets) == (0, 264, 0, [64, 128, 264])
    assert (e.system_prompt, e.enforce_eager, e.limit, e.out) == ("answer-line", True, None, "runs/compare/eval")
    e = eval_lib.parse_args(compare.eval_argv(ta, ["smollm2"], 264, 64, 2, 20, "o"))
    assert (e.max_turns, e.turn_tokens, e.intervention_text, e.turn_rule, e.limit) == \
        (2, 64, "reference", "reference", 20)
    e = eval_lib.parse_args(compare.eval_argv(ta, ["smollm2"], 264, 64, 0, None, "o", "sampled"))
    assert (e.protocol, e.temperature, e.top_p, e.samples_per_prompt) == ("sampled", 0.6, 0.95, 4)


def test_parse_args_splits_at_the_double_dash():
    opts, base = compare.parse_args(["--runs", "mutis, single_cap", "--seeds", "0 1", "--", "--steps", "3"])
    assert (opts.runs, opts.seeds, base) == (["mutis", "single_cap"], ["0", "1"], ["--steps", "3"])
    opts, base = compare.parse_args([])
    assert opts.runs == list(compare.RUNS) and opts.seeds == ["0"] and base == []
    assert opts.protocols == ["greedy", "sampled"]
    opts, _ = compare.parse_args(["--runs", "mutis length_penalty_0.2", "--protocols", "sampled"])
    assert opts.runs == ["mutis", "length_penalty_0.2"] and opts.protocols == ["sampled"]


@pytest.mark.parametrize("argv, message", [(["--runs", "mutis,nope"], "nope"), (["--seeds", "a"], "--seeds"),
                                           (["--protocols", "greedy,beam"], "beam"),
                                           (["--train-only", "--summarize"], "not allowed")])
def test_bad_flags_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        compare.parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and message in err and err.count("\n") == 1


def test_finished_runs_in_runs_order_with_their_last_validation(tmp_path):
    def run(name, seed, rows, done=True):
        d = tmp_path / f"{name}-s{seed}"
        (d / "step_000002").mkdir(parents=True)
        (d / "latest").symlink_to("step_000002")
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        if done:
            (d / "compare.json").write_text(json.dumps({"run": name, "seed": seed, "wall_s": 1.0, "args": []}))
        return d
    val = {"val/acc": 0.5, "val/decoded_tokens": 40.0, "val/turns": 1.5}
    run("single_hard", 0, [{"step": 0, **val}])
    run("mutis", 1, [{"step": 0, **val}, {"step": 1, "acc/mean": 0.3, "decoded_tokens/mean": 50.0},
                     {"step": 2, "val/acc": 0.75, "val/decoded_tokens": 20.0, "val/turns": 1.0}])
    run("mutis", 0, [])
    run("single_cap", 0, [], done=False)   # train.py failed or still running: not gathered
    found = compare.finished_runs(tmp_path)
    assert [(n, s) for n, s, _, _ in found] == [("mutis", 0), ("mutis", 1), ("single_hard", 0)]
    assert [r["step"] for r in compare.val_rows(found[1][2])] == [0, 2]
    assert compare.last_val(compare.val_rows(found[1][2])) == {"val_acc": 0.75, "val_tokens": 20.0, "val_turns": 1.0,
                                                               "val_step": 2}
    assert compare.val_rows(found[0][2]) == [] and compare.last_val([]) == {}
    assert [r["step"] for r in compare.train_rows(found[1][2])] == [1] and compare.train_rows(found[0][2]) == []
    compare.plot(found, tmp_path / "curves.png")   # runs with and without validations, one without any row
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert compare.val_rows(tmp_path / "nothing-here") == []


@pytest.mark.parametrize("line, shown", [("step 3/12 | reward 0.5 acc 0.5", True), ("[val] step 0  acc 0.610", True),
                                         ("step 3 rollout:  50%|#####     | 12/24", False), ("[setup] dtype", False)])
def test_console_shows_train_py_step_and_validation_lines_only(line, shown):
    assert bool(compare.STEP_LINE.match(line)) is shown


def test_at_cap_counts_responses_that_used_the_whole_cap(tmp_path):
    rows = [("a", "arith_test", 264), ("a", "arith_test", 263), ("a", "gsm8k", 264), ("b", "arith_test", 10),
            ("a", "arith_test", 264), ("a", "arith_test", 5)]
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps({"checkpoint": c, "benchmark": b, "decoded_tokens": t}) + "\n" for c, b, t in rows))
    assert compare.at_cap(path, "arith_test", 264) == {"a": 0.5, "b": 0.0}


def test_a_killed_run_is_named_by_its_signal(tmp_path):
    """A run the kernel killed leaves a log ending mid-progress-bar: the error names the signal, not that line."""
    import signal
    import subprocess
    import sys

    log = tmp_path / "train.log"
    log.write_text("step 3 update:   0%|          | 0/1\n")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    proc.send_signal(signal.SIGKILL)
    code = proc.wait()
    assert compare.failure(code, log) == "killed by SIGKILL, as the out-of-memory killer does"
    assert compare.failure(-signal.SIGTERM, log) == "killed by SIGTERM"
    log.write_text("step 1 ...\nerror: --data x: no such file\n")
    assert compare.failure(2, log) == "--data x: no such file"


def fake_eval_py(monkeypatch):
    """compare.stream replaced for eval.py: it writes what eval.py writes for the checkpoints on its command line
    (accuracy 0.5 on 2 problems at 9 tokens) -> the list of command lines it was given."""
    calls = []

    def fake_eval(cmd, log, label, show=None):
        calls.append(cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        ckpts = [c for c in cmd[2:cmd.index("--benchmarks")]]
        res = {c: {"arith_test": {"accuracy": 0.5, "n": 2, "decoded_tokens": 9.0, "median_decoded_tokens": 9}} for c in ckpts}
        (out / "summary.json").write_text(json.dumps({"results": res}))
        (out / "samples.jsonl").write_text("".join(json.dumps({"benchmark": "arith_test", "checkpoint": c,
                                                               "decoded_tokens": 9}) + "\n" for c in ckpts))
        return 0
    monkeypatch.setattr(compare, "stream", fake_eval)
    return calls


def test_an_eval_directory_from_the_same_arguments_is_reused(tmp_path, monkeypatch):
    """--summarize after adding a protocol runs eval.py only where its arguments changed (or it never finished)."""
    calls = fake_eval_py(monkeypatch)
    ta = train.parse_args(BASE)
    opts, _ = compare.parse_args(["--eval-limit", "2"])
    found = [("mutis", 0, tmp_path / "mutis-s0", {})]
    scored, argv, _ = compare.evaluate(tmp_path, ta, found, 264, 64, opts, "greedy")
    assert len(calls) == 1 and scored("smollm2")["acc"] == 0.5 and (tmp_path / "eval" / "summary.json").exists()
    compare.evaluate(tmp_path, ta, found, 264, 64, opts, "greedy")
    assert len(calls) == 1                                            # same arguments: reused
    compare.evaluate(tmp_path, ta, found, 264, 64, opts, "sampled")
    assert len(calls) == 2 and "sampled" in calls[1] and (tmp_path / "eval-sampled" / "summary.json").exists()
    compare.evaluate(tmp_path, ta, found + [("mutis", 1, tmp_path / "mutis-s1", {})], 264, 64, opts, "greedy")
    assert len(calls) == 3                                            # another checkpoint: eval.py again


def test_the_story_task_validates_only_after_the_last_step():
    """`make compare TASK=story`'s train.py arguments as make expands them: no validation of the untrained model
    before every run (--no-val-before-train after the demo's --val-before-train), one after the last step."""
    import subprocess
    root = Path(__file__).resolve().parents[1]
    cmd = subprocess.run(["make", "-n", "-s", "compare", "TASK=story", "SEEDS=0 1 2"], cwd=root, text=True,
                         capture_output=True, check=True).stdout
    line = " ".join(cmd.replace("\\\n", " ").split())
    argv = line[line.index("compare.py"):].split(" -- ", 1)[1].split()
    a = train.parse_args(argv + ["--seed", "0", "--out", "/tmp/x"])
    assert (a.val_before_train, a.val_freq, a.steps, a.data) == (False, 12, 12, "story_train")
    assert train.parse_args(BASE + ["--val-before-train"]).val_before_train


def test_a_rerun_keeps_runs_finished_with_the_same_arguments(tmp_path, monkeypatch):
    """A stopped compare resumes: a run whose compare.json holds these train.py arguments is kept; one with other
    arguments, or without compare.json (stopped mid-run), trains again from an empty directory."""
    trained = []

    def fake_stream(cmd, log, prefix, show=None):
        d = Path(cmd[len(cmd) - cmd[::-1].index("--out")])   # the last --out: the run's directory
        trained.append(d.name)
        assert sorted(p.name for p in d.iterdir()) == []       # started clean
        (d / "step_000001").mkdir()
        (d / "latest").symlink_to("step_000001")
        return 0
    monkeypatch.setattr(compare, "stream", fake_stream)
    args = BASE + ["--steps", "2"]
    compare.train_run("mutis", 0, args, tmp_path, "")
    compare.train_run("mutis", 0, args, tmp_path, "")          # same arguments: kept
    assert trained == ["mutis-s0"]
    compare.train_run("mutis", 0, args + ["--actor-lr", "1e-5"], tmp_path, "")   # other arguments: trained again
    assert trained == ["mutis-s0", "mutis-s0"]
    stopped = tmp_path / "single_cap-s1"
    (stopped / "step_000001").mkdir(parents=True)
    (stopped / "metrics.jsonl").write_text("{}\n")                # killed mid-run: no compare.json
    compare.train_run("single_cap", 1, args, tmp_path, "")
    assert trained[-1] == "single_cap-s1" and json.loads((stopped / "compare.json").read_text())["args"] == args


def test_the_summary_shows_the_base_arguments_without_the_demo_out(tmp_path, monkeypatch):
    """BASE carries the demo's --out runs/demo, which each run's own --out overrides: summary.md must not show it
    (a reader would look for the runs there), summary.json keeps the arguments as given."""
    base = ["--model", "smollm2", "--out", "runs/demo", "--steps", "12", "--out=x", "--outcome", "y"]
    assert compare.without_out(base) == ["--model", "smollm2", "--steps", "12", "--outcome", "y"]
    assert compare.without_out(["--out", "--steps"]) == []  # a value that looks like a flag is still the value

    fake_eval_py(monkeypatch)
    d = tmp_path / "mutis-s0"
    (d / "step_000002").mkdir(parents=True)
    (d / "latest").symlink_to("step_000002")
    (d / "compare.json").write_text(json.dumps({"run": "mutis", "seed": 0, "wall_s": 1.0,
                                                "args": BASE + compare.run_spec("mutis")[1](64, 264)}))
    opts, _ = compare.parse_args(["--eval-limit", "2"])
    opts.intervention_tokens = 40  # compare.main counts them with the tokenizer
    compare.summarize(tmp_path, train.parse_args(BASE), BASE, 264, 64, opts, [])
    settings = next(line for line in (tmp_path / "summary.md").read_text().splitlines() if "train.py arguments" in line)
    assert "runs/demo" not in settings and " ".join(compare.without_out(BASE)) in settings, settings
    assert f"each run's `--out` {tmp_path}/<run>-s<seed>" in settings
    assert json.loads((tmp_path / "summary.json").read_text())["settings"]["train_args"] == BASE
