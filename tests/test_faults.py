"""Faults injected into real train.py runs on the tiny model (transformers engine, CPU): SIGTERM at each point of a
step, a SIGKILLed and a stalled rank under torchrun, resuming on another number of ranks, damaged checkpoints
(crafted ones: test_trust.py). Each interrupted run, resumed, must end where the uninterrupted run ends: the same metrics
(timings aside) and the same weights."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from conftest import CPU_ENV, ROOT, run_script
from safetensors.torch import load_file

from infra import checkpoint

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


def names(out):
    return sorted(p.name for p in out.glob("step_*"))


def weights(out, step):
    return load_file(out / f"step_{step:06d}" / "actor" / "model.safetensors")


# averaged per micro-batch (a variance ratio, a maximum, clipped-token counts): they move with how rows are cut into
# micro-batches, which a change of world size, or of which node's worker gets which rank, changes
MICRO_BATCH_DIAGNOSTICS = ("critic/explained_var", "actor/ratio_max", "critic/vf_clipfrac", "actor/clipfrac",
                           "actor/dual_clipfrac")


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
def uninterrupted_run(tiny_model_dir, tmp_path_factory):
    """The uninterrupted 3-step run -> (OUT, its process). A checkpoint after every step, by time: --save-minutes
    0.001 is over before each step is."""
    out = tmp_path_factory.mktemp("faults") / "full"
    proc = run_script("train.py", *args(tiny_model_dir, out, "--save-minutes", "0.001"), env=CPU_ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_run):
    return uninterrupted_run[0]


# SIGTERM at each point of a step: (fault, the checkpoint it leaves, what the resumed run says first). Each chain is one
# run stopped again and again: every resume but the last is itself stopped at the next point, then the last one must
# end where the uninterrupted run ends (a resume that lost or repeated anything would carry it to the end).
CHAINS = {"rollout-update-validate": [
              ("term-update:1:*:1", 0, "starting at step 0"),           # first update micro-batch: nothing to keep
              ("term-rollout:2", 1, "at step 1"),                        # rollout cut at once: the state step 2 began from
              ("term-update:2:*:3", 2, "validation was cut short"),      # after the first optimiser step: step 2
                                                                         # finishes, its validation pending
              ("term-validate:3", 3, "validation was cut short")],       # the last step's validation too
          "logprobs": [("term-logprobs:3:*:2", 2, "at step 2")]}        # between no-grad micro-batches


@pytest.mark.parametrize("chain", CHAINS)
def test_sigterm_checkpoints_within_the_grace_and_resumes_exactly(chain, uninterrupted, tiny_model_dir, tmp_path):
    out, clock, says = tmp_path / "run", tmp_path / "signal_time", None
    for fault, saved, resumed_says in CHAINS[chain]:
        resume = ("--resume",) if says else ()
        proc = run_script(WORKER, fault, *args(tiny_model_dir, out, *resume),
                          env={**CPU_ENV, "FAULT_TIME_FILE": str(clock)}, timeout=600)
        took = time.time() - float(clock.read_text())
        assert proc.returncode == 143, (fault, proc.stderr[-3000:])
        assert says is None or says in proc.stdout, (fault, says, proc.stdout[-2000:])  # the previous stop's resume
        said = f"checkpointed step {saved} " if saved else "nothing to checkpoint before step 1"
        assert said in proc.stdout and took < 10, (fault, took, proc.stdout[-2000:])
        assert os.readlink(out / "latest") == f"step_{saved:06d}" if saved else not (out / "latest").exists()
        says = resumed_says
    proc = run_script("train.py", *args(tiny_model_dir, out, "--resume"), env=CPU_ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert says in proc.stdout
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
    assert "nothing was deleted" in err[-1] and "another --out" in err[-1]
    assert sorted(p.name for p in out.glob("step_*")) == ["step_000001", "step_000002", "step_000003"]


def test_nothing_of_another_run_is_deleted(uninterrupted, tiny_model_dir, tmp_path):
    """A fresh run refuses an --out that holds another run (before anything is written); --keep-last prunes the
    resumed run's own checkpoints only, never the one it resumed from; a checkpoint from before manifests resumes,
    with a line saying so."""
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out, symlinks=True)
    before = {p: p.stat().st_mtime for p in out.rglob("*") if p.is_file()}
    proc = run_script("train.py", *args(tiny_model_dir, out), env=CPU_ENV, timeout=600)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and err[-1] == (f"error: --out {out} holds an earlier run (step_000001, step_000002, "
                                                 "step_000003): --resume continues it, --overwrite replaces it, or give "
                                                 "another --out"), err[-3:]
    assert {p: p.stat().st_mtime for p in out.rglob("*") if p.is_file()} == before  # untouched
    # step 1 is another run's, step 2 this run's from before manifests: resume it, keep only the newest 1 of its own
    other = out / "step_000001"
    state = json.loads((other / "trainer_state.json").read_text())
    (other / "trainer_state.json").write_text(json.dumps({**state, "run_id": "someone else"}))
    (other / checkpoint.MANIFEST).write_text(json.dumps(checkpoint.manifest(other)))
    (out / "step_000002" / checkpoint.MANIFEST).unlink()
    shutil.rmtree(out / "step_000003")
    (out / "latest").unlink()
    (out / "latest").symlink_to("step_000002")
    proc = run_script("train.py", *args(tiny_model_dir, out, "--resume", "--keep-last", "1"), env=CPU_ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"[resume] {out / 'step_000002'} has no manifest.json (written before checkpoints had one): loading it " \
           "unverified" in proc.stdout
    assert sorted(p.name for p in out.glob("step_*")) == ["step_000001", "step_000002", "step_000003"]
    same_run(out, uninterrupted)
    proc = run_script("train.py", *args(tiny_model_dir, out, "--resume", "--keep-last", "1", steps=4), env=CPU_ENV,
                      timeout=600)  # the next attempt: step 2 is no longer the one it resumed from
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in out.glob("step_*")) == ["step_000001", "step_000003", "step_000004"]
    proc = run_script("train.py", *args(tiny_model_dir, out, "--overwrite", steps=1), env=CPU_ENV, timeout=600)
    assert proc.returncode == 0 and f"[setup] --overwrite: replacing the earlier run in {out} (step_000001, " \
           "step_000003, step_000004)" in proc.stdout, proc.stderr[-3000:]
    assert sorted(p.name for p in out.glob("step_*")) == ["step_000001"] and len(metrics(out)) == 1


def test_checkpoint_verification_catches_each_kind_of_damage(tmp_path):
    ckpt = tmp_path / "step_000001"
    (ckpt / "sharded").mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    shard = ckpt / "sharded" / "__0_0.distcp"
    shard.write_bytes(os.urandom(20 * 2**20))  # large files are hashed too
    assert checkpoint.damage(ckpt).startswith("no readable manifest.json")
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(checkpoint.manifest(ckpt)))
    assert checkpoint.damage(ckpt) is None
    assert [checkpoint.damage(ckpt, r, 2) for r in (0, 1)] == [None, None]  # each rank its share
    with open(shard, "r+b") as f:  # what a node crash can leave: the right size, zeros where a page never arrived
        f.seek(12 * 2**20)
        f.write(bytes(4096))
    assert checkpoint.damage(ckpt) == "sharded/__0_0.distcp changed since it was written"
    files = sorted(json.loads((ckpt / checkpoint.MANIFEST).read_text()))
    owner = files.index("sharded/__0_0.distcp") % 2  # the rank whose share holds the shard finds it
    assert checkpoint.damage(ckpt, owner, 2) is not None and checkpoint.damage(ckpt, 1 - owner, 2) is None
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(checkpoint.manifest(ckpt)))
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

def torchrun(script, *argv, nproc=2, restarts=0, timeout=600, cwd=ROOT):
    """`torchrun --standalone --nproc_per_node N --max-restarts R SCRIPT ARGV` on the CPU, from cwd -> (process,
    seconds)."""
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           f"--max-restarts={restarts}", str(script), *map(str, argv)], cwd=cwd, env=CPU_ENV,
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
import sys, torch.distributed as dist
from infra import collectives
rank = collectives.init_distributed(timeout=float(sys.argv[2]))[0]
store = dist.distributed_c10d._get_default_store()
print("saw", store.check([f"peer/{rank}"]))  # an earlier attempt's key of this rank, if this attempt could read it
store.set(f"peer/{rank}", sys.argv[1])
collectives.close_distributed()
"""


