"""Datasets for MuTIS: loaders, chat prompts, preprocessors, bundled benchmarks, synthetic arithmetic.

    python data.py limo    --out data/limo                           # LIMO from the HF hub -> train/test.parquet
    python data.py r1_220k --out data/r1                             # OpenR1-Math-220k from the hub, filtered
    python data.py limo    --input limo.json --out data/limo         # the same from files you bring (--input)
    python data.py arith   --out data/arith                          # seeded synthetic arithmetic
    python data.py show    math500 --limit 1                         # load anything, print a record

`load_dataset(spec)` reads a bundled name (BENCHMARKS, TRAIN_SETS, ARITH_SETS, STORY_SETS, OVERTHINK_SETS) or a path:
  * reference MuTIS/veRL parquet: data_source, prompt (list of chat messages), ability,
    reward_model {style, ground_truth}, extra_info -- what the preprocessors write;
  * simple parquet: prompt (a string, used as the user message), response, data_source and a
    ground truth column `ground_truth` or `answer` (without one a file can only have its
    responses scored, so loading it is an error);
  * JSONL, or a .json list, of {problem | question, answer, [solution, id, source]};
  * a directory holding train.parquet.
Every loader returns normalised records {id, data_source, messages, ground_truth, problem}.

Prompts: problem files become [system prompt, user problem], by default with the paper's eval
prompt SYSTEM_PROMPTS["eval"]. Parquet prompts are used as they are (the preprocessors put the
reference "base" instruction inside the user message and add no system turn); a system prompt
is prepended to them only when one is asked for and none is present. (SmolLM2's chat template
inserts its own default system turn when a conversation has none, e.g. with system prompt "none".)
Bad input raises DataError (a ValueError) naming file, row and column; the CLI prints one
`error:` line and exits 2, writing nothing.
"""
import argparse
import json
import os
import random
import re
from pathlib import Path

from infra import hub
from infra.cli import ArgumentParser, deprecated, die, positive_int

ROOT = Path(__file__).resolve().parent
SYSTEM_PROMPTS = {
    "eval": "Please reason step by step, and put your final answer within \\boxed{}.",
    "train": "Answer the given math question. Please reason step by step and put the final answer in \\boxed{}.",
    "none": None,
    # The demo's: SmolLM2-135M almost never writes \boxed{} or 'Answer:' unprompted (the turn rule then sees no
    # answer at all); one worked example in the system turn gets it to about 1 in 5, leaving RL room to act.
    "answer-line": "Solve the problem. End your reply with a line 'Answer: <number>'.\n"
                   "Example:\nWhat is 3 + 4?\n3 + 4 = 7.\nAnswer: 7",
    # The story task's: a worked example with one calculation per event gets the 135M model to write the
    # calculation before the answer line (bench/reasoning_gap.py measures what that is worth).
    "worked-steps": "Solve the problem. Write the calculation, then end with a line 'Answer: <number>'.\n"
                    "Example:\nAnna has 3 coins. Anna buys 4 more. Anna gives 2 away. "
                    "How many coins does Anna have now?\n3 + 4 = 7.\n7 - 2 = 5.\nAnswer: 5",
}
BENCHMARKS = {
    "math500": "data/math500.jsonl",
    "aime24": "data/aime24.jsonl",
    "amc23": "data/amc23.jsonl",
    "minerva": "data/minerva.jsonl",
    "olympiadbench": "data/olympiadbench.jsonl",
    "gsm8k": "data/gsm8k_test.jsonl",
}
TRAIN_SETS = {
    "gsm8k_train": "data/gsm8k_train.jsonl",
    "math_train": "data/math_train.jsonl",
    "aime_train": "data/aime_1983_2023_train.jsonl",
}
ARITH_SETS = {"arith_train": ("train", 1000), "arith_test": ("test", 100)}  # generated on the fly, seed ARITH_SEED
STORY_SETS = {"story_train": ("train", 1000), "story_test": ("test", 100)}  # likewise, by make_story
# story problems of 2 or 3 events in a stream of their own: the overthinker's (bench/overthinker.py)
OVERTHINK_SETS = {"overthink_train": ("train", 1000), "overthink_test": ("test", 100)}
ARITH_SEED = 42
BUNDLED = (*BENCHMARKS, *TRAIN_SETS, *ARITH_SETS, *STORY_SETS, *OVERTHINK_SETS)  # every name load_dataset takes besides a path
ARITH_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
SUFFIXES = (".jsonl", ".json", ".parquet")


