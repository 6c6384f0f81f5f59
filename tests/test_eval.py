"""Tests for eval.py: every number is checked against an independent computation (brute-force
enumeration, hand-counted correctness, recomputation from samples.jsonl, a real generation at
the smaller limit), so that a wrong formula, index or truncation makes a test fail."""
import itertools
import json
import os
from fractions import Fraction
from types import SimpleNamespace

import pytest
from conftest import run_script, write_jsonl

import eval as ev
import eval_report

ENV = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}


def run_eval(*argv, timeout=600):
    return run_script("eval.py", *argv, env=ENV, timeout=timeout)


# ----------------------------------------------------------------------------- pass@k

def test_pass_at_k_matches_enumeration():
    for n in range(1, 8):
        for c in range(n + 1):
            correct = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(correct, k))
                brute = Fraction(sum(any(s) for s in subsets), len(subsets))
                assert eval_report.pass_at_k(n, c, k) == pytest.approx(float(brute), abs=1e-12), (n, c, k)


# ----------------------------------------------------------------------------- --score

@pytest.mark.slow  # an eval.py start
def test_score_jsonl_exact_accuracy_two_checkpoints(tmp_path):
    # per checkpoint: gsm8k 2 of 3 right (a), 1 of 3 (b); math500 1 of 2 (a), 2 of 2 (b)
    rows = []
    for ckpt, verdicts_g, verdicts_m in (("a", [1, 1, 0], [1, 0]), ("b", [0, 1, 0], [1, 1])):
        for i, (ok, gold) in enumerate(zip(verdicts_g, ["18", "3", "70000"])):
            rows.append({"checkpoint": ckpt, "data_source": "gsm8k", "id": f"g{i}", "answer": gold,
                         "response": f"So the total is \\boxed{{{gold if ok else '12345'}}}.", "num_tokens": 10 * (i + 1)})
        for i, (ok, gold) in enumerate(zip(verdicts_m, ["\\frac{1}{2}", "(3, \\frac{\\pi}{2})"])):
            rows.append({"checkpoint": ckpt, "data_source": "math500", "id": f"m{i}", "ground_truth": gold,
                         "response_text": f"Thus \\boxed{{{gold}}}" if ok else "no answer here",
                         "num_tokens": 100 + i, "truncated": not ok})
    src = write_jsonl(tmp_path / "gens.jsonl", rows)
    r = run_eval("--score", src, timeout=300)
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "gens.summary.json").read_text())["results"]
    assert summary["a"]["gsm8k"]["accuracy"] == pytest.approx(2 / 3)
    assert summary["b"]["gsm8k"]["accuracy"] == pytest.approx(1 / 3)
    assert summary["a"]["math500"]["accuracy"] == pytest.approx(1 / 2)
    assert summary["b"]["math500"]["accuracy"] == pytest.approx(1.0)
    assert summary["a"]["gsm8k"]["decoded_tokens"] == pytest.approx(20.0)  # the file's num_tokens
    assert summary["a"]["math500"]["truncated"] == pytest.approx(0.5)  # from the file's column
    assert summary["a"]["math500"]["has_answer"] == pytest.approx(0.5)  # "no answer here"
    assert summary["a"]["gsm8k"]["truncated"] is None  # unknown: no column
    assert summary["a"]["gsm8k"]["n"] == 3
    scored = [json.loads(x) for x in (tmp_path / "gens.scored.jsonl").read_text().splitlines()]
    assert [s["correct"] for s in scored] == [bool(v) for v in [1, 1, 0, 1, 0, 0, 1, 0, 1, 1]]
    md = (tmp_path / "gens.summary.md").read_text()
    # b against a on gsm8k: 33.3 (-33.3); on the macro mean: (1/3+1)/2 - (2/3+1/2)/2 = +8.3 points
    assert "| gsm8k | 3 | 66.7 | 20 | 33.3 (-33.3) |" in md
    assert "| mean | 5 | 58.3 |" in md and "66.7 (+8.3)" in md
    assert md in r.stdout