def test_each_attempt_of_the_group_gets_its_own_keys_whatever_each_agent_counted(tmp_path):
    """torchrun's agent serves one TCPStore to every restart of the group; gloo's and NCCL's bootstrap keys of a dead
    attempt (its peers' addresses) must not be read by the next one, and the ranks of one attempt must meet under
    one prefix even when their nodes' agents counted restarts differently (collectives.agree_on_attempt): here an
    attempt where rank 0 never started (its ack keys stay behind), then one whose node agents say 2 and 0."""
    server = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**CPU_ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port), "WORLD_SIZE": "2",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}

    def attempt(counts, label, timeout=60):  # {rank: this rank's agent's TORCHELASTIC_RESTART_COUNT}
        procs = {r: subprocess.Popen([sys.executable, "-c", ATTEMPT, f"{label} rank {r}", str(timeout)], cwd=ROOT,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**env, "RANK": str(r), "LOCAL_RANK": "0",
                                          "TORCHELASTIC_RESTART_COUNT": str(n)}) for r, n in counts.items()}
        return {r: (p.wait(timeout=120), *p.communicate()) for r, p in procs.items()}

    for r, (code, out, err) in attempt({0: 0, 1: 0}, "first").items():
        assert code == 0 and "saw False" in out, err[-2000:]
    (code, _, _), = attempt({1: 1}, "alone", timeout=5).values()  # rank 0's worker died before it started
    assert code != 0
    for r, (code, out, err) in attempt({0: 2, 1: 0}, "third").items():
        assert code == 0 and "saw False" in out, err[-2000:]  # they met, and saw nothing of the earlier attempts
    keys = server.list_keys()
    assert all(k.startswith(("mutis/", "attempt_1/", "attempt_2/")) for k in keys), keys
    peers = sorted(k for k in keys if "/peer/" in k)
    assert [server.get(k).decode()[:5] for k in peers] == ["first", "first", "third", "third"], peers


