"""data.py: layouts, preprocessors, arithmetic, bad input, prompts, bundled sets."""
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, run_script, write_jsonl

import data
from infra import cli

EVAL, TRAIN = data.SYSTEM_PROMPTS["eval"], data.SYSTEM_PROMPTS["train"]


def run_cli(*argv, cwd=ROOT):
    return run_script("data.py", *argv, cwd=cwd, timeout=120)


def user(text):
    return {"role": "user", "content": text}


def system(text):
    return {"role": "system", "content": text}


PROBLEMS = [{"id": "p0", "problem": "What is $1+1$?", "answer": "2", "source": "toy"},
            {"problem": "Name the primes below 6.", "answer": ["2, 3, 5", "2,3,5"]},
            {"question": "Compute 3*4", "answer": 12, "solution": "3*4=12"}]


def expected_problems(source_of, sys_text):
    """What load_dataset must return for PROBLEMS, built by hand."""
    out = []
    for i, (p, truth) in enumerate(zip(PROBLEMS, ["2", ["2, 3, 5", "2,3,5"], "12"])):
        text = p.get("problem", p.get("question"))
        msgs = ([system(sys_text)] if sys_text else []) + [user(text)]
        out.append({"id": p.get("id", f"{source_of(p)}-{i}"), "data_source": source_of(p), "messages": msgs,
                    "ground_truth": truth, "problem": text})
    return out


# ----------------------------------------------------------------------------- layouts

@pytest.mark.parametrize("kind", ["jsonl", "json", "json_lines_in_json"])
def test_problem_files_round_trip(tmp_path, kind):
    path = tmp_path / ("probs.jsonl" if kind == "jsonl" else "probs.json")
    if kind == "json":
        path.write_text(json.dumps(PROBLEMS, indent=2))
    else:
        write_jsonl(path, PROBLEMS)
    got = data.load_dataset(str(path))
    assert got == expected_problems(lambda p: p.get("source", "probs"), EVAL)


def test_system_prompt_options(tmp_path):
    path = str(write_jsonl(tmp_path / "p.jsonl", PROBLEMS))
    source = lambda p: p.get("source", "p")  # noqa: E731
    assert data.load_dataset(path, "eval") == expected_problems(source, EVAL)
    assert data.load_dataset(path, "train") == expected_problems(source, TRAIN)
    assert data.load_dataset(path, "none") == expected_problems(source, None)
    assert data.load_dataset(path, "Be brief.") == expected_problems(source, "Be brief.")
    assert data.load_dataset(path, limit=2) == expected_problems(source, EVAL)[:2]


