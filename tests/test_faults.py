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


def same_run(out, ref, step=3, atol=0.0, skip=()):
    got, want = metrics(out), metrics(ref)
    got = [{k: v for k, v in r.items() if k not in skip} for r in got]
    want = [{k: v for k, v in r.items() if k not in skip} for r in want]
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert g.keys() == w.keys(), (g["step"], g.keys() ^ w.keys())
        for k in w:  # (null: a NaN, e.g. the explained variance of constant returns)
            same = g[k] == w[k] if atol == 0 or not isinstance(w[k], float) else g[k] == pytest.approx(w[k], abs=atol)
            assert same, (g["step"], k, g[k], w[k])
    a, b = weights(out, step), weights(ref, step)
    for name in b:  # the export is bf16: float tolerance is a rounding flip of one unit in the last place
        torch.testing.assert_close(a[name], b[name], atol=1e-6 if atol else 0, rtol=2**-7 if atol else 0)


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


# ----------------------------------------------------------------------------- ranks that die, hang, or change count

def torchrun(script, *argv, nproc=2, restarts=0, timeout=600):
    """`torchrun --standalone --nproc_per_node N --max-restarts R SCRIPT ARGV` on the CPU -> (process, seconds)."""
    import subprocess
    import sys

    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           f"--max-restarts={restarts}", str(script), *map(str, argv)], cwd=ROOT, env=CPU_ENV,
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.time() - t0