class DataError(ValueError):
    """Bad input data; the message is one line naming file, row and column."""


# ----------------------------------------------------------------------------- reading rows

def _utf8(data, where):
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _iter_jsonl(path):
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            line = _utf8(raw, f"{path}: line {n}")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: line {n}: malformed JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}: line {n}: expected a JSON object, got {type(row).__name__}")
            yield f"line {n}", row


def _iter_json(path):
    text = _utf8(Path(path).read_bytes(), path)
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # a .json file that is really JSON Lines
            yield from _iter_jsonl(path)
            return
        raise DataError(f"{path}: line {e.lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(rows, list):
        raise DataError(f"{path}: expected a JSON list of objects, got {type(rows).__name__}")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{path}: row {i}: expected a JSON object, got {type(row).__name__}")
        yield f"row {i}", row


def _parquet(path):
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a file that is not parquet
        raise DataError(f"{path}: not a readable parquet file ({type(e).__name__})") from None


def _iter_parquet(pf, columns=None):
    """Stream rows as dicts, one record batch at a time."""
    rows = (row for batch in pf.iter_batches(batch_size=1024, columns=columns) for row in batch.to_pylist())
    return ((f"row {i}", row) for i, row in enumerate(rows))


def _check_path(path):
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    if path.is_dir():
        if not (path / "train.parquet").is_file():
            raise DataError(f"{path}: directory holds no train.parquet")
        return path / "train.parquet"
    if path.suffix not in SUFFIXES:
        raise DataError(f"{path}: unknown file type {path.suffix!r} (expected {', '.join(SUFFIXES)} "
                        f"or a directory holding train.parquet)")
    return path


def read_rows(path, columns=None, required=()):
    """Rows of any input file (.jsonl, .json, .parquet, a directory holding train.parquet) as (location, dict),
    streamed; from parquet read only those `columns` that exist. Bad input raises DataError naming file and row."""
    path = _check_path(path)
    if path.suffix == ".jsonl":
        return _iter_jsonl(path)
    if path.suffix == ".json":
        return _iter_json(path)
    pf = _parquet(path)
    names = pf.schema_arrow.names
    missing = [c for c in required if c not in names]
    if missing:
        raise DataError(f"{path}: missing column {missing[0]!r}")
    return _iter_parquet(pf, columns and [c for c in columns if c in names])


# ----------------------------------------------------------------------------- fields

def _text(row, keys, where, optional=False):
    """The first present key of `keys`, as a non-empty string."""
    key = next((k for k in keys if row.get(k) is not None), None)
    if key is None:
        if optional:
            return None
        raise DataError(f"{where}: missing column {' or '.join(map(repr, keys))}")
    value = row[key]
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: column {key!r}: expected a non-empty string, got {value!r:.60}")
    return value


def _truth(value, where, col):
    """Ground truth as a string or a list of strings; integral numbers are accepted, [x] becomes x."""
    if value is None:
        raise DataError(f"{where}: missing column {col!r}")
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, list) and value:
        return [_truth(v, where, col) for v in value]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: column {col!r}: expected a non-empty string or list of strings, "
                        f"got {value!r:.60}")
    return value