def test_reference_parquet_by_hand(tmp_path):
    """A veRL-style file written directly with pyarrow (no write_parquet)."""
    rows = [{"data_source": "limo", "prompt": [user("Q: a?")], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": "7"}, "extra_info": {"split": "train", "index": 5}},
            {"data_source": "other", "prompt": [system("S"), user("Q: b?")], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": "8"}, "extra_info": {"split": "train", "index": 9}}]
    path = tmp_path / "ref.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    want = [{"id": "limo-5", "data_source": "limo", "messages": [user("Q: a?")], "ground_truth": "7",
             "problem": "Q: a?"},
            {"id": "other-9", "data_source": "other", "messages": [system("S"), user("Q: b?")], "ground_truth": "8",
             "problem": "Q: b?"}]
    assert data.load_dataset(str(path)) == want  # default: prompts as they are
    with_eval = data.load_dataset(str(path), "eval")
    assert with_eval[0]["messages"] == [system(EVAL), user("Q: a?")]  # prepended when asked and absent
    assert with_eval[1]["messages"] == [system("S"), user("Q: b?")]  # an existing one is kept


def test_written_parquet_round_trip(tmp_path):
    recs = data.load_dataset(str(write_jsonl(tmp_path / "p.jsonl", PROBLEMS)), "train")
    data._write_splits(tmp_path / "out", recs, recs[:1])
    assert data.load_dataset(str(tmp_path / "out")) == recs  # a directory means its train.parquet
    table = pq.read_table(tmp_path / "out" / "train.parquet")
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert table.column("reward_model").to_pylist()[0] == {"style": "rule", "ground_truth": ["2"]}
    assert not list((tmp_path / "out").glob(".*tmp*"))


def test_splits_are_written_all_or_nothing(tmp_path, monkeypatch):
    recs = data.load_dataset("arith_test", limit=4)
    real, calls = pq.write_table, []

    def flaky(table, where):  # the second file fails half-way
        calls.append(where)
        real(table, where)
        if len(calls) == 2:
            raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", flaky)
    with pytest.raises(OSError, match="disk full"):
        data._write_splits(tmp_path / "out", recs[:3], recs[3:])
    assert list((tmp_path / "out").iterdir()) == []


def test_simple_parquet_layout(tmp_path):
    path = tmp_path / "simple.parquet"
    pq.write_table(pa.table({"prompt": ["1+1?", "2+2?"], "response": ["2", "5"], "data_source": ["toy", "toy"],
                             "answer": ["2", "4"]}), path)
    got = data.load_dataset(str(path), "none")
    assert got == [{"id": "toy-0", "data_source": "toy", "messages": [user("1+1?")], "ground_truth": "2",
                    "problem": "1+1?"},
                   {"id": "toy-1", "data_source": "toy", "messages": [user("2+2?")], "ground_truth": "4",
                    "problem": "2+2?"}]
    pq.write_table(pa.table({"prompt": ["1+1?"], "ground_truth": ["2"]}), path)
    assert data.load_dataset(str(path))[0]["ground_truth"] == "2"
    pq.write_table(pa.table({"prompt": ["1+1?"], "response": ["2"]}), path)
    with pytest.raises(data.DataError, match="ground_truth"):
        data.load_dataset(str(path))


# ----------------------------------------------------------------------------- preprocessors

def read_split(out, split):
    return pq.read_table(Path(out) / f"{split}.parquet").to_pylist()


def test_limo(tmp_path):
    rows = [{"question": f"Problem {i} ends with {['?', '.', '$x$', ' '][i % 4]}", "solution": f"sol {i}",
             "answer": str(i)} for i in range(40)]
    src = tmp_path / "limo.json"
    src.write_text(json.dumps(rows))
    r = run_cli("limo", "--input", src, "--out", tmp_path / "a")
    assert r.returncode == 0, r.stderr
    train, test = read_split(tmp_path / "a", "train"), read_split(tmp_path / "a", "test")
    assert (len(train), len(test)) == (36, 4)
    order = list(range(40))
    random.Random(0).shuffle(order)  # the --seed default
    assert [t["extra_info"]["index"] for t in test] == order[:4]
    assert sorted(t["extra_info"]["index"] for t in train + test) == list(range(40))
    for t in train + test:
        i = t["extra_info"]["index"]
        q = rows[i]["question"].strip()
        q = q if q.endswith(("?", ".")) else q + "?"
        assert t["prompt"] == [user(f"{TRAIN} Question: {q}")]
        assert t["data_source"] == "limo" and t["reward_model"]["ground_truth"] == str(i)
        assert t["extra_info"]["solution"] == f"sol {i}"
        assert t["extra_info"]["split"] == ("test" if t in test else "train")
    assert data.base_prompt("Find x ") == f"{TRAIN} Question: Find x?"
    write_jsonl(tmp_path / "limo.jsonl", rows)  # JSONL input, same split
    assert run_cli("limo", "--input", tmp_path / "limo.jsonl", "--out", tmp_path / "b").returncode == 0
    for split in ("train", "test"):
        assert read_split(tmp_path / "a", split) == read_split(tmp_path / "b", split)
    loaded = data.load_dataset(str(tmp_path / "a" / "test.parquet"))
    assert loaded[0]["messages"] == test[0]["prompt"] and loaded[0]["problem"] == rows[order[0]]["question"]


def test_r1_220k_filters(tmp_path):
    rows = [("Plain problem 1", "5", "math-word-problem"),
            ("Pick one: (A) 1 (B) 2 (C) 3 (D) 4 (E) 5", "3", "math-word-problem"),
            (r"Which? $\textbf{(A)}\ 1 \qquad \textbf{(B)}\ 2 \qquad \textbf{(C)}\ 3 \qquad \textbf{(D)}\ 4$", "x",
             "math-word-problem"),
            ("Which statement holds?", "C", "math-word-problem"),
            ("Which statement holds again?", "(B)", "math-word-problem"),
            ("Flagged by question_type", "12", "MCQ"),
            ("Long answer", "x" * 51, "math-word-problem"),
            ("Just fits", "y" * 50, "math-word-problem"),
            ("Prove it", "proof", "proof"),
            ("Plain problem 2", "7", "math-word-problem")]
    table = pa.table({"problem": [r[0] for r in rows], "solution": ["s"] * len(rows), "answer": [r[1] for r in rows],
                      "question_type": [r[2] for r in rows], "generations": [["long text"]] * len(rows)})
    pq.write_table(table, tmp_path / "r1.parquet")

    def kept(out, *flags):
        r = run_cli("r1_220k", "--input", tmp_path / "r1.parquet", "--out", tmp_path / out, "--test-frac", "0.25",
                    *flags)
        assert r.returncode == 0, r.stderr
        recs = read_split(tmp_path / out, "train") + read_split(tmp_path / out, "test")
        return sorted(rows[t["extra_info"]["index"]][0] for t in recs)

    assert kept("a") == ["Just fits", "Plain problem 1", "Plain problem 2"]
    assert len(kept("b", "--keep-mc")) == 8
    assert len(kept("c", "--max-answer-chars", "0")) == 4
    assert len(read_split(tmp_path / "a", "test")) == 1  # round(3 * 0.25) = 1
    write_jsonl(tmp_path / "r1.jsonl", [{"problem": r[0], "solution": "s", "answer": r[1]} for r in rows])
    r = run_cli("r1_220k", "--input", tmp_path / "r1.jsonl", "--out", tmp_path / "d", "--test-frac", "0.25")
    assert r.returncode == 0, r.stderr  # without question_type, only the text heuristics apply
    assert len(read_split(tmp_path / "d", "train") + read_split(tmp_path / "d", "test")) == 4


def check_arith(rows, digits, ops):
    for r in rows:
        a, op, b = r["problem"].removeprefix("What is ").removesuffix("?").split()
        assert op in ops and r["answer"] == str(eval(f"{a}{op}{b}"))
        if op == "*":
            assert 1 <= len(a) <= max(1, digits - 1) and len(b) == 1
        else:
            assert 1 <= len(a) <= digits and 1 <= len(b) <= digits
        assert int(r["answer"]) >= 0


def test_arith(tmp_path):
    a = data.make_arith(300, seed=3)
    assert a == data.make_arith(300, seed=3)
    assert a != data.make_arith(300, seed=4) and a != data.make_arith(300, seed=3, split="test")
    check_arith(a, 2, "+*")
    terms = [r["problem"].removeprefix("What is ").removesuffix("?").split() for r in a]
    kinds = {(len(x), op, len(y)) for x, op, y in terms}
    assert kinds == {(1, "+", 1), (2, "+", 2), (1, "*", 1)}  # the default mix
    check_arith(data.make_arith(200, seed=1, digits=3, ops="-,+,*"), 3, "-+*")
    r = run_cli("arith", "--out", tmp_path / "ar", "--n-train", 50, "--n-test", 10, "--seed", 3)
    assert r.returncode == 0, r.stderr
    train = data.load_dataset(str(tmp_path / "ar"))
    assert len(train) == 50 and len(data.load_dataset(str(tmp_path / "ar" / "test.parquet"))) == 10
    assert [t["ground_truth"] for t in train] == [r["answer"] for r in a[:50]]
    assert train[0]["messages"] == [user(data.base_prompt(a[0]["problem"]))] and train[0]["data_source"] == "arith"
    bundled = data.load_dataset("arith_test", "none")
    assert [b["problem"] for b in bundled] == [r["problem"] for r in data.make_arith(100, split="test")]
    check_arith([{"problem": b["problem"], "answer": b["ground_truth"]} for b in bundled], 2, "+*")


def replay_story(problem):
    """An independent reading of a story problem -> (events, the count at the end)."""
    import re

    sentences = problem.split(". ")
    count = int(re.fullmatch(r"(\w+) has (\d+) (\w+)", sentences[0])[2])
    for s in sentences[1:-1]:
        if m := re.fullmatch(r"\w+ buys (\d+) more", s):
            count += int(m[1])
            assert 1 <= int(m[1]) <= 9
        elif m := re.fullmatch(r"\w+ gives (\d+) away", s):
            assert 1 <= int(m[1]) < count
            count -= int(m[1])
        else:
            assert re.fullmatch(r"Then the number of \w+ doubles", s) and count <= 20, s
            count *= 2
    assert sentences[-1].startswith("How many ")
    return len(sentences) - 2, count


def test_story():
    s = data.make_story(400, seed=3)
    assert s == data.make_story(400, seed=3)
    assert s != data.make_story(400, seed=4) and s != data.make_story(400, seed=3, split="test")
    replayed = [replay_story(r["problem"]) for r in s]
    assert [str(count) for _, count in replayed] == [r["answer"] for r in s]
    assert {events for events, _ in replayed} == {1, 2}
    text = " ".join(r["problem"] for r in s)
    assert all(w in text for w in ("buys", "gives", "doubles"))  # every event kind occurs
    bundled = data.load_dataset("story_test", "worked-steps")
    assert [b["problem"] for b in bundled] == [r["problem"] for r in data.make_story(100, split="test")]
    assert {b["data_source"] for b in bundled} == {"story"}
    assert bundled[0]["messages"][0] == system(data.SYSTEM_PROMPTS["worked-steps"])
    assert [b["ground_truth"] for b in bundled] == [str(replay_story(b["problem"])[1]) for b in bundled]


# ----------------------------------------------------------------------------- bad input

def ref_table(**over):
    cols = {"data_source": ["x", "x"], "prompt": [[user("a")], [user("b")]],
            "reward_model": [{"style": "rule", "ground_truth": "1"}, {"style": "rule", "ground_truth": None}]}
    return pa.table({**cols, **over})


BAD = {  # name: (files to create, argv, substrings of the error line)
    "missing_file": ({}, ["limo", "--input", "nope.jsonl"], ["nope.jsonl", "no such file"]),
    "unknown_ext": ({"in.txt": "{}"}, ["limo", "--input", "in.txt"], ["in.txt", "'.txt'"]),
    "malformed_line": ({"in.jsonl": '{"question": "a", "answer": "1"}\n\n{"question": oops}\n'},
                       ["limo", "--input", "in.jsonl"], ["in.jsonl", "line 3", "malformed JSON"]),
    "malformed_json_list": ({"in.json": '[\n {"question": "a",\n  "answer": }\n]'}, ["limo", "--input", "in.json"],
                            ["in.json", "line 3", "malformed JSON"]),
    "missing_column": ({"in.jsonl": '{"question": "a", "answer": "1"}\n{"question": "b"}\n'},
                       ["limo", "--input", "in.jsonl"], ["in.jsonl", "line 2", "'answer'"]),
    "mistyped_column": ({"in.jsonl": '{"problem": "a", "answer": "1"}\n{"problem": 5, "answer": "1"}\n'},
                        ["show", "in.jsonl"], ["in.jsonl", "line 2", "'problem'"]),
    "mistyped_answer": ({"in.json": '[{"question": "a", "answer": {"x": 1}}]'}, ["limo", "--input", "in.json"],
                        ["in.json", "row 0", "'answer'"]),
    "empty": ({"in.jsonl": "\n"}, ["limo", "--input", "in.jsonl"], ["in.jsonl", "no rows"]),
    "unknown_name": ({}, ["show", "nosuch"], ["'nosuch'", "math500"]),
    "parquet_missing_column": ({"in.parquet": ref_table().drop_columns(["reward_model"])}, ["show", "in.parquet"],
                               ["in.parquet", "'reward_model'"]),
    "parquet_mistyped_column": ({"in.parquet": ref_table(prompt=[1, 2])}, ["show", "in.parquet"],
                                ["in.parquet", "'prompt'"]),
    "parquet_null_truth": ({"in.parquet": ref_table()}, ["show", "in.parquet"],
                           ["in.parquet", "row 1", "'reward_model.ground_truth'"]),
    "parquet_not_parquet": ({"in.parquet": "not parquet"}, ["show", "in.parquet"], ["in.parquet", "parquet"]),
    "r1_missing_column": ({"in.parquet": pa.table({"problem": ["p"]})}, ["r1_220k", "--input", "in.parquet"],
                          ["in.parquet", "'answer'"]),
    "too_few_rows": ({"in.jsonl": '{"question": "a", "answer": "1"}\n'}, ["limo", "--input", "in.jsonl"],
                     ["in.jsonl", "too few"]),
    "bad_ops": ({}, ["arith", "--ops", "+,/"], ["--ops"]),
    "bad_flag": ({}, ["arith", "--n-train", "many"], ["--n-train"]),
    "not_utf8": ({"in.jsonl": b'{"question": "a", "answer": "1"}\n{"question": "\xff", "answer": "1"}\n'},
                 ["limo", "--input", "in.jsonl"], ["in.jsonl", "line 2", "UTF-8"]),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input(tmp_path, name):
    files, argv, needles = BAD[name]
    for fname, content in files.items():
        if isinstance(content, pa.Table):
            pq.write_table(content, tmp_path / fname)
        elif isinstance(content, bytes):
            (tmp_path / fname).write_bytes(content)
        else:
            (tmp_path / fname).write_text(content)
    if argv[0] != "show":
        argv = argv + ["--out", "out"]
    r = run_cli(*argv, cwd=tmp_path)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for needle in needles:
        assert needle in lines[0]
    assert not (tmp_path / "out").exists()


def test_die_writes_one_line_in_one_call(monkeypatch):
    import sys

    writes = []

    class Stderr:  # what two ranks sharing an unbuffered pipe see: every write call is a separate chunk
        write = writes.append

        def flush(self):
            writes.append(None)

    monkeypatch.setattr(sys, "stderr", Stderr())
    with pytest.raises(SystemExit) as e:
        cli.die("bad\nthing")
    assert e.value.code == 2 and writes == ["error: bad thing\n", None]


def test_write_atomic(tmp_path):
    path = tmp_path / "f.json"
    cli.write_atomic(path, "text ü\n")
    assert path.read_text(encoding="utf-8") == "text ü\n"
    cli.write_atomic(path, b"\x00bytes")
    assert path.read_bytes() == b"\x00bytes"
    with pytest.raises(TypeError):
        cli.write_atomic(path, 5)  # fails while writing: the old file stays whole
    assert path.read_bytes() == b"\x00bytes" and [p.name for p in tmp_path.iterdir()] == ["f.json"]


def test_read_rows_locations_and_columns(tmp_path):
    rows = [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}]
    (tmp_path / "r.jsonl").write_text('{"a": 1, "b": "x"}\n\n{"a": 2, "b": "y"}\n')  # a blank line 2
    (tmp_path / "r.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "r.parquet")
    assert list(data.read_rows(tmp_path / "r.jsonl")) == [("line 1", rows[0]), ("line 3", rows[1])]
    assert list(data.read_rows(tmp_path / "r.json")) == [("row 0", rows[0]), ("row 1", rows[1])]
    assert list(data.read_rows(tmp_path / "r.parquet", columns=["b", "c"])) == [("row 0", {"b": "x"}),
                                                                                ("row 1", {"b": "y"})]
    with pytest.raises(data.DataError, match=r"r\.parquet: missing column 'c'"):
        data.read_rows(tmp_path / "r.parquet", required=["a", "c"])


def test_library_errors_are_value_errors():
    with pytest.raises(ValueError, match="unknown dataset 'nosuch'"):
        data.load_dataset("nosuch")
    with pytest.raises(data.DataError, match="no such file"):
        data.load_dataset("missing/file.jsonl")


# ----------------------------------------------------------------------------- prompts and bundled sets

def chatml(messages):
    """SmolLM2's chat format written out by hand: ChatML, with its default system turn when none is given."""
    if messages[0]["role"] != "system":
        messages = [system("You are a helpful AI assistant named SmolLM, trained by Hugging Face")] + messages
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


@pytest.mark.parametrize("option", ["eval", "train", "none", "Think hard."])
def test_prompt_ids_token_exact(smollm2_dir, option):
    from infra import hf

    tok = hf.load_tokenizer(smollm2_dir)
    for rec in data.load_dataset("math500", option, limit=3) + data.load_dataset("arith_test", option, limit=2):
        ids = data.prompt_ids(tok, rec["messages"])
        assert isinstance(ids, list) and all(type(t) is int for t in ids)
        text = chatml(rec["messages"])
        assert tok.apply_chat_template(rec["messages"], add_generation_prompt=True, tokenize=False) == text
        assert ids == tok.encode(text, add_special_tokens=False)
        decoded = tok.decode(ids)
        for key, prompt in data.SYSTEM_PROMPTS.items():
            if prompt:
                assert (prompt in decoded) == (option == key)
        assert ("Think hard." in decoded) == (option == "Think hard.")
        assert decoded.endswith(rec["problem"] + "<|im_end|>\n<|im_start|>assistant\n")


def test_bundled_sets():
    want = {"math500": 500, "aime24": 30, "amc23": 40, "minerva": 272, "olympiadbench": 675, "gsm8k": 1319,
            "gsm8k_train": 2000, "math_train": 7469, "aime_train": 969, "arith_train": 1000, "arith_test": 100,
            "story_train": 1000, "story_test": 100, "overthink_train": 1000, "overthink_test": 100}
    assert set(want) == set(data.BUNDLED)
    for name, n in want.items():
        recs = data.load_dataset(name)
        assert len(recs) == n
        source = {"arith": "arith", "story": "story", "overt": "story"}.get(name[:5], name)
        assert {r["data_source"] for r in recs} == {source}
        assert len({r["id"] for r in recs}) == n
        assert all(r["messages"] == [system(EVAL), user(r["problem"])] for r in recs)
        assert all(isinstance(r["ground_truth"], str) and r["ground_truth"] for r in recs)
    for path in {**data.BENCHMARKS, **data.TRAIN_SETS}.values():
        assert (ROOT / path).is_file()
    first = json.loads((ROOT / "data" / "gsm8k_test.jsonl").open().readline())
    assert data.load_dataset("gsm8k", limit=1)[0]["ground_truth"] == first["answer"]