@pytest.mark.dist
def test_two_nodes_one_worker_dies_the_other_hangs(two_ranks, tiny_model_dir, tmp_path):
    """Two torchrun agents as two nodes: node 0's worker is SIGKILLed in step 2's rollout while node 1's hangs there
    (as NCCL peers of a dead rank do). Agent 0 counts a restart; agent 1 restarts its hung worker through the
    membership change, which it does not count: the next attempt's workers carry restart counts 1 and 0, and still
    meet, resume from step 1 and end where the uninterrupted run ends. Each node runs one rank, which would take both
    cores (system.trainer_threads): --cpu-threads 1 gives each rank the one thread a rank of the 2-rank reference has.
    Another thread count splits every matmul's sums otherwise (the step-1 log-prob gap already differs) and training
    amplifies the rounding: on an AMX CPU one weight ended two bf16 units off. With equal threads the runs are
    equal to the bit, wherever they run."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out, once = tmp_path / "run", tmp_path / "once"
    once.mkdir()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two",
                               "--max-restarts", "1", "--monitor-interval", "1", str(WORKER), fault,
                               *args(tiny_model_dir, out, "--save-freq", "1", "--resume", "--shutdown-grace", "5",
                                    "--cpu-threads", "1")],
                              cwd=ROOT, env={**CPU_ENV, "FAULT_ONCE_DIR": str(once)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for fault in ("kill-rollout:2", "stall-rollout:2")]
    results = [(p.wait(timeout=600), *p.communicate()) for p in nodes]
    for code, _, err in results:
        assert code == 0, err[-3000:]
    counts = sorted(line.split()[-1] for _, _, err in results for line in err.splitlines()
                    if line.startswith("[fault-worker]"))
    assert counts == ["0", "0", "0", "1"], counts  # the second attempt's workers: 1 on node 0, 0 on node 1
    assert any("step_000001 at step 1" in o for _, o, _ in results)
    same_run(out, two_ranks[0])  # whichever node's worker got which rank


@pytest.mark.dist
def test_a_stalled_rank_is_named_and_the_group_exits(tiny_model_dir, tmp_path):
    proc, took = torchrun(WORKER, "stall-rollout:1:1", *args(tiny_model_dir, tmp_path / "run", "--dist-timeout", "10",
                                                            "--shutdown-grace", "5"))
    assert proc.returncode != 0
    assert "error: step 1, rollout: rank(s) 1 did not arrive within --dist-timeout (10s)" in proc.stderr, \
        proc.stderr[-3000:]
    assert took < 120, took  # not the 600 s stall


def copy_run(src, dst, keep):
    """A copy of the run in src at dst as it stood after step `keep`: later checkpoints removed, latest names it."""
    shutil.copytree(src, dst, symlinks=True)
    for ckpt in dst.glob("step_*"):
        if int(ckpt.name[5:]) > keep:
            shutil.rmtree(ckpt)
    (dst / "latest").unlink()
    (dst / "latest").symlink_to(f"step_{keep:06d}")
    return dst


@pytest.fixture(scope="module")
def four_steps(two_ranks, tiny_model_dir, tmp_path_factory):
    """The 2-rank run resumed from step 2 to step 4, validating steps 3 and 4 (the 3-step run validates its last
    step; so does this one), a checkpoint after every step -> OUT."""
    out = copy_run(two_ranks[0], tmp_path_factory.mktemp("faults4") / "run", 2)
    proc, _ = torchrun(ROOT / "train.py", *args(tiny_model_dir, out, "--save-freq", "1", "--resume",
                                                "--val-freq", "1", steps=4))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.dist
def test_resume_on_another_world_size(four_steps, two_ranks, tiny_model_dir, tmp_path):
    """2 ranks -> 1 -> 2: the checkpoint of step 2 (2 ranks) resumed on 1 rank for step 3, that one on 2 ranks for
    step 4, against the 2-rank run resumed from the same step 2 checkpoint."""
    every = ("--resume", "--val-freq", "1")  # as four_steps
    one = copy_run(two_ranks[0], tmp_path / "one", 2)
    proc = run_script("train.py", *args(tiny_model_dir, one, *every, "--cpu-threads", "1", steps=3), env=CPU_ENV,
                      timeout=600)  # the reference's thread a rank: the world size is the one difference
    assert proc.returncode == 0 and "step_000002 at step 2" in proc.stdout, proc.stderr[-3000:]
    proc, _ = torchrun(ROOT / "train.py", *args(tiny_model_dir, one, *every, steps=4))
    assert proc.returncode == 0 and "step_000003 at step 3" in proc.stdout, proc.stderr[-3000:]
    # every mean over tokens, and the weights, agree to float tolerance (a clipped-token count moves by a token when
    # the summation order does)
    same_run(one, four_steps, step=4, atol=1e-4, skip=MICRO_BATCH_DIAGNOSTICS)


@pytest.mark.dist
def test_a_fallback_past_a_damaged_checkpoint_loses_nothing_and_ends_where_the_run_would(four_steps, tiny_model_dir,
                                                                                          tmp_path):
    """On 2 ranks, --out relative: checkpoints of steps 2 and 4 (as a checkpoint every 2 steps leaves them); a byte of
    step 4's shard flipped; resumed to step 3 with a checkpoint every step and --keep-last 1, it falls back to step 2,
    keeps it (resumed from), keeps the damaged step 4 (newer than what it keeps) and latest names step 3; resumed
    again to step 4, it writes step 4 over the damaged one (this run's) and ends where four_steps ended."""
    def resume_to(steps):  # from tmp_path: --out "run", relative
        proc, _ = torchrun(ROOT / "train.py", *args(tiny_model_dir, "run", "--save-freq", "1", "--keep-last", "1",
                                                    "--resume", "--val-freq", "1", steps=steps), cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        return proc

    out = tmp_path / "run"
    shutil.copytree(four_steps, out, symlinks=True)
    for step in (1, 3):
        shutil.rmtree(out / f"step_{step:06d}")
    shard = next((out / "step_000004" / "sharded").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    proc = resume_to(3)
    assert "step_000004 is damaged" in proc.stdout and "step_000002 at step 2" in proc.stdout
    assert names(out) == ["step_000002", "step_000003", "step_000004"] and os.readlink(out / "latest") == "step_000003"
    assert checkpoint.damage(out / "step_000003") is None
    proc = resume_to(4)
    assert "step_000003 at step 3" in proc.stdout
    assert names(out) == ["step_000003", "step_000004"] and checkpoint.damage(out / "step_000004") is None
    same_run(out, four_steps, step=4, atol=1e-6)


def test_save_minutes_checkpoints_by_time(uninterrupted_run):
    out, proc = uninterrupted_run
    assert "[ckpt] step 1 " in proc.stdout and sorted(p.name for p in out.glob("step_*")) == ["step_000001",
                                                                                                "step_000002",
                                                                                                "step_000003"]


# ----------------------------------------------------------------------------- SIGTERM on every rank, as torchrun sends it

# (fault, the checkpoint it leaves, written by the SIGTERM): the agent gets the signal (as from SLURM) and passes it
# to both ranks at once. Chained as the one-process points are: each resume but the last stopped at the next point.
AGENT_CHAINS = {"rollout-update-validate": [
                    ("agent-rollout:2:1", 1, False),        # rollout: every rank stops at its engine's next step;
                                                            # step 1's checkpoint (--save-freq 1) is already there
                    ("agent-update:2:0:2", 2, True),        # after the first optimiser step: both finish step 2, keep it
                    ("agent-validate-late:3:0", 3, True)],  # rank 1 has finished its validation shard, waits for rank 0
                "logprobs": [("agent-logprobs:3:0:2", 2, False)]}  # between no-grad micro-batches: both drop step 3


@pytest.mark.dist
@pytest.mark.parametrize("chain", AGENT_CHAINS)
def test_sigterm_on_every_rank_checkpoints_and_resumes_exactly(chain, two_ranks, tiny_model_dir, tmp_path):
    """With the old code rank 1 waited inside validation's closing all-reduce, where its handler could not run, while
    rank 0 was cut out of it: no checkpoint, the watchdog's exit after the grace."""
    out, resume = tmp_path / "run", ()
    for fault, saved, written in AGENT_CHAINS[chain]:
        proc, took = torchrun(WORKER, fault, *args(tiny_model_dir, out, "--save-freq", "1", *resume))
        assert f"checkpointed step {saved} " in proc.stdout, (fault, proc.stdout[-2000:], proc.stderr[-3000:])
        assert proc.returncode != 0 and "got signal: 15" in proc.stderr  # torchrun's agent, stopped by the signal
        assert "no checkpoint within --shutdown-grace" not in proc.stderr and took < 100, (fault, took)
        assert os.readlink(out / "latest") == f"step_{saved:06d}"
        assert (out / "latest" / "actor").exists() is not written  # the SIGTERM's own: what --resume needs, no export
        resume = ("--resume",)
    proc, _ = torchrun(ROOT / "train.py", *args(tiny_model_dir, out, "--save-freq", "1", "--resume"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    same_run(out, two_ranks[0], atol=1e-6)
    assert (out / "latest" / "actor" / "config.json").exists()


def test_the_slurm_script_parses():
    """slurm/train.sbatch: bash syntax, its torchrun line through torchrun's parser and its train.py flags through
    train.py's (the script's variables filled in), with --resume, under SLURM's 30 s between SIGTERM and SIGKILL."""
    import re
    import shlex

    from torch.distributed.run import get_args_parser

    import train

    script = (ROOT / "slurm" / "train.sbatch").read_text()
    assert subprocess.run(["bash", "-n", str(ROOT / "slurm" / "train.sbatch")]).returncode == 0
    assert "#SBATCH --requeue" in script and re.search(r"#SBATCH --signal=B:TERM@\d+", script)
    line = re.search(r"^srun .*?&$", script.replace("\\\n", " "), re.M | re.S).group(0)
    words = shlex.split(line.rstrip("&").replace('"$SLURM_NNODES"', "2").replace('"$head:29500"', "node1:29500")
                        .replace('"$SLURM_JOB_ID"', "42").replace('"$MODEL"', "/models/m").replace('"$OUT"', "runs/x"))
    torchrun = words[words.index("torchrun") + 1:words.index("train.py")]
    t = get_args_parser().parse_args([*torchrun, "train.py"])
    assert (t.nnodes, t.nproc_per_node, t.rdzv_backend, t.max_restarts) == ("2", "8", "c10d", 3)
    a = train.parse_args(words[words.index("train.py") + 1:])
    assert a.resume and a.out == "runs/x" and a.model == "/models/m" and a.shutdown_grace < 30 and a.save_minutes
