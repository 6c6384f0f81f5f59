"""The 8-GPU path on CPU: colocated engines that never lock step, uneven turns in the real trainer, --out on a
shared filesystem. Every test here starts 2 ranks under torchrun on gloo. With vLLM's CPU build they run
anywhere; with its CUDA build 2 ranks need 2 GPUs (vLLM cannot be forced onto the CPU there): the vLLM ones
are skipped otherwise (conftest.vllm_two_rank_env)."""
import json

import pytest
from conftest import ROOT, run_script

METRICS = ["reward/mean", "acc/mean", "decoded_tokens/mean", "turns/mean", "interventions/mean"]
VAL_METRICS = ["val/acc", "val/decoded_tokens", "val/turns"]


@pytest.fixture(scope="module")
def uneven_probe(tiny_model_dir, tmp_path_factory, vllm_two_rank_env, torchrun):
    """tests/_uneven_worker.py on 2 ranks: an engine built before the process group, then the trainer's order."""
    out = tmp_path_factory.mktemp("uneven")
    proc = torchrun(ROOT / "tests" / "_uneven_worker.py", tiny_model_dir, "before-pg,ours", out, env=vllm_two_rank_env,
                    timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return out


def test_ranks_make_different_numbers_of_generate_calls(uneven_probe):
    """Rank 0 calls generate once, rank 1 twice, then both meet at a barrier (with the old vLLM DP group
    over all ranks, rank 1's second call never returned)."""
    res = [json.loads((uneven_probe / f"ours.rank{r}.json").read_text()) for r in range(2)]
    assert [len(r["calls_s"]) for r in res] == [1, 2] and all("barrier_s" in r for r in res), res


def test_engine_before_process_group_fails_clearly(uneven_probe):
    """vLLM would call init_process_group(world_size=1, rank=RANK) itself: gloo's 'rank < size' on rank 1. Each rank
    catches its error and writes it (the worker goes on, and exits 0)."""
    for r in range(2):
        error = json.loads((uneven_probe / f"before-pg.rank{r}.json").read_text())["error"]
        assert "after torch.distributed.init_process_group" in error


SHARED_OUT_WORKER = """
import os, sys
from pathlib import Path
sys.path.insert(0, {root!r})
import torch, torch.distributed as dist
from infra import collectives
dist.init_process_group("gloo")
rank = dist.get_rank()
out = Path(sys.argv[1] if rank == 0 or len(sys.argv) == 2 else sys.argv[2])  # rank 1 may see another directory
out.mkdir(parents=True, exist_ok=True)
collectives.check_shared_out(out, rank, dist.get_world_size(), torch.device("cpu"))
print(f"rank {{rank}} ok", flush=True)
dist.destroy_process_group()
"""


def test_out_must_be_shared_by_all_ranks(tmp_path, torchrun):
    worker = tmp_path / "worker.py"
    worker.write_text(SHARED_OUT_WORKER.format(root=str(ROOT)))
    proc = torchrun(worker, tmp_path / "out", timeout=120)
    assert proc.returncode == 0 and "rank 0 ok" in proc.stdout and "rank 1 ok" in proc.stdout, proc.stderr[-3000:]
    assert not [p for p in (tmp_path / "out").iterdir()], "the token file was left behind"
    proc = torchrun(worker, tmp_path / "a", tmp_path / "b", timeout=120)
    assert proc.returncode != 0 and "ok" not in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: --out")]
    assert len(errors) == 2 and "shared" in errors[0], proc.stderr[-3000:]  # one line on every rank
    assert 'train.py", line' not in proc.stderr  # no traceback from the workers (torchrun prints its own)


def uneven_args(model_dir, out):
    return ["--model", model_dir, "--data", "arith_train", "--val-data", "arith_test", "--val-limit", "3",
            "--out", out, "--steps", "2", "--batch-size", "4", "--samples-per-prompt", "2", "--max-turns", "2",
            "--turn-tokens", "12", "--micro-batch-size", "4", "--mini-batch-size", "8", "--actor-lr", "1e-5",
            "--critic-lr", "1e-5", "--dtype", "float32", "--engine-dtype", "float32", "--enforce-eager",
            "--gpu-memory-utilization", "0.2", "--val-before-train", "--val-freq", "1",
            # ~46-token trajectories on rank 0 pack 4 into one micro-batch, ~148-token ones on rank 1 need 4: rank 0
            # must split to 4 forward/backward calls too, or FSDP hangs
            "--micro-batch-tokens", "200"]


def uneven_runs(torchrun, model_dir, tmp_path, env, nproc=2, extra=()):
    """tests/_uneven_train_worker.py on `nproc` ranks and on one -> the multi-rank run's metrics.jsonl rows, after
    checking that every logged rollout and validation metric equals the 1-rank run's. The script writes every
    completion, so the 1-rank reference takes the transformers engine: no vLLM start for the same trajectories."""
    worker = ROOT / "tests" / "_uneven_train_worker.py"
    many = torchrun(worker, *uneven_args(model_dir, tmp_path / "many"), *extra, env=env, nproc=nproc, timeout=600)
    assert many.returncode == 0, many.stdout[-3000:] + many.stderr[-5000:]
    one = run_script(worker, *uneven_args(model_dir, tmp_path / "one"), "--engine", "hf", env=env, timeout=600)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-5000:]
    rows = {k: [json.loads(line) for line in open(tmp_path / k / "metrics.jsonl")] for k in ("one", "many")}
    assert [r["step"] for r in rows["many"]] == [r["step"] for r in rows["one"]] == [0, 1, 2]
    for a, b in zip(rows["one"], rows["many"]):
        keys = (METRICS if a["step"] else []) + VAL_METRICS
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, (a["step"], a, b)
    return rows["many"]


