"""eval.py at scale: the engine's bounded in-flight requests and per-request callback, the reference defaults end to
end, one engine for two checkpoints of one architecture (against one engine each), a run killed mid-way and
resumed (against the uninterrupted run) and 2 ranks under torchrun (against 1 rank): greedy, fp32, token for token.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, TINY
from safetensors.torch import load_file, save_file

import data
import model
from infra import hf
from infra.repetition import loop_period

ENV = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
# 12 arithmetic problems, 40 tokens each, at most 3 requests in the engine at once: they finish in waves
ARGS = ["--benchmarks", "arith_test", "--limit", "12", "--max-response-tokens", "40", "--budgets", "none",
        "--engine-dtype", "float32", "--enforce-eager", "--max-in-flight", "3"]


def eval_cmd(*argv):
    return [sys.executable, str(ROOT / "eval.py"), *map(str, argv)]


def run_eval(*argv, timeout=600):
    r = subprocess.run(eval_cmd(*argv), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


# ----------------------------------------------------------------------------- the engines' new arguments

def check_bounded_callbacks(engine, prompts, bound, in_flight=None):
    """generate(max_in_flight=bound, on_finish=...) == generate() token for token; on_finish sees every request
    once, with the completion that is returned."""
    whole = engine.generate(prompts, 12, temperature=0.0, seed=list(range(len(prompts))))
    seen = {}

    def finished(i, c):
        assert i not in seen
        seen[i] = c
        if in_flight is not None:
            assert in_flight() <= bound

    got = engine.generate(prompts, 12, temperature=0.0, seed=list(range(len(prompts))), on_finish=finished,
                          max_in_flight=bound, logprobs=False)
    assert [c.token_ids for c in got] == [c.token_ids for c in whole]
    assert [c.stopped for c in got] == [c.stopped for c in whole]
    assert sorted(seen) == list(range(len(prompts))) and all(seen[i] == got[i] for i in seen)
    return got


def prompts_of(tokenizer, n):
    return [data.prompt_ids(tokenizer, r["messages"]) for r in data.load_dataset("gsm8k", "eval", n)]


def test_hf_engine_bounds_its_batch_and_reports_each_request(tiny_model_dir):
    from infra import engines

    engine = engines.make_engine(tiny_model_dir, kind="hf", dtype="float32")
    got = check_bounded_callbacks(engine, prompts_of(engine.tokenizer, 5), bound=2)
    assert all(len(c.logprobs) == len(c.token_ids) for c in got)


# ----------------------------------------------------------------------------- the reference's defaults

@pytest.mark.vllm
def test_defaults_clamp_the_cap_sweep_the_reference_budgets_and_count_repeats(tmp_path, tiny_model_dir):
    """The tiny model with a 1024-token context (its weights; RoPE has no learned positions): greedy to the cap."""
    small = tmp_path / "model"
    shutil.copytree(tiny_model_dir, small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    out = tmp_path / "out"
    r = run_eval(small, "--benchmarks", "gsm8k", "--limit", 2, "--engine-dtype", "float32", "--enforce-eager",
                 "--out", out)
    tok = hf.load_tokenizer(small)
    longest = max(len(data.prompt_ids(tok, rec["messages"])) for rec in data.load_dataset("gsm8k", "eval", 2))
    cap = 1024 - longest  # the model's context window minus the longest prompt
    notes = [x for x in r.stderr.splitlines() if "clamped" in x]
    assert notes == [f"note: response cap 32768 clamped to {cap} tokens: the context of {small} (1024) "
                     f"minus the longest prompt ({longest})"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["generated_tokens"] == cap and summary["args"]["temperature"] == 0
    budgets = [200, 400, 600, 800, cap]
    stats = summary["results"][str(small)]["gsm8k"]
    assert list(stats["budget_accuracy"]) == [str(b) for b in budgets]
    samples = lines(out / "samples.jsonl")
    assert all(len(s["response_ids"]) <= cap for s in samples)
    repeated = [s["truncated"] and loop_period(s["response_ids"]) is not None for s in samples]  # no answer anywhere
    assert [s["repeated"] for s in samples] == repeated and not any(s["repeated_after_answer"] for s in samples)
    assert stats["repeated"] == pytest.approx(sum(repeated) / 2)
    assert sum(repeated) >= 1  # a random model's greedy decoding loops
    assert "| truncated | repeated | after answer |" in (out / "summary.md").read_text()


# ----------------------------------------------------------------------------- one engine, resume, ranks

@pytest.fixture(scope="module")
def pair(tiny_model_dir, tmp_path_factory):
    """Two checkpoints of one architecture (random weights, seeds 0 and 1, the second's final norm negated) and one
    eval.py call over both: one engine, the second checkpoint's weights loaded through sync_weights."""
    other = model.make_tiny(tmp_path_factory.mktemp("tiny1") / "model", seed=1, **TINY)
    # a random tied model's greedy token is its input token again (its own embedding row scores highest): seeds 0 and
    # 1 both write '\n' forever. The final norm's scale negated, seed 1's picks other tokens: the samples tell them apart
    weights = load_file(Path(other) / "model.safetensors")
    weights["model.norm.weight"] = -weights["model.norm.weight"]
    save_file(weights, Path(other) / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path_factory.mktemp("both") / "out"
    r = run_eval(tiny_model_dir, other, *ARGS, "--out", out)
    return tiny_model_dir, other, out, r


@pytest.mark.vllm
def test_one_engine_for_two_checkpoints_equals_one_engine_each_and_knows_each_by_its_weights(pair, tmp_path):
    """The second checkpoint evaluated alone (from a copy: its path is then retrained) gives what the shared engine
    gave it; the journal knows a checkpoint by its weights, not its path: new weights under the evaluated path are
    refused, then evaluated afresh with --overwrite."""
    first, other, out, r = pair
    assert r.stdout.count("engine start") == 1 and f"{other}: weights loaded" in r.stdout
    assert r.stderr.count("Unknown vLLM environment variable") == 0
    model_dir, alone = tmp_path / "model", tmp_path / "alone"
    shutil.copytree(other, model_dir)
    run_eval(model_dir, *ARGS, "--out", alone)
    both = lines(out / "samples.jsonl")
    samples = lines(alone / "samples.jsonl")
    assert {s.pop("checkpoint") for s in samples} == {str(model_dir)}
    assert [{k: v for k, v in s.items() if k != "checkpoint"} for s in both if s["checkpoint"] == str(other)] == samples
    mine = [s for s in both if s["checkpoint"] == str(first)]
    assert len(mine) == len(samples) == 12
    # the swap happened: the other weights answer differently
    assert [s["response_ids"] for s in mine] != [s["response_ids"] for s in samples]

    shutil.copy(Path(first) / "model.safetensors", model_dir / "model.safetensors")  # new weights, same path
    r = subprocess.run(eval_cmd(model_dir, *ARGS, "--out", alone), cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=600)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and err[-1].startswith(f"error: --out {alone}: holds generations of {model_dir} under "
                                                    "other settings (weights)"), r.stderr[-2000:]
    r = subprocess.run(eval_cmd(model_dir, *ARGS, "--out", alone, "--overwrite"), cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=600)  # make demo's second run
    assert r.returncode == 0 and f"[setup] --overwrite: replacing journal, samples.jsonl, summary.json, summary.md " \
                                 f"in {alone}" in r.stderr, r.stderr[-2000:]
    assert [s["response_ids"] for s in lines(alone / "samples.jsonl")] == [s["response_ids"] for s in mine]


@pytest.mark.vllm
def test_a_killed_run_resumes_without_losing_or_repeating_a_sample(pair, tmp_path):
    first, other, ref, _ = pair
    out = tmp_path / "out"
    proc = subprocess.Popen(eval_cmd(first, other, *ARGS, "--out", out), cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    journals = out / "journal"
    deadline = time.time() + 300
    try:
        while time.time() < deadline:  # kill as soon as the first checkpoint has a few finished samples on disk
            written = [f for f in journals.glob("*.rank0.jsonl") if f.read_text().count("\n") >= 3]
            if written:
                break
            assert proc.poll() is None, "eval.py ended before it could be killed"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert written, "no samples on disk within 300 s"
    before = written[0].read_text().splitlines()
    assert 3 <= len(before) < 12 and not (out / "samples.jsonl").exists()
    with open(written[0], "a") as f:  # a kill in the middle of a write
        f.write('{"key": "abc", "ids": [1, 2')
    run_eval(first, other, *ARGS, "--out", out)
    assert (out / "samples.jsonl").read_text() == (ref / "samples.jsonl").read_text()
    after = written[0].read_text().splitlines()
    assert after[:len(before)] == before  # kept, never regenerated
    for f in journals.glob("*.jsonl"):
        keys = [json.loads(x)["key"] for x in f.read_text().splitlines()]
        assert len(keys) == len(set(keys)) == 12, f  # one line per sample, none twice
    # a rerun of a finished evaluation generates nothing and writes the same
    run_eval(first, other, *ARGS, "--out", out)
    assert written[0].read_text().splitlines() == after
    assert (out / "samples.jsonl").read_text() == (ref / "samples.jsonl").read_text()


@pytest.mark.vllm
def test_other_settings_in_the_same_out_die_in_one_line(pair, tmp_path):
    first, _, ref, _ = pair
    out = tmp_path / "out"
    shutil.copytree(ref, out)  # the pair's evaluation, first among its checkpoints
    r = subprocess.run(eval_cmd(first, *ARGS, "--temperature", "0.5", "--out", out), cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=600)
    err = r.stderr.strip().splitlines()  # before any engine starts
    assert r.returncode == 2 and len(err) == 1 and err[0].startswith(f"error: --out {out}: holds generations of "
                                                                     f"{first} under other settings"), r.stderr
    assert "temperature" in err[0]


def test_two_ranks_write_what_one_rank_writes(pair, torchrun, vllm_two_rank_env, tmp_path):
    """Without --out (the default names it by rank 0's clock; rank 1's reads another hour here), in the default
    dtype: identical samples where that is float32; in bf16 eval.py says what it promises instead (a near-tie can
    break otherwise in another batch), and every problem and prompt is the same."""
    from infra.system import choose_dtype

    first, other, fp32, _ = pair
    default = [a for a in ARGS if a not in ("--engine-dtype", "float32")]
    exact = choose_dtype("auto", engine="vllm")[0] == "float32"
    one = tmp_path / "one" if exact else fp32  # bf16: only the problems are compared, which no dtype changes
    if exact:
        run_eval(first, other, *default, "--out", one)
    env = {**vllm_two_rank_env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(ROOT / "tests" / "_clock_worker.py"), first, other, *default], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    outs = list((tmp_path / "runs").glob("eval-*"))
    assert len(outs) == 1, outs  # one --out for both ranks
    out = outs[0]
    two_s, one_s = lines(out / "samples.jsonl"), lines(one / "samples.jsonl")
    two, ref = (json.loads((d / "summary.json").read_text()) for d in (out, one))
    assert (two["ranks"], ref["ranks"]) == (2, 1)
    if exact:
        assert two_s == one_s and two["results"] == ref["results"]
    else:
        assert "a near-tie between two tokens can break otherwise than in one process" in r.stderr
        assert [(s["checkpoint"], s["id"], s["problem"]) for s in two_s] == \
            [(s["checkpoint"], s["id"], s["problem"]) for s in one_s]
    for stem in {f.name.rsplit(".rank", 1)[0] for f in (out / "journal").glob("*.jsonl")}:  # each rank its shard
        shards = [lines(out / "journal" / f"{stem}.rank{r}.jsonl") for r in (0, 1)]
        assert [len(x) for x in shards] == [6, 6]


def test_the_journal_index_holds_places_not_tokens(tmp_path):
    """A rank holds where each finished request's line is, not its tokens: 2 ranks' files of 2,000 requests x 4,000
    tokens (32k-token answers are the same per request), measured with tracemalloc."""
    import tracemalloc

    from eval_journal import Journal, request_key

    settings = {"weights": "x"}
    Journal(tmp_path, "ckpt", 0, settings).close()
    stem = next(tmp_path.glob("*.settings.json")).name.removesuffix(".settings.json")
    ids = list(range(1000, 5000))
    for rank in (0, 1):
        with open(tmp_path / f"{stem}.rank{rank}.jsonl", "w") as f:
            for i in range(rank, 2000, 2):
                f.write(json.dumps({"key": request_key([i], 4000, 0), "ids": ids, "stopped": False}) + "\n")
    tracemalloc.start()
    journal = Journal(tmp_path, "ckpt", 0, settings)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert len(journal.done) == 2000 and held < 2000 * 400, held  # under 400 bytes a request
    got = journal.get(request_key([7], 4000, 0))
    assert got.token_ids == ids and not got.stopped and journal.get("no such key") is None
    print(f"journal index: {held / 2000:.0f} bytes per request; the tokens as Python lists: about {36 * 4000} bytes")


def test_one_engine_over_two_ranks_writes_what_one_process_writes(pair, torchrun, vllm_two_rank_env, tmp_path):
    """--engine-tp 2: both ranks share one tensor-parallel engine, sample the problems together and each scores its
    own half; the second checkpoint reaches both halves of the engine through sync_weights. fp32: the same samples
    as one process with one whole engine, token for token."""
    first, other, one, _ = pair
    env = {**vllm_two_rank_env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
    out = tmp_path / "tp"
    r = torchrun("eval.py", first, other, *ARGS, "--engine-tp", "2", "--out", out, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert lines(out / "samples.jsonl") == lines(one / "samples.jsonl")
    assert json.loads((out / "summary.json").read_text())["ranks"] == 2
