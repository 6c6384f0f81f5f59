"""Resume never loses what a checkpoint saved, and never continues the wrong run: pruning (and a fallback past a
damaged checkpoint on 2 ranks: test_faults.py), OUT/latest in every form of --out, a same-numbered step_N, flags that
change the run's maths, links planted in OUT, paths in a checkpoint's metadata that lead outside it, a torn metrics
line, and eval.py on an export that lost or gained a file. Each fault is injected into real files (and real train.py
and eval.py runs)."""
import json
import os
import pickle
import shutil

import pytest
import torch
from conftest import CPU_ENV, run_script
from test_faults import args, metrics, names
from test_trust import actor_and_optimiser
from test_trust import trained as one_step  # noqa: F401 (a fixture: a one-step run)

from eval_journal import Journal
from infra import checkpoint, hf, weights
from infra.cli import write_atomic
from train_logs import make_logger, read_metrics

# ----------------------------------------------------------------------------- pruning, latest, a same-numbered step

def fake_checkpoints(out, steps, run_id="mine"):
    for step in steps:
        ckpt = out / f"step_{step:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text(json.dumps({"run_id": run_id, "step": step}))


def test_pruning_keeps_the_newest_known_complete_and_all_it_must(tmp_path):
    """--keep-last counts only checkpoints known complete (written or verified by this process), and never deletes the
    one just written, the one resumed from, the one latest names, a newer one, or another run's."""
    out = tmp_path / "out"
    fake_checkpoints(out, [1, 2, 4, 5])
    fake_checkpoints(out, [3], run_id="another run")
    (out / "latest").symlink_to("step_000001")
    # resumed from 2 (4 and 5 damaged: unknown), wrote 3: one complete checkpoint known, keep 2: nothing goes
    assert checkpoint.prune(out, 2, "mine", {2}, {2}) == []
    # the case: resumed from 2 past a damaged 4, wrote 3, --keep-last 1: 4 and 5 are newer, 2 resumed-from,
    # 1 is latest's (say a user pointed it back): nothing of them goes either
    assert checkpoint.prune(out, 1, "mine", {2, 3}, {3, 2}) == [] and names(out) == [
        "step_000001", "step_000002", "step_000003", "step_000004", "step_000005"]
    (out / "latest").unlink()
    (out / "latest").symlink_to("step_000005")
    assert checkpoint.prune(out, 1, "mine", {2, 5}, {5, None}) == [1, 2, 4]  # 3 is another run's
    assert names(out) == ["step_000003", "step_000005"]


def two_checkpoints(tiny_model_dir, out):
    with actor_and_optimiser(tiny_model_dir) as (actor, opt):
        for step in (1, 2):
            checkpoint.save_checkpoint(out, step, {"actor": (actor, opt)}, hf.load_tokenizer(tiny_model_dir),
                                       {"run_id": "mine"}, export=False)


def test_latest_is_honoured_whatever_form_out_has(tiny_model_dir, tmp_path, monkeypatch):
    """latest -> step 1 while a complete step 2 exists (a user rolled back): --resume takes step 1 with --out absolute,
    relative (the default runs/mutis is), or through a symbolic link to the directory."""
    out = tmp_path / "out"
    two_checkpoints(tiny_model_dir, out)
    (out / "latest").unlink()
    (out / "latest").symlink_to("step_000001")
    (tmp_path / "link").symlink_to(out, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    for given in (out, "out", "./out", "link", tmp_path / "link"):
        found = checkpoint.find_resumable(__import__("pathlib").Path(given), log=lambda line: None)
        assert found.name == "step_000001", given


def test_a_same_numbered_step_is_written_over_only_when_it_is_this_runs_and_damaged(tiny_model_dir, tmp_path,
                                                                                     capsys):
    out = tmp_path / "out"
    two_checkpoints(tiny_model_dir, out)
    before = checkpoint.manifest(out / "step_000002")
    with actor_and_optimiser(tiny_model_dir) as (actor, opt):
        save = lambda run_id: checkpoint.save_checkpoint(  # noqa: E731
            out, 2, {"actor": (actor, opt)}, hf.load_tokenizer(tiny_model_dir), {"run_id": run_id}, export=False)
        for run_id, why in (("mine", "is a complete checkpoint of this run"), ("another", "belongs to another run")):
            with pytest.raises(SystemExit):
                save(run_id)
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and why in err[0] and str(out / "step_000002") in err[0], err
        assert checkpoint.manifest(out / "step_000002") == before and not (out / "step_000002.tmp").exists()
        shard = next((out / "step_000002" / "sharded").glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 1]))
        save("mine")  # this run's, damaged: written again
    assert checkpoint.damage(out / "step_000002") is None


# ----------------------------------------------------------------------------- what a checkpoint's files may name