@pytest.mark.timeout(1300)  # two runs of up to 600 s each
def test_uneven_turns_two_ranks_match_one_rank(tiny_model_dir, tmp_path, vllm_two_rank_env, torchrun):
    """The real train.py on 2 ranks, scripted so that every rank-0 trajectory answers in its first turn and every
    rank-1 trajectory takes all 3 turns (and validation shards of 2 and 1 prompts): it finishes, and every logged
    rollout and validation metric equals a 1-rank run over the same data (tests/_uneven_train_worker.py)."""
    env = vllm_two_rank_env
    rows = uneven_runs(torchrun, tiny_model_dir, tmp_path, env)
    # the script did what it says: half the trajectories answered in turn 1 (correctly), half took all 3 turns
    for r in rows[1:]:
        assert r["turns/mean"] == 2.0 and r["interventions/mean"] == 1.0 and r["reward/mean"] == 0.5, r
    # validation: 2 prompts on rank 0 (1 turn each), 1 on rank 1 (3 turns)
    assert rows[0]["val/turns"] == pytest.approx(5 / 3) and rows[0]["val/acc"] == pytest.approx(2 / 3)
    # rank 0 made one engine call per rollout (2 steps + 3 validations), rank 1 three
    calls = [json.loads((tmp_path / "many" / f"calls_rank{r}.json").read_text())["calls"] for r in range(2)]
    assert calls == [5, 15], calls


@pytest.mark.timeout(1300)  # two runs of up to 600 s each
def test_two_tensor_parallel_engines_on_four_ranks_with_uneven_turns(tiny_model_dir, tmp_path, vllm_two_rank_env,
                                                                     torchrun):
    """4 ranks with --engine-tp 2: two engines of two ranks each. The script answers at once on engine 0's prompts
    and takes every turn on engine 1's, so the two make 1 and 3 calls per rollout and validation, each pair of
    ranks in step. The run finishes, each rank trains on its own half of its engine's samples, and every logged
    rollout and validation metric equals a 1-rank run's with the same script (keyed on the prompt's engine)."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() and torch.cuda.device_count() < 4:
        pytest.skip("4 ranks with vLLM's CUDA build need 4 GPUs")
    env = {**vllm_two_rank_env, "SCRIPT_TP": "2", "SCRIPT_WORLD": "4"}
    rows = uneven_runs(torchrun, tiny_model_dir, tmp_path, env, nproc=4, extra=("--engine-tp", "2"))
    for r in rows[1:]:
        assert r["turns/mean"] == 2.0 and r["reward/mean"] == 0.5, r
    calls = [json.loads((tmp_path / "many" / f"calls_rank{r}.json").read_text())["calls"] for r in range(4)]
    assert calls == [5, 5, 15, 15], calls  # 2 rollouts + 3 validations: one call each on engine 0, three on engine 1