@pytest.fixture(scope="module")
def two_ranks(tiny_model_dir, tmp_path_factory):
    """An uninterrupted 3-step run on 2 ranks, a checkpoint after every step -> (OUT, seconds)."""
    out = tmp_path_factory.mktemp("faults2") / "full"
    proc, took = torchrun(ROOT / "train.py", *args(tiny_model_dir, out, "--save-freq", "1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, took


@pytest.mark.dist
def test_a_killed_rank_restarts_the_group_from_the_last_checkpoint(two_ranks, tiny_model_dir, tmp_path):
    """Rank 1 is SIGKILLed in step 2's rollout; torchrun --max-restarts 1 restarts both ranks, which resume from
    step 1's checkpoint and end where the uninterrupted run ends."""
    out = tmp_path / "run"
    proc, took = torchrun(WORKER, "kill-rollout:2:1", *args(tiny_model_dir, out, "--save-freq", "1", "--resume",
                                                           "--shutdown-grace", "5"), restarts=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[resume] no checkpoint" in proc.stdout and "step_000001 at step 1" in proc.stdout  # attempt 1, then 2
    same_run(out, two_ranks[0], atol=1e-6)
    print(f"killed rank: {took:.0f}s with the restart, {two_ranks[1]:.0f}s uninterrupted")


ATTEMPT = """
import sys, parallel, torch.distributed as dist
parallel.init_distributed(timeout=10)
store = dist.distributed_c10d._get_default_store()
print("saw", store.check(["peer"]))  # the previous attempt's key, if this attempt could read it
store.set("peer", sys.argv[1])
parallel.close_distributed()
"""


def test_each_torchrun_restart_gets_its_own_keys_in_the_agents_store(tmp_path):
    """torchrun's agent serves one TCPStore to every restart of the group; gloo's and NCCL's bootstrap keys of a
    dead attempt (its peers' addresses) must not be read by the next one (parallel.attempt_store)."""
    import subprocess
    import sys

    server = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**CPU_ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port), "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    for attempt in range(2):
        proc = subprocess.run([sys.executable, "-c", ATTEMPT, f"attempt {attempt}"], cwd=ROOT, capture_output=True,
                              text=True, env={**env, "TORCHELASTIC_RESTART_COUNT": str(attempt)}, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "saw False" in proc.stdout  # attempt 1 does not see attempt 0's key
    keys = server.list_keys()  # the group's own (gloo's peer addresses) and the scripts' keys
    assert all(k.startswith(("attempt_0/", "attempt_1/")) for k in keys), keys
    peers = sorted(k for k in keys if k.endswith("/peer"))
    assert [server.get(k).decode() for k in peers] == ["attempt 0", "attempt 1"], peers


@pytest.mark.dist
def test_a_stalled_rank_is_named_and_the_group_exits(tiny_model_dir, tmp_path):
    proc, took = torchrun(WORKER, "stall-rollout:1:1", *args(tiny_model_dir, tmp_path / "run", "--dist-timeout", "10",
                                                            "--shutdown-grace", "5"))
    assert proc.returncode != 0
    assert "error: step 1, rollout: rank(s) 1 did not arrive within --dist-timeout (10s)" in proc.stderr, \
        proc.stderr[-3000:]
    assert took < 120, took  # not the 600 s stall


@pytest.mark.dist
def test_resume_on_another_world_size(two_ranks, tiny_model_dir, tmp_path):
    """2 ranks -> 1 -> 2: the checkpoint of step 2 (2 ranks) resumed on 1 rank for step 3, that one on 2 ranks for
    step 4, against the 2-rank run resumed from the same step 2 checkpoint."""
    def copy(src, name, keep):
        dst = tmp_path / name
        shutil.copytree(src, dst, symlinks=True)
        for ckpt in dst.glob("step_*"):
            if int(ckpt.name[5:]) > keep:
                shutil.rmtree(ckpt)
        (dst / "latest").unlink()
        (dst / "latest").symlink_to(f"step_{keep:06d}")
        return dst

    every = ("--resume", "--val-freq", "1")  # the 3-step run validates its last step: so does the 4-step one
    ref = copy(two_ranks[0], "ref", 2)
    proc, _ = torchrun(ROOT / "train.py", *args(tiny_model_dir, ref, *every, steps=4))
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = copy(two_ranks[0], "one", 2)
    proc = run_script("train.py", *args(tiny_model_dir, one, *every, steps=3), env=CPU_ENV, timeout=600)
    assert proc.returncode == 0 and "step_000002 at step 2" in proc.stdout, proc.stderr[-3000:]
    proc, _ = torchrun(ROOT / "train.py", *args(tiny_model_dir, one, *every, steps=4))
    assert proc.returncode == 0 and "step_000003 at step 3" in proc.stdout, proc.stderr[-3000:]
    # per-micro-batch diagnostics averaged over micro-batches (a variance ratio, a maximum) depend on how the rows
    # are cut into micro-batches, which the world size changes, and a clipped-token count moves by a token when the
    # summation order does; every other mean over tokens, and the weights, agree to float tolerance
    same_run(one, ref, step=4, atol=1e-4, skip=("critic/explained_var", "actor/ratio_max", "critic/vf_clipfrac",
                                                "actor/clipfrac", "actor/dual_clipfrac"))


# ----------------------------------------------------------------------------- no code in what we load

class Payload:
    """A pickle that runs code when loaded: what a checkpoint from someone else could hold."""
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_pickle_in_the_checkpoint_metadata_is_refused_unrun(tmp_path, capsys):
    import pickle

    import torch.distributed.checkpoint as dcp

    real = tmp_path / "real"
    dcp.save({"w": torch.zeros(3), "step": 4}, checkpoint_id=str(real))  # what torch writes is let through
    assert checkpoint.metadata_is_safe(real / ".metadata") is None
    ckpt, marker = tmp_path / "step_000001", tmp_path / "ran"
    (ckpt / "sharded").mkdir(parents=True)
    (ckpt / "sharded" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(SystemExit):
        checkpoint.load_checkpoint(ckpt, {})
    err = capsys.readouterr().err
    assert "posix.system is not part of a checkpoint's metadata" in err and err.count("\n") == 1, err
    assert not marker.exists()


def test_save_minutes_checkpoints_by_time(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    proc = run_script("train.py", *args(tiny_model_dir, out, "--save-minutes", "0.001", steps=2), env=CPU_ENV,
                      timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[ckpt] step 1 " in proc.stdout and sorted(p.name for p in out.glob("step_*")) == ["step_000001",
                                                                                                "step_000002"]