def test_paths_a_checkpoint_names_stay_inside_it(tiny_model_dir, tmp_path):
    """A manifest entry or a metadata file name that leads outside the checkpoint, a link, or a FIFO where a shard
    should be (reading it would hang every rank): each refused, nothing read through it."""
    out = tmp_path / "out"
    two_checkpoints(tiny_model_dir, out)
    ckpt = out / "step_000001"
    want = json.loads((ckpt / checkpoint.MANIFEST).read_text())
    secret = tmp_path / "secret"
    secret.write_text("not yours")

    def with_manifest(entries):
        (ckpt / checkpoint.MANIFEST).write_text(json.dumps(entries))
        return checkpoint.damage(ckpt)

    assert "outside the checkpoint" in with_manifest({**want, "../../secret": checkpoint.file_digest(secret)})
    (ckpt / "notes").symlink_to(secret)
    assert "it leads outside the checkpoint" in with_manifest({**want, "notes": checkpoint.file_digest(secret)})
    (ckpt / "notes").unlink()
    shard = next((ckpt / "sharded").glob("*.distcp"))
    saved = shard.read_bytes()
    shard.unlink()
    os.mkfifo(shard)
    assert f"{shard.name}, which is not a regular file" in with_manifest(want)
    shard.unlink()
    shard.write_bytes(saved)
    assert with_manifest(want) is None
    meta = ckpt / "sharded" / ".metadata"
    md = checkpoint.read_metadata(ckpt / "sharded")
    info = next(iter(md.storage_data.values()))
    original = info.relative_path
    for rel, why in (("../../../secret", "not a file of its own directory"), ("extra.distcp", "does not list")):
        for i in md.storage_data.values():
            if i.relative_path == original:
                i.relative_path = rel
        (ckpt / "sharded" / "extra.distcp").write_bytes(b"x")
        meta.write_bytes(pickle.dumps(md))
        assert why in (with_manifest({**want, "sharded/.metadata": checkpoint.file_digest(meta)}) or ""), rel
        for i in md.storage_data.values():
            if i.relative_path == rel:
                i.relative_path = original


# ----------------------------------------------------------------------------- links planted in OUT

def test_no_write_follows_a_link_planted_in_out(tmp_path, capsys):
    outside = tmp_path / "outside"
    outside.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    (out / "curves.png").symlink_to(outside)
    (out / f".curves.png.tmp{os.getpid()}").symlink_to(outside)  # at the very temp name this process writes first
    write_atomic(out / "curves.png", b"png")  # both links replaced, neither followed
    assert outside.read_text() == "keep me" and not (out / "curves.png").is_symlink()
    assert (out / "curves.png").read_bytes() == b"png" and not (out / f".curves.png.tmp{os.getpid()}").exists()
    (out / "metrics.jsonl").symlink_to(outside)
    log = make_logger(type("A", (), {"wandb": False, "tensorboard": False})(), out)
    with pytest.raises(SystemExit):
        log({"step": 1})
    assert "metrics.jsonl is a symbolic link: refusing to write through it" in capsys.readouterr().err
    (out / "journal").mkdir()
    (out / "journal" / "x.rank0.jsonl").symlink_to(outside)
    from eval_journal import slot

    (out / "journal" / f"{slot('x')}.rank0.jsonl").symlink_to(outside)
    with pytest.raises(SystemExit):
        Journal(out / "journal", "x", 0, {"a": 1})
    assert "is a symbolic link" in capsys.readouterr().err
    assert outside.read_text() == "keep me"


# ----------------------------------------------------------------------------- a torn metrics line, weight files

def test_a_torn_last_metrics_line_is_dropped_with_a_line(tmp_path):
    rows = [{"step": 1, "x": 1.0}, {"step": 2, "x": 2.0}]
    said = []
    for tail in (b'{"step": 3, "x": 3', b"\0" * 40, b""):
        (tmp_path / "metrics.jsonl").write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows) + tail)
        assert read_metrics(tmp_path, said.append) == rows
    assert len(said) == 2 and all("its last line" in s and "is torn" in s for s in said), said
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1}\n{"st\n{"step": 3}\n')
    with pytest.raises(SystemExit):
        read_metrics(tmp_path)


def test_weight_files_follow_the_index(tmp_path):
    from safetensors.torch import save_file

    d = tmp_path / "m"
    d.mkdir()
    save_file({"a": torch.zeros(1)}, d / "model-00001-of-00002.safetensors")
    save_file({"b": torch.zeros(1)}, d / "model-00002-of-00002.safetensors")
    (d / weights.INDEX).write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                               "b": "model-00002-of-00002.safetensors"}}))
    assert [p.name for p in weights.weight_files(d)] == ["model-00001-of-00002.safetensors",
                                                          "model-00002-of-00002.safetensors"]
    save_file({"a": torch.ones(1)}, d / "model.safetensors")  # a stale single file of an earlier save
    with pytest.raises(ValueError, match="model.safetensors is not in its model.safetensors.index.json"):
        weights.weight_files(d)
    (d / "model.safetensors").unlink()
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match="lists model-00002-of-00002.safetensors, which is missing"):
        weights.weight_files(d)
    (d / weights.INDEX).unlink()
    save_file({"b": torch.zeros(1)}, d / "other.safetensors")
    with pytest.raises(ValueError, match="2 \\*.safetensors files .* and no model.safetensors.index.json"):
        weights.weight_files(d)