@pytest.mark.slow  # an eval.py start
def test_score_parquet_n_samples_pass_at_k(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    # 3 problems x 4 samples; correct counts 0, 1, 3
    counts = [0, 1, 3]
    rows = [{"data_source": "math500", "reward_model": {"ground_truth": str(i + 2), "style": "rule"},
             "responses": [f"\\boxed{{{i + 2 if j < c else 99}}}" for j in range(4)]} for i, c in enumerate(counts)]
    src = tmp_path / "gens.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    r = run_eval("--score", src, "--out", tmp_path / "out", "--tokenizer", "smollm2", timeout=300)
    assert r.returncode == 0, r.stderr
    stats = json.loads((tmp_path / "out" / "summary.json").read_text())["results"]["gens"]["math500"]
    assert stats["n"] == 3 and stats["samples"] == 12
    assert stats["accuracy"] == pytest.approx((0 + 1 / 4 + 3 / 4) / 3)
    assert stats["mean@4"] == stats["accuracy"]
    for k in (1, 2, 4):
        brute = [sum(any(s) for s in itertools.combinations([True] * c + [False] * (4 - c), k))
                 / len(list(itertools.combinations(range(4), k))) for c in counts]
        assert stats[f"pass@{k}"] == pytest.approx(sum(brute) / 3)
    assert stats["decoded_tokens"] > 0  # counted with --tokenizer
    assert len((tmp_path / "out" / "samples.jsonl").read_text().splitlines()) == 12


def test_protocols_set_sampling_and_explicit_flags_win():
    import eval as eval_lib

    parse = lambda *a: eval_lib.parse_args(["smollm2", *a])  # noqa: E731
    got = lambda a: (a.temperature, a.top_p, a.samples_per_prompt)  # noqa: E731
    assert got(parse()) == got(parse("--protocol", "greedy")) == (0.0, 1.0, 1)  # the paper's eval is the default
    assert got(parse("--protocol", "sampled")) == (0.6, 0.95, 16)
    assert got(parse("--protocol", "sampled", "--samples-per-prompt", "16", "--top-p=1")) == (0.6, 1.0, 16)
    assert got(parse("--temperature", "0.6", "--protocol", "greedy")) == (0.6, 1.0, 1)
    # the reference's cap and budget sweep (eval/eval.sh), filled in up to the cap once the prompts are known
    a = parse()
    assert (a.max_response_tokens, a.cap_given, a.sweep, a.budgets) == (32768, False, "reference", [])
    a = parse("--max-response-tokens", "100", "--budgets", "none")
    assert (a.max_response_tokens, a.cap_given, a.sweep, a.budgets) == (100, True, "none", [])


@pytest.mark.parametrize("window,longest,given,want_cap,clamped", [
    (8192, 432, None, 7760, True),      # SmolLM2: 8192 - the longest prompt
    (131072, 500, None, 32768, False),  # a long-context model keeps the reference's cap
    (8192, 432, 1000, 1000, False),     # an explicit cap is kept
])
def test_default_cap_is_clamped_to_the_context_and_budgets_follow_it(window, longest, given, want_cap, clamped):
    args = ev.parse_args(["smollm2"] + (["--max-response-tokens", str(given)] if given else []))
    said = []
    gen = ev.context_cap(args, {"m": (None, None, longest, window)}, said.append)
    assert gen == args.max_response_tokens == want_cap
    assert len(said) == int(clamped) and (not said or f"clamped to {want_cap}" in said[0] and "m (8192)" in said[0])
    reference = [200, 400, 600, 800, 1000, 1200, 1600, 2000, 2400, 2800, 3200, 3600, 4000, 4500, 32768]
    assert args.budgets == [b for b in reference if b < want_cap] + [want_cap]


def test_an_explicit_cap_beyond_the_context_dies(capsys):
    args = ev.parse_args(["smollm2", "--max-response-tokens", "8000"])
    with pytest.raises(SystemExit) as e:
        ev.context_cap(args, {"m": (None, None, 432, 8192)}, print)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "--max-response-tokens" in err[0] and "(8192)" in err[0], err


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("argv,needle", [
    # arith_test (a bundled training-side set) passes, so the error names the one after it
    (["smollm2", "--benchmarks", "gsm8k,arith_test,nosuchbench", "--limit", "1"], "'nosuchbench'"),
    (["/nonexistent/ckpt", "--benchmarks", "gsm8k"], "/nonexistent/ckpt"),
    (["smollm2", "--budgets", "100,abc"], "--budgets"),
    (["--score", "MISSING_FILE"], "missing.jsonl"),
    (["--score", "NOCOLS"], "response"),
    (["--score", "NOGOLD"], "ground truth"),
    ([], "checkpoint"),
    (["smollm2", "--max-response-tokens", "0"], "--max-response-tokens"),
    (["smollm2", "--benchmarks", "gsm8k", "--limit", "1", "--max-prompt-length", "5"], "--max-prompt-length"),
    (["smollm2", "--n", "2"], "--n"),  # one name per concept: --samples-per-prompt
])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, argv, needle):
    """eval.main in this process (each case dies before any model loads: no process start needed)."""
    write_jsonl(tmp_path / "nocols.jsonl", [{"data_source": "gsm8k", "answer": "3", "text": "3"}])
    write_jsonl(tmp_path / "nogold.jsonl", [{"data_source": "gsm8k", "response": "3"}])
    subs = {"MISSING_FILE": str(tmp_path / "missing.jsonl"), "NOCOLS": str(tmp_path / "nocols.jsonl"),
            "NOGOLD": str(tmp_path / "nogold.jsonl")}
    with pytest.raises(SystemExit) as e:  # SystemExit, not a traceback's exception
        ev.main([*[subs.get(a, a) for a in argv], "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], err
    assert not (tmp_path / "out").exists()  # nothing half-written


GOOD = '{"data_source": "gsm8k", "answer": "3", "response": "3"}\n'


@pytest.mark.parametrize("name,content,needles", [
    ("gens.jsonl", GOOD + '{"data_source": oops}\n', ["gens.jsonl: line 2: malformed JSON"]),
    ("gens.jsonl", GOOD.encode() + b'{"response": "\xff"}\n', ["gens.jsonl: line 2: not UTF-8"]),
    ("gens.jsonl", GOOD + "\n[1, 2]\n", ["gens.jsonl: line 3: expected a JSON object"]),
    ("gens.jsonl", GOOD + GOOD.replace('"3"}', "7}"), ["gens.jsonl: line 2: response 0 is int"]),
    ("gens.jsonl", GOOD + '{"data_source": "gsm8k", "answer": "3"}\n', ["gens.jsonl: line 2: no response column"]),
    ("gens.json", "[" + GOOD.strip() + ', {"data_source": "gsm8k", "response": "3"}]',
     ["gens.json: row 1: no ground truth column"]),
    ("gens.parquet", "not parquet", ["gens.parquet: not a readable parquet file"]),
    ("gens.jsonl", "\n", ["gens.jsonl: no rows"]),
    ("gens.txt", GOOD, ["gens.txt: unknown file type '.txt'"]),
])
def test_score_bad_file_names_file_and_row(tmp_path, capsys, name, content, needles):
    src = tmp_path / name
    src.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(SystemExit) as e:
        ev.main(["--score", str(src), "--out", str(tmp_path / "out"), "--tokenizer", "smollm2"])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith(f"error: --score {src}"), err
    for needle in needles:
        assert needle in lines[0], err
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- end to end (tiny model, vLLM)

@pytest.mark.vllm  # in eval.py
def test_end_to_end_tiny_vllm(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    r = run_eval(tiny_model_dir, "--benchmarks", "gsm8k,math500", "--limit", 3, "--max-response-tokens", 32,
                 "--budgets", "8,16,48", "--engine", "vllm", "--engine-dtype", "float32", "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    for name in ("samples.jsonl", "summary.json", "summary.md", "budget.png"):
        assert (out / name).stat().st_size > 0, name
    assert not list(out.glob("*.tmp"))
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert len(samples) == 6
    assert [(s["benchmark"], s["id"]) for s in samples][:1] == [("gsm8k", "gsm8k-test-0000")]
    for key in ("benchmark", "id", "problem", "response_text", "pred", "gold", "correct", "decoded_tokens",
                "turns", "checkpoint", "budget_correct", "response_ids"):
        assert all(key in s for s in samples), key
    assert summary["generated_tokens"] == 48  # one generation at the largest budget
    assert summary["models"] == {str(tiny_model_dir): str(tiny_model_dir)}
    assert set(summary["versions"]) == {"torch", "vllm", "transformers"} and summary["versions"]["vllm"]
    assert summary["seed"] == 0
    for bench in ("gsm8k", "math500"):
        mine = [s for s in samples if s["benchmark"] == bench]
        stats = summary["results"][str(tiny_model_dir)][bench]
        assert stats["n"] == 3
        assert stats["accuracy"] == pytest.approx(sum(s["correct"] for s in mine) / 3)
        assert stats["decoded_tokens"] == pytest.approx(sum(s["decoded_tokens"] for s in mine) / 3)
        assert stats["median_decoded_tokens"] == sorted(s["decoded_tokens"] for s in mine)[1]
        assert stats["truncated"] == pytest.approx(sum(s["truncated"] for s in mine) / 3)
        assert stats["has_answer"] == pytest.approx(sum(s["pred"] is not None for s in mine) / 3)
        for b in (8, 16, 48):
            assert stats["budget_accuracy"][str(b)] == pytest.approx(sum(s["budget_correct"][str(b)] for s in mine) / 3)
        for s in mine:
            assert s["decoded_tokens"] == min(len(s["response_ids"]), 32) and len(s["response_ids"]) <= 48
            assert s["kept_tokens"] == s["decoded_tokens"] and s["intervention_tokens"] == 0  # single turn: no cut
            if len(s["response_ids"]) > 32:  # cut at --max-response-tokens from the 48-token generation
                assert s["truncated"]
            elif len(s["response_ids"]) < 32:  # the model ended it: truncated means cut by the cap, nothing else
                assert not s["truncated"]
            for b in (8, 16, 48):
                if len(s["response_ids"]) <= min(b, 32):  # nothing cut: same text, same verdict
                    assert s["budget_correct"][str(b)] == s["correct"]
    md = (out / "summary.md").read_text()
    assert md.count("\n| gsm8k |") == 1 and "| 48 |" in md
    assert md in r.stdout and "problems/min" in r.stdout


# ----------------------------------------------------------------------------- budget truncation equivalence

@pytest.fixture(scope="module")
def smol_engine(smollm2_dir):
    from infra import engines

    # eager: vLLM's CPU compile of SmolLM2 costs a minute here; test_end_to_end_tiny_vllm covers the compiled path
    engine = engines.make_engine(smollm2_dir, kind="vllm", dtype="float32", seed=0, max_model_len=1024,
                                 enforce_eager=True, gpu_memory_utilization=0.25)  # GPU: room for eval.py subprocesses
    yield engine
    engine.close()


def gen_args(**kw):
    base = dict(vars(ev.parse_args(["smollm2"])), max_response_tokens=64, intervention_text="paper")
    return SimpleNamespace(**{**base, **kw})


def gsm8k_records(n):
    import data

    return [{**r, "_benchmark": "gsm8k"} for r in data.load_dataset("gsm8k", system_prompt="eval", limit=n)]


def test_budget_truncation_equals_generation_at_budget(smollm2_dir, smol_engine):
    """Scoring the first b tokens of a 48-token greedy generation == generating with max_tokens=b."""
    import reward
    from infra.hf import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    records = gsm8k_records(3)
    budgets = [10, 20, 32]
    long = ev.generate(smol_engine, tok, records, gen_args(max_response_tokens=48))
    assert any(len(s["response_ids"]) > 32 for s in long)
    # golds: the last number each response reaches by 20 tokens, so correctness changes across budgets
    golds = [reward.extract_answer(tok.decode(s["response_ids"][:20]), last_number=True) or "0" for s in long]
    with_gold = lambda samples: [{**s, "gold": g} for s, g in zip(samples, golds)]  # noqa: E731
    scored = ev.score_generated(with_gold(long), gen_args(max_response_tokens=48, budgets=budgets), tok)
    seen = set()
    for b in budgets:
        short = ev.generate(smol_engine, tok, records, gen_args(max_response_tokens=b))
        for lg, sh, sc, gold in zip(long, short, scored, golds):
            n = len(sh["response_ids"])
            assert lg["response_ids"][:n] == sh["response_ids"] and (n == b or n == len(lg["response_ids"]))
            want = reward.score_batch([sh["data_source"]], [sh["_full_text"]], [gold])[0]["acc"]
            assert sc["budget_correct"][str(b)] == bool(want), (b, sh["_full_text"])
            seen.add(bool(want))
        if b == 20:  # the main numbers at --max-tokens 20, cut from the 48-token run == a 20-token run's
            cut20 = ev.score_generated(with_gold(long), gen_args(max_response_tokens=20, budgets=[48]), tok)
            real20 = ev.score_generated(with_gold(short), gen_args(max_response_tokens=20), tok)
            for a, r in zip(cut20, real20):
                for key in ("response_text", "decoded_tokens", "kept_tokens", "truncated", "repeated", "turns", "correct",
                            "pred", "has_answer"):
                    assert a[key] == r[key], key
    assert seen == {True, False}  # the check saw both verdicts
    # summary numbers == recomputation from the samples
    stats = eval_report.summarize([{**s, "checkpoint": "c"} for s in cut20], [48], False)["c"]["gsm8k"]
    assert stats["accuracy"] == pytest.approx(sum(s["correct"] for s in cut20) / 3) and stats["accuracy"] > 0
    assert stats["budget_accuracy"]["48"] == pytest.approx(sum(s["budget_correct"]["48"] for s in cut20) / 3)


def test_budget_truncation_with_interventions(smollm2_dir, smol_engine):
    """--max-turns 1: cutting a multi-turn trajectory == a multi-turn run with the smaller total budget,
    also when the cut falls inside the intervention (that run then has no room for it and stops)."""
    import rollout
    from infra.hf import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    records = gsm8k_records(2)
    iv = len(rollout.intervention_ids(tok, "paper"))
    args = dict(max_turns=1, turn_tokens=8, intervention_text="paper", turn_rule="reference", cut_at_answer=True)
    budgets = [5, 8 + iv // 2, 8 + iv + 4]  # inside turn 1, inside the intervention, inside turn 2
    long = ev.generate(smol_engine, tok, records, gen_args(max_response_tokens=8 + iv + 8, **args))
    assert all(s["_turns"] == 2 and s["_action_mask"][8:8 + iv] == [0] * iv for s in long)
    for b in budgets:
        short = ev.generate(smol_engine, tok, records, gen_args(max_response_tokens=b, **args))
        for lg, sh in zip(long, short):
            at = ev.at_limit(lg, b, tok, ev.cuts(gen_args(**args)))
            assert (at["end"], at["truncated"], at["turns"]) == (len(sh["response_ids"]), sh["_truncated"], sh["_turns"]), b
            assert at["decoded"] == sum(n for _, n in sh["_spans"]), b  # what that run's engine decoded
            assert lg["response_ids"][:at["end"]] == sh["response_ids"] and at["text"] == sh["_full_text"]
    scored = ev.score_generated([dict(s) for s in long], gen_args(max_response_tokens=8 + iv + 8, budgets=budgets, **args), tok)
    stats = eval_report.summarize([{**s, "checkpoint": "c"} for s in scored], budgets, True)["c"]["gsm8k"]
    assert stats["mean_turns"] == 2.0 and stats["n"] == 2


def test_vllm_engine_bounds_requests_in_flight_and_reports_each(smol_engine):
    from test_eval_scale import check_bounded_callbacks, prompts_of

    prompts = prompts_of(smol_engine.tokenizer, 7)
    llm_engine = smol_engine.llm.llm_engine
    got = check_bounded_callbacks(smol_engine, prompts, bound=2, in_flight=llm_engine.get_num_unfinished_requests)
    assert all(c.logprobs is None for c in got)  # logprobs=False: not computed
