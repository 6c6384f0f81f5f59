"""One vocabulary: the sampling and intervention flags mean the same in train.py, rollout.py and eval.py."""
import pytest

import eval as ev
import rollout
import train
from infra.cli import die

# every shared flag set away from its default
SHARED = ["--system-prompt", "train", "--samples-per-prompt", "3", "--max-turns", "2", "--turn-tokens", "7",
          "--max-response-tokens", "40", "--turn-rule", "paper", "--no-cut-at-answer", "--intervention-text", "paper",
          "--stop", "</answer>", "--temperature", "0.5", "--top-p", "0.9", "--seed", "5", "--max-prompt-length", "99",
          "--truncate-prompts", "--engine", "hf", "--engine-dtype", "float32", "--gpu-memory-utilization", "0.3",
          "--enforce-eager", "--attn-implementation", "eager", "--rollout-timeout", "9", "--verbose"]
CLIS = {"train": (train.parse_args, ["--data", "arith_train"]),
        "rollout": (rollout.parse_args, ["--data", "arith_train", "--out", "x.jsonl"]),
        "eval": (ev.parse_args, ["smollm2"])}


def shared_dests():
    return sorted({a.dest for a in rollout.sampling_flags()._actions if a.dest != "help"})


def test_every_cli_parses_the_shared_flags_alike():
    parsed = {name: vars(parse(own + SHARED)) for name, (parse, own) in CLIS.items()}
    for dest in shared_dests():
        values = {name: p[dest] for name, p in parsed.items()}
        assert len({repr(v) for v in values.values()}) == 1, (dest, values)
    assert parsed["train"]["samples_per_prompt"] == 3 and parsed["eval"]["cut_at_answer"] is False


def test_defaults_differ_only_where_the_job_does():
    defaults = {name: vars(parse(own)) for name, (parse, own) in CLIS.items()}
    differ = {d for d in shared_dests() if len({repr(p[d]) for p in defaults.values()}) > 1}
    # train: 8 samples, a prompt cap, room for training on the GPU; eval: greedy, single turn, 4096 tokens
    assert differ == {"samples_per_prompt", "max_prompt_length", "gpu_memory_utilization", "temperature",
                      "max_turns", "max_response_tokens", "system_prompt"}
    assert defaults["eval"]["temperature"] == 0.0 and defaults["eval"]["max_turns"] == 0
    assert defaults["train"]["turn_rule"] == defaults["eval"]["turn_rule"] == "reference"


@pytest.mark.parametrize("cli,flag", [("train", "--n"), ("train", "--max-response-length"), ("rollout", "--n"),
                                      ("rollout", "--dtype"), ("eval", "--n"), ("eval", "--max-tokens"),
                                      ("eval", "--intervention"), ("eval", "--dtype")])
def test_old_names_are_gone(cli, flag, capsys):
    parse, own = CLIS[cli]
    with pytest.raises(SystemExit) as e:
        parse(own + [flag, "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error:") and flag in err[0], err


@pytest.mark.parametrize("flags,needle", [(["--samples-per-prompt", "0"], "--samples-per-prompt"),
                                          (["--top-p", "0"], "--top-p"), (["--max-turns", "-1"], "--max-turns"),
                                          (["--intervention-text", " "], "--intervention-text"),
                                          (["--engine-dtype", "int8"], "--engine-dtype"),
                                          (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
                                          (["--engine-tp", "0"], "--engine-tp"),
                                          (["--engine", "hf", "--engine-tp", "2"], "--engine-tp")])
def test_one_check_for_every_cli(flags, needle, capsys):
    for parse, own in CLIS.values():
        with pytest.raises(SystemExit) as e:
            parse(own + flags)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and needle in err[0], err


@pytest.mark.parametrize("parse,argv,dest,value", [
    (train.parse_args, ["--data", "arith_train", "--test-freq", "3"], "val_freq", 3),
    (ev.parse_args, ["smollm2", "--batch-size", "5"], "max_in_flight", 5),
    (ev.parse_args, ["smollm2", "--engine-batch", "5"], "max_in_flight", 5)])
def test_renamed_flags_still_work_for_one_release(parse, argv, dest, value, capsys):
    assert getattr(parse(argv), dest) == value
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "deprecated" in err[0] and argv[-2] in err[0], err


@pytest.mark.parametrize("cli,flags", [("train", ["--steps", "0"]), ("train", ["--micro-batch-tokens", "x"]),
                                       ("rollout", ["--limit", "-1"]), ("eval", ["--engine-batch", "0"])])
def test_counts_are_positive_ints(cli, flags, capsys):
    parse, own = CLIS[cli]
    with pytest.raises(SystemExit) as e:
        parse(own + flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and flags[0] in err[0], err


def test_the_readmes_evaluation_example_is_what_make_demo_runs_last():
    """The README shows the table a user gets from its own example: make demo must run exactly that example."""
    import re
    import shlex

    from conftest import ROOT

    make = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    demo = shlex.split(re.search(r"^DEMO_EVAL_ARGS \?= (.*)$", make, re.M).group(1))
    readme = (ROOT / "README.md").read_text().replace("\\\n", " ")
    example = re.search(r"^python eval\.py (smollm2 runs/demo/step_000012 .*?)(?:#|$)", readme, re.M).group(1)
    assert shlex.split(example) == demo
    assert "$(PY) eval.py $(DEMO_EVAL_ARGS) --overwrite" in make.split("\ndemo:")[1].split("\n\n")[0]


def test_engine_tp_must_divide_the_heads_and_the_ranks(smollm2_dir, tiny_model_dir, capsys, monkeypatch):
    """One line naming what K must divide, with the K that would work; nothing else."""
    from infra import engines

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)  # one node (an in-process vLLM engine of an earlier test
    # sets it to its own tensor-parallel size)
    cases = [(smollm2_dir, 2, 2, "has 9 attention heads and 3 KV heads; K must divide both (1, 3)"),
             (tiny_model_dir, 4, 4, "has 2 attention heads and 2 KV heads; K must divide both (1, 2)"),
             (tiny_model_dir, 2, 3, "--engine-tp 2 must divide the number of ranks (3)")]
    for path, tp, world, needle in cases:
        with pytest.raises(SystemExit) as e:
            engines.check_tensor_parallel(path, tp, world)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and needle in err[0], err
    engines.check_tensor_parallel(tiny_model_dir, 2, 4)  # fits: no line, no exit
    assert capsys.readouterr().err == ""


def test_an_error_while_a_progress_bar_is_drawn_starts_a_line_of_its_own(capsys):
    """A tqdm bar redraws itself with \\r and has no newline yet: an error written after it must not read as the bar's
    tail (every rank's 'error:' line is found at a line start by users' greps and by these tests)."""
    from tqdm import tqdm

    bar = tqdm(total=4, desc="step 3 rollout")
    bar.update(1)
    with pytest.raises(SystemExit):
        die("bad input")
    bar.close()
    assert "error: bad input" in capsys.readouterr().err.splitlines()