def _messages(value, where):
    ok = isinstance(value, list) and value and all(
        isinstance(m, dict) and m.get("role") in ("system", "user", "assistant") and isinstance(m.get("content"), str)
        for m in value)
    if not ok:
        raise DataError(f"{where}: column 'prompt': expected a non-empty list of {{role, content}} messages, "
                        f"got {value!r:.60}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _with_system(messages, system):
    if system is None or messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": system}] + messages


def _record(id, data_source, problem, truth, system):
    messages = _with_system([{"role": "user", "content": problem}], system)
    return {"id": id, "data_source": data_source, "messages": messages, "ground_truth": truth, "problem": problem}


# ----------------------------------------------------------------------------- loaders

def _load_problems(rows, path, system, data_source=None):
    """{problem | question, answer} rows; data_source = the given name, else the row's, else the file stem."""
    for i, (loc, row) in enumerate(rows):
        where = f"{path}: {loc}"
        problem = _text(row, ("problem", "question"), where)
        truth = _truth(row.get("answer"), where, "answer")
        source = data_source or next((row[k] for k in ("data_source", "source") if isinstance(row.get(k), str)),
                                     Path(path).stem)
        rid = row.get("id")
        rid = str(rid) if isinstance(rid, (str, int)) and not isinstance(rid, bool) else f"{source}-{i}"
        yield _record(rid, source, problem, truth, system)


def _load_parquet(path, system):
    pf = _parquet(path)
    schema = pf.schema_arrow
    if "prompt" not in schema.names:
        raise DataError(f"{path}: missing column 'prompt'")
    kind = str(schema.field("prompt").type)
    if kind.startswith(("list", "large_list")):
        yield from _load_reference(pf, path, system)
        return
    if kind not in ("string", "large_string"):
        raise DataError(f"{path}: column 'prompt': expected a list of chat messages or a string, got {kind}")
    col = next((c for c in ("ground_truth", "answer") if c in schema.names), None)
    if col is None:
        raise DataError(f"{path}: missing column 'ground_truth' (or 'answer'): a prompt/response file "
                        f"without answers can only be scored, not trained or evaluated on")
    for i, (loc, row) in enumerate(_iter_parquet(pf)):
        where = f"{path}: {loc}"
        prompt = _text(row, ("prompt",), where)
        source = row.get("data_source") if isinstance(row.get("data_source"), str) else Path(path).stem
        yield _record(f"{source}-{i}", source, prompt, _truth(row.get(col), where, col), system)


def _load_reference(pf, path, system):
    if "reward_model" not in pf.schema_arrow.names:
        raise DataError(f"{path}: missing column 'reward_model'")
    for i, (loc, row) in enumerate(_iter_parquet(pf)):
        where = f"{path}: {loc}"
        messages = _with_system(_messages(row["prompt"], where), system)
        rm = row["reward_model"] if isinstance(row["reward_model"], dict) else {}
        truth = _truth(rm.get("ground_truth"), where, "reward_model.ground_truth")
        source = row.get("data_source") if isinstance(row.get("data_source"), str) else Path(path).stem
        extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
        problem = extra.get("question")
        if not isinstance(problem, str):  # fall back to the last non-assistant turn
            problem = next(m["content"] for m in reversed(messages) if m["role"] != "assistant")
        rid = extra["id"] if isinstance(extra.get("id"), str) else f"{source}-{extra.get('index', i)}"
        yield {"id": rid, "data_source": source, "messages": messages, "ground_truth": truth, "problem": problem}


def _numbered(rows):
    return ((f"row {i}", r) for i, r in enumerate(rows))


def load_dataset(spec, system_prompt=None, limit=None):
    """Normalised records from a bundled name or a path (see the module docstring).

    system_prompt: a SYSTEM_PROMPTS key or literal text; None (default) means "eval" for problem
    files, bundled sets and arith, and parquet prompts exactly as stored.
    """
    if limit is not None and limit < 1:
        raise DataError(f"limit must be >= 1, got {limit}")
    system = SYSTEM_PROMPTS.get(system_prompt, system_prompt)
    problem_system = SYSTEM_PROMPTS["eval"] if system_prompt is None else system
    spec = str(spec)
    if spec in ARITH_SETS:
        split, n = ARITH_SETS[spec]
        records = _load_problems(_numbered(make_arith(n, ARITH_SEED, split=split)), spec, problem_system, "arith")
    elif spec in STORY_SETS or spec in OVERTHINK_SETS:
        split, n = {**STORY_SETS, **OVERTHINK_SETS}[spec]
        made = make_story(n, ARITH_SEED, split) if spec in STORY_SETS else make_overthink(n, ARITH_SEED, split)
        records = _load_problems(_numbered(made), spec, problem_system, "story")
    elif spec in BENCHMARKS or spec in TRAIN_SETS:
        path = ROOT / {**BENCHMARKS, **TRAIN_SETS}[spec]
        records = _load_problems(read_rows(path), path, problem_system, spec)
    else:
        if not Path(spec).exists() and "/" not in spec and Path(spec).suffix not in SUFFIXES:
            raise DataError(f"unknown dataset {spec!r}: neither a bundled name ({', '.join(BUNDLED)}) "
                            "nor an existing path")
        path = _check_path(spec)
        records = (_load_parquet(path, system) if path.suffix == ".parquet"
                   else _load_problems(read_rows(path), path, problem_system))
    out = []
    for rec in records:  # stop reading at `limit`
        out.append(rec)
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise DataError(f"{spec}: no rows")
    return out


def prompt_ids(tokenizer, messages):
    """Token ids of the chat-templated prompt, ending with the assistant header."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding here
        ids = ids["input_ids"]
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(t) for t in ids]


# ----------------------------------------------------------------------------- writing

def _table(records, split):
    """Normalised records (+ optional `index`, `solution`) -> a reference-layout arrow table."""
    import pyarrow as pa

    list_truth = any(isinstance(r["ground_truth"], list) for r in records)  # one column type for all rows
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    extra = pa.struct([("split", pa.string()), ("index", pa.int64()), ("id", pa.string()),
                       ("question", pa.string()), ("solution", pa.string())])
    reward = pa.struct([("style", pa.string()), ("ground_truth", pa.list_(pa.string()) if list_truth else pa.string())])
    schema = pa.schema([("data_source", pa.string()), ("prompt", pa.list_(message)), ("ability", pa.string()),
                        ("reward_model", reward), ("extra_info", extra)])
    rows = []
    for i, r in enumerate(records):
        truth = [r["ground_truth"]] if list_truth and isinstance(r["ground_truth"], str) else r["ground_truth"]
        rows.append({"data_source": r["data_source"], "prompt": r["messages"], "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": truth},
                     "extra_info": {"split": split, "index": r.get("index", i), "id": r["id"],
                                    "question": r["problem"], "solution": r.get("solution")}})
    return pa.Table.from_pylist(rows, schema=schema)


def _write_tables(tables):
    """Write {path: table} all-or-nothing: every temp file first, then os.replace each."""
    import pyarrow.parquet as pq

    tmps = {Path(p): Path(p).with_name(f".{Path(p).name}.tmp{os.getpid()}") for p in tables}
    try:
        for path, table in tables.items():
            pq.write_table(table, tmps[Path(path)])
        for path, tmp in tmps.items():
            os.replace(tmp, path)
    finally:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)


def _write_splits(out, train, test):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _write_tables({out / "train.parquet": _table(train, "train"), out / "test.parquet": _table(test, "test")})
    print(f"wrote {len(train)} train and {len(test)} test rows to {out}/")


def _split(records, test_frac, seed, path):
    """Shuffle with `seed`; the first round(n * test_frac) rows (at least 1) are the test split."""
    n, n_test = len(records), max(1, round(len(records) * test_frac))
    if n_test >= n:
        raise DataError(f"{path}: {n} usable rows are too few to split off a test set of {n_test}")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return [records[i] for i in order[n_test:]], [records[i] for i in order[:n_test]]


# ----------------------------------------------------------------------------- preprocessors

def base_prompt(question):
    """The reference "base" template; a question ending without '?' or '.' gets a '?'."""
    question = question.strip()
    if not question.endswith(("?", ".")):
        question += "?"
    return f"{SYSTEM_PROMPTS['train']} Question: {question}"


def _templated(id, data_source, question, truth, index, solution=None):
    """A preprocessed record: the instruction lives in the user message, no system turn."""
    return {"id": id, "data_source": data_source, "messages": [{"role": "user", "content": base_prompt(question)}],
            "ground_truth": truth, "problem": question, "index": index, "solution": solution}


def _inputs(args):
    """--input's files, else the dataset's files fetched from the Hugging Face hub (infra/hub.py), and a name for them."""
    paths = args.input
    if not paths:
        paths, commit = hub.fetch_dataset(args.cmd, args.revision)
        print(f"{hub.DATASETS[args.cmd]['repo']} at commit {commit}: {len(paths)} file(s) in {paths[0].parent}")
    return paths, str(paths[0]) if len(paths) == 1 else f"{paths[0]} and {len(paths) - 1} more"


def _rows_of(paths, columns=None, required=()):
    """The rows of several files in turn, as (where, row): `where` names the file and the row in it."""
    for path in paths:
        for loc, row in read_rows(path, columns, required):
            yield f"{path}: {loc}", row


def cmd_limo(args):
    paths, name = _inputs(args)
    records = []
    for i, (where, row) in enumerate(_rows_of(paths)):
        question, truth = _text(row, ("question", "problem"), where), _truth(row.get("answer"), where, "answer")
        solution = _text(row, ("solution",), where, optional=True)
        records.append(_templated(f"limo-{i}", "limo", question, truth, i, solution))
    if not records:
        raise DataError(f"{name}: no rows")
    _write_splits(args.out, *_split(records, args.test_frac, args.seed, name))


MC_OPTION = re.compile(r"\(\s*([A-E])\s*\)")
MC_ANSWER = re.compile(r"^\s*\(?\s*(?:\\text(?:bf)?\{|\\mathrm\{)?\s*[A-E]\s*\}?\s*\)?\s*$")
NO_ANSWER = {"", "proof", "notfound"}  # how OpenR1 marks proofs and answers it could not parse


def is_multiple_choice(problem, answer):
    """Options (A) to (D) in the problem, or a bare letter A-E as the answer."""
    return {"A", "B", "C", "D"} <= set(MC_OPTION.findall(problem)) or bool(MC_ANSWER.match(answer))


def cmd_r1_220k(args):
    paths, name = _inputs(args)
    # Read only what we use: OpenR1 parquet files also carry long `generations` columns.
    rows = _rows_of(paths, ["problem", "solution", "answer", "question_type", "uuid"], ["problem", "answer"])
    records, dropped = [], {"multiple_choice": 0, "long_answer": 0, "no_answer": 0}
    for i, (where, row) in enumerate(rows):
        problem = _text(row, ("problem",), where)
        answer = row.get("answer")
        if answer is None or (isinstance(answer, str) and answer.strip().lower() in NO_ANSWER):
            dropped["no_answer"] += 1
            continue
        answer = _truth(answer, where, "answer")
        flat = answer if isinstance(answer, str) else ", ".join(answer)
        if not args.keep_mc and (row.get("question_type") == "MCQ" or is_multiple_choice(problem, flat)):
            dropped["multiple_choice"] += 1
            continue
        if args.max_answer_chars and len(flat) > args.max_answer_chars:
            dropped["long_answer"] += 1
            continue
        rid = row["uuid"] if isinstance(row.get("uuid"), str) else f"r1_220k-{i}"
        solution = _text(row, ("solution",), where, optional=True)
        records.append(_templated(rid, "r1_220k", problem, answer, i, solution))
    print("dropped: " + ", ".join(f"{k}={v}" for k, v in dropped.items()))
    if not records:
        raise DataError(f"{name}: no rows left after filtering")
    _write_splits(args.out, *_split(records, args.test_frac, args.seed, name))


def make_arith(n, seed=ARITH_SEED, digits=2, ops="+,*", split="train"):
    """Seeded arithmetic problems [{id, problem, answer}].

    Per item: an operator from `ops`, then a digit count d: + and - take two d-digit operands with
    d uniform in 1..digits; * a d-digit by a 1-digit operand with d uniform in 1..max(1, digits-1),
    since multiplication is harder (SmolLM2-135M greedy: 1-digit + ~53%, 1-digit * ~73%,
    2-digit + ~20%; the default digits=2, ops="+,*" mixes these three). - orders its operands so
    results are >= 0; 1-digit operands are 1-9. Each split has its own random stream.
    """
    op_list = [o.strip() for o in ops.split(",") if o.strip()]
    if not op_list or any(o not in ARITH_OPS for o in op_list):
        raise DataError(f"--ops {ops!r}: expected a comma-separated subset of {','.join(ARITH_OPS)}")
    if digits < 1:
        raise DataError(f"--digits {digits}: must be >= 1")
    rng = random.Random(f"arith-{split}-{seed}")
    rows = []
    for i in range(n):
        op = rng.choice(op_list)
        d = rng.randint(1, max(1, digits - 1) if op == "*" else digits)
        lo, hi = (10 ** (d - 1) if d > 1 else 1), 10 ** d - 1
        a, b = rng.randint(lo, hi), (rng.randint(1, 9) if op == "*" else rng.randint(lo, hi))
        if op == "-" and b > a:
            a, b = b, a
        rows.append({"id": f"arith-{split}-{i:05d}", "problem": f"What is {a} {op} {b}?",
                     "answer": str(ARITH_OPS[op](a, b))})
    return rows


STORY_NAMES = ("Tom", "Anna", "Sam", "Lily", "Ben", "Mia")
STORY_ITEMS = ("apples", "marbles", "stickers", "coins", "books", "pencils")


def make_story(n, seed=ARITH_SEED, split="train", events=(1, 2), stream="story"):
    """Seeded word problems with intermediate quantities [{id, problem, answer}]: someone holds 2-9 things,
    then 1 or 2 events change the count (buys 1-9 more; gives away fewer than held; the count doubles, only
    while at most 20 are held), then the question. Working pays here: SmolLM2-135M with the 'worked-steps'
    prompt solves 16 % of story_test (24 % of one-event, 9 % of two-event problems) when it writes the calculation
    first, 3 % when it must answer at once (bench/reasoning_gap.py, data/README.md). Each split has its own stream,
    and each `stream` name its own problems.
    """
    rng = random.Random(f"{stream}-{split}-{seed}")
    rows = []
    for i in range(n):
        name, item, count = rng.choice(STORY_NAMES), rng.choice(STORY_ITEMS), rng.randint(2, 9)
        text = [f"{name} has {count} {item}."]
        for _ in range(rng.choice(events)):
            event = rng.choice(("buy", "give", "double") if count <= 20 else ("buy", "give"))
            if event == "give" and count < 2:
                event = "buy"
            if event == "buy":
                k = rng.randint(1, 9)
                count, line = count + k, f"{name} buys {k} more."
            elif event == "give":
                k = rng.randint(1, min(count - 1, 9))
                count, line = count - k, f"{name} gives {k} away."
            else:
                count, line = 2 * count, f"Then the number of {item} doubles."
            text.append(line)
        text.append(f"How many {item} does {name} have now?")
        rows.append({"id": f"{stream}-{split}-{i:05d}", "problem": " ".join(text), "answer": str(count)})
    return rows


def make_overthink(n, seed=ARITH_SEED, split="train"):
    """The overthinker's problems (bench/overthinker.py): story problems of 2 or 3 events, in their own stream; the
    test split holds none of overthink_train's problems (the first 1000 of the train stream)."""
    if split == "train":
        return make_story(n, seed, split, events=(2, 3), stream="overthink")
    seen = {r["problem"] for r in make_overthink(OVERTHINK_SETS["overthink_train"][1], seed)}
    rows = [r for r in make_story(2 * n + 100, seed, split, events=(2, 3), stream="overthink")
            if r["problem"] not in seen][:n]
    assert len(rows) == n, "the train split covers too much of the problem space"
    return rows


def cmd_arith(args):
    train, test = ([_templated(r["id"], "arith", r["problem"], r["answer"], i)
                    for i, r in enumerate(make_arith(n, args.seed, args.digits, args.ops, split))]
                   for split, n in (("train", args.n_train), ("test", args.n_test)))
    _write_splits(args.out, train, test)


def cmd_show(args):
    records = load_dataset(args.spec, args.system_prompt, args.limit)
    print(f"{len(records)} records from {args.spec}")
    print(json.dumps(records[0], ensure_ascii=False, indent=1))


def main(argv=None):
    p = ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, func, frac, what in (("limo", cmd_limo, 0.1, "LIMO limo.json (a JSON list), JSONL or parquet"),
                                   ("r1_220k", cmd_r1_220k, 0.01, "OpenR1-Math-220k parquet or JSONL")):
        repo = hub.DATASETS[name]["repo"]
        s = sub.add_parser(name, help=f"{repo} (the Hugging Face hub, or --input) -> train/test.parquet")
        s.add_argument("--input", nargs="+", type=Path, metavar="FILE",
                       help=f"{what}, read in turn as one dataset (default: fetch {repo} from the hub)")
        s.add_argument("--revision", default=None, help=f"the hub's branch, tag or commit to fetch (default: "
                                                         f"{hub.DATASETS[name]['revision']})")
        s.add_argument("--out", required=True, help="output directory")
        s.add_argument("--test-frac", type=float, default=frac, help="fraction held out as test.parquet")
        s.add_argument("--seed", type=int, default=0, help="shuffle seed for the split")
        s.set_defaults(func=func)
    s.add_argument("--keep-mc", action="store_true", help="keep multiple-choice problems (dropped by default)")
    s.add_argument("--max-answer-chars", type=int, default=50, help="drop longer answers (0: keep all)")
    s = sub.add_parser("arith", help="seeded synthetic arithmetic -> train/test.parquet")
    s.add_argument("--out", required=True, help="output directory")
    s.add_argument("--n-train", type=positive_int, default=ARITH_SETS["arith_train"][1], help="training problems")
    s.add_argument("--n-test", type=positive_int, default=ARITH_SETS["arith_test"][1], help="test problems")
    s.add_argument("--seed", type=int, default=0, help=f"generator seed (arith_train/arith_test use {ARITH_SEED})")
    s.add_argument("--digits", type=int, default=2, help="max digits of + and - operands (* uses digits-1)")
    s.add_argument("--ops", default="+,*", help="comma-separated operators from + - *")
    s.set_defaults(func=cmd_arith)
    s = sub.add_parser("show", help="load a dataset, print its size and first record")
    s.add_argument("spec", help="bundled name or path")
    s.add_argument("--system-prompt", default=None, help="system prompt: eval, train, answer-line, none or literal text")
    s.add_argument("--system", dest="system_prompt", action=deprecated("--system", "--system-prompt"), help=argparse.SUPPRESS)
    s.add_argument("--limit", type=positive_int, default=None, help="load at most this many records")
    s.set_defaults(func=cmd_show)
    args = p.parse_args(argv)
    try:
        args.func(args)
    except DataError as e:
        die(str(e))
    except hub.HubError as e:
        die(f"data.py {args.cmd}: {e}")
    except OSError as e:  # unreadable input, unwritable --out
        die(f"{e.filename}: {e.strerror}" if e.filename else str(e))


if __name__ == "__main__":
    main()
