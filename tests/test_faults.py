"""Faults injected into real train.py runs on the tiny model (transformers engine, CPU): SIGTERM at each point of a
step, a SIGKILLed and a stalled rank under torchrun, resuming on another number of ranks, damaged checkpoints,
a crafted pickle. Each interrupted run, resumed, must end where the uninterrupted run ends: the same metrics
(timings aside) and the same weights."""
import json
import os
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file

import checkpoint
from conftest import CPU_ENV, ROOT, run_script

pytestmark = pytest.mark.slow  # every test here starts train.py
WORKER = ROOT / "tests" / "_fault_worker.py"
TIMING = ("time/", "throughput/", "perf/", "system/")


def args(model, out, *extra, steps=3):
    # two micro-batches per mini-batch: a SIGTERM inside the first one can still abandon the step
    return ["--model", model, "--data", "arith_train", "--out", str(out), "--steps", str(steps), "--batch-size", "4",
            "--samples-per-prompt", "2", "--max-turns", "1", "--turn-tokens", "8", "--micro-batch-size", "2",
            "--mini-batch-size", "4", "--actor-lr", "1e-4", "--critic-lr", "1e-4", "--actor-warmup-ratio", "0",
            "--dtype", "float32", "--engine", "hf", "--val-data", "arith_test", "--val-limit", "2", "--val-freq", "2",
            "--shutdown-grace", "10", *extra]


def metrics(out):
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def weights(out, step):
    return load_file(out / f"step_{step:06d}" / "actor" / "model.safetensors")


def same_run(out, ref, step=3, atol=0.0):
    got, want = metrics(out), metrics(ref)
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert g.keys() == w.keys(), (g["step"], g.keys() ^ w.keys())
        for k in w:  # (null: a NaN, e.g. the explained variance of constant returns)
            same = g[k] == w[k] if atol == 0 or not isinstance(w[k], float) else g[k] == pytest.approx(w[k], abs=atol)
            assert same, (g["step"], k, g[k], w[k])
    a, b = weights(out, step), weights(ref, step)
    for name in b:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=atol)


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("faults") / "full"
    proc = run_script("train.py", *args(tiny_model_dir, out, "--save-freq", "1"), env=CPU_ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


# SIGTERM at each point of a step: (fault, the checkpoint it leaves, what the resumed run says first)
POINTS = [("term-rollout:2", 1, "at step 1"),                       # rollout cut at once: the state step 2 began from
          ("term-update:1:*:1", 0, "starting at step 0"),           # first update micro-batch: nothing to keep
          ("term-logprobs:3:*:2", 2, "at step 2"),                  # between no-grad micro-batches
          ("term-update:2:*:3", 2, "validation was cut short"),     # after the first optimiser step: step 2 finishes,
          ("term-validate:3", 3, "validation was cut short")]       # its validation pending; the last step's too


@pytest.mark.parametrize("fault, saved, resumed_says", POINTS, ids=[p[0] for p in POINTS])
def test_sigterm_checkpoints_within_the_grace_and_resumes_exactly(fault, saved, resumed_says, uninterrupted,
                                                                   tiny_model_dir, tmp_path):
    out, clock = tmp_path / "run", tmp_path / "signal_time"
    proc = run_script(WORKER, fault, *args(tiny_model_dir, out), env={**CPU_ENV, "FAULT_TIME_FILE": str(clock)},
                      timeout=600)
    took = time.time() - float(clock.read_text())
    assert proc.returncode == 143, proc.stderr[-3000:]
    said = f"checkpointed step {saved} " if saved else "nothing to checkpoint before step 1"
    assert said in proc.stdout and took < 10, (took, proc.stdout[-2000:])
    assert os.readlink(out / "latest") == f"step_{saved:06d}" if saved else not (out / "latest").exists()
    proc = run_script("train.py", *args(tiny_model_dir, out, "--resume"), env=CPU_ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert resumed_says in proc.stdout
    same_run(out, uninterrupted)


def test_damaged_latest_falls_back_to_the_newest_complete_checkpoint(uninterrupted, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out, symlinks=True)
    ckpt3 = out / "step_000003"
    shard = next((ckpt3 / "sharded").glob("*.distcp"))
    with open(shard, "r+b") as f:  # a full disk cut the file short
        f.truncate(shard.stat().st_size // 2)
    proc = run_script("train.py", *args(tiny_model_dir, out, "--resume"), env=CPU_ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if "damaged" in line)
    assert f"{ckpt3} is damaged (sharded/{shard.name} has" in line and "trying an older checkpoint" in line
    assert "[resume]" in proc.stdout and "step_000002 at step 2" in proc.stdout
    same_run(out, uninterrupted)
    for ckpt in out.glob("step_*"):  # none left: one line
        (ckpt / "trainer_state.json").write_text("{}")
    proc = run_script("train.py", *args(tiny_model_dir, out, "--resume"), env=CPU_ENV, timeout=600)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and err[-1].startswith("error: --resume: no complete checkpoint in"), err[-3:]


def test_checkpoint_verification_catches_each_kind_of_damage(tmp_path):
    ckpt = tmp_path / "step_000001"
    (ckpt / "sharded").mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    (ckpt / "sharded" / "__0_0.distcp").write_bytes(os.urandom(checkpoint.HASHED_BELOW + 10))  # size only
    assert checkpoint.damage(ckpt).startswith("no readable manifest.json")
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(checkpoint.manifest(ckpt)))
    assert checkpoint.damage(ckpt) is None
    (ckpt / "trainer_state.json").write_text("{ }")
    assert checkpoint.damage(ckpt) == "trainer_state.json has 3 bytes, 2 were written"
    (ckpt / "trainer_state.json").write_text("[]")
    assert checkpoint.damage(ckpt) == "trainer_state.json changed since it was written"
    (ckpt / "trainer_state.json").unlink()
    assert checkpoint.damage(ckpt) == "trainer_state.json is missing"


def test_rng_states_round_trip_as_json_without_pickle():
    import random

    import numpy as np

    state = json.loads(json.dumps(checkpoint.rng_states()))
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    random.random(), np.random.rand(), torch.rand(3)  # move every generator on
    checkpoint.set_rng_states(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want