def test_steps_may_change_unless_they_move_the_warm_up(tmp_path, capsys):
    import argparse
    from types import SimpleNamespace

    from train_setup import same_run

    flags = dict(steps=10, epochs=1, actor_warmup_ratio=0.0, critic_warmup_ratio=0.0, seed=0, out="a", allow_changed=[])
    run = SimpleNamespace(steps_per_epoch=100, world=1)
    said = []
    say = lambda line, flush=False: said.append(line)  # noqa: E731 (train.py's print on rank 0)
    same_run(tmp_path, {"args": flags}, argparse.Namespace(**{**flags, "steps": 20}), run, say)
    assert said == ["[resume] --steps 10 -> 20"]
    with pytest.raises(SystemExit):  # a warm-up of 0.2 of the steps: 2 steps, would become 4
        same_run(tmp_path, {"args": {**flags, "actor_warmup_ratio": 0.2}},
                 argparse.Namespace(**{**flags, "steps": 20, "actor_warmup_ratio": 0.2}), run, say)
    err = capsys.readouterr().err
    assert "--steps 10 (now 20: the warm-up, actor and critic, [2, 0] steps, would be [4, 0])" in err, err
    assert "--allow-changed steps" in err
    with pytest.raises(SystemExit):
        same_run(tmp_path, {"args": flags}, argparse.Namespace(**{**flags, "allow_changed": ["sede"]}), run, say)
    assert "--allow-changed sede: not a flag of train.py" in capsys.readouterr().err


# ----------------------------------------------------------------------------- train.py and eval.py

@pytest.mark.slow
def test_a_resume_with_other_maths_is_refused_and_other_running_is_said(one_step, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(one_step, out, symlinks=True)
    before = {p: p.stat().st_mtime for p in out.rglob("*") if p.is_file()}
    base = args(tiny_model_dir, out, "--adv", "grpo", "--resume", steps=2)
    changed = [*base, "--data", "arith_test", "--seed", "3"]
    proc = run_script("train.py", *changed, env=CPU_ENV, timeout=600)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len([e for e in err if e.startswith("error:")]) == 1, proc.stderr[-2000:]
    assert err[-1] == (f"error: --resume: {out / 'step_000001'} belongs to a run with other --data arith_train (now "
                       "arith_test); --seed 0 (now 3): give another --out for a new run, or continue this one with "
                       "them on purpose: --allow-changed data,seed"), err[-1]
    assert {p: p.stat().st_mtime for p in out.rglob("*") if p.is_file()} == before  # nothing touched
    with open(out / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 2, "reward/me')  # a node crashed while step 2's line was written
    proc = run_script("train.py", *changed, "--allow-changed", "data,seed", "--save-freq", "5", env=CPU_ENV,
                      timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stdout.splitlines() if line.startswith(("[resume] --", "[metrics]"))]
    assert said == ["[resume] --data arith_train -> arith_test (--allow-changed)", "[resume] --save-freq 0 -> 5",
                    "[resume] --seed 0 -> 3 (--allow-changed)", "[resume] --steps 1 -> 2",
                    f"[metrics] {out / 'metrics.jsonl'}: its last line (22 bytes) is torn (a crash while it was "
                    "written): dropped"], said  # each once
    assert [r["step"] for r in metrics(out)] == [1, 2]


@pytest.mark.slow
def test_eval_uses_an_export_only_as_its_manifest_says_it_was_written(one_step, tmp_path):
    def evaluate(ckpt):
        return run_script("eval.py", ckpt, "--engine", "hf", "--benchmarks", "arith_test", "--limit", "1",
                          "--max-response-tokens", "4", "--out", tmp_path / "eval", "--overwrite", env=CPU_ENV)

    ckpt = tmp_path / "step_000001"
    shutil.copytree(one_step / "step_000001", ckpt)
    exported = ckpt / "actor" / "model.safetensors"
    data = bytearray(exported.read_bytes())
    data[-1] ^= 1
    exported.write_bytes(bytes(data))
    for damage_it, needle in ((lambda: None, "actor/model.safetensors changed since it was written"),
                              (lambda: (shutil.copy(one_step / "step_000001" / "actor" / "model.safetensors", exported),
                                        shutil.copy(exported, ckpt / "actor" / "model-00001-of-00002.safetensors")),
                               "actor/model-00001-of-00002.safetensors is not in its manifest.json")):
        damage_it()
        proc = evaluate(ckpt)
        err = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and err[-1].startswith(f"error: checkpoint {ckpt}: ") and needle in err[-1], \
            proc.stderr[-2000:]
    (ckpt / "actor" / "model-00001-of-00002.safetensors").unlink()
    assert evaluate(ckpt).returncode == 0
    bare = tmp_path / "bare"  # a Hugging Face directory without a manifest: its index decides; a shard is missing
    shutil.copytree(ckpt / "actor", bare)
    (bare / "model.safetensors").rename(bare / "model-00001-of-00002.safetensors")
    (bare / weights.INDEX).write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                                  "b": "model-00002-of-00002.safetensors"}}))
    proc = evaluate(bare)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and err[-1] == (f"error: checkpoint {bare}: {bare}: model.safetensors.index.json lists "
                                                "model-00002-of-00002.safetensors, which is missing"), err[-3:]
