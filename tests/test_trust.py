"""No file of a checkpoint runs code on --resume: checkpoints crafted as an attacker would (through the real save
path, the manifest rewritten to match), each refused in one line with nothing run."""
import contextlib
import functools
import json
import os
import pickle
import shutil

import pytest
import torch
from conftest import CPU_ENV, run_script
from test_faults import args

from infra import checkpoint, collectives, hf, weights

pytestmark = pytest.mark.slow  # train.py runs


class Payload:
    """What a crafted pickle does when it is loaded: here, create a marker file."""
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """A one-step train.py run (GRPO: the actor alone) with its checkpoint."""
    out = tmp_path_factory.mktemp("trust") / "run"
    proc = run_script("train.py", *args(tiny_model_dir, out, "--adv", "grpo", steps=1), env=CPU_ENV, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def crafted_copy(trained, tmp_path, rewrite, verifies=True):
    """A copy of the run with rewrite(step_000001) applied and its manifest written again, as an attacker would."""
    out = tmp_path / "run"
    shutil.copytree(trained, out, symlinks=True)
    ckpt = out / "step_000001"
    rewrite(ckpt)
    (ckpt / checkpoint.MANIFEST).write_text(json.dumps(checkpoint.manifest(ckpt)))
    assert (checkpoint.damage(ckpt) is None) == verifies
    return out


def resume_refused(out, tiny_model_dir, marker, needle):
    proc = run_script("train.py", *args(tiny_model_dir, out, "--adv", "grpo", "--resume", steps=2), env=CPU_ENV,
                      timeout=600)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert err[-1].startswith("error: --resume: ") and needle in err[-1] and err[-1].endswith("not loading it"), err[-3:]
    assert not marker.exists()  # nothing ran
    assert "Traceback" not in proc.stderr


def dotted(marker):
    """Pickle protocol 4 resolves a dotted name as an attribute path: `os.system` inside a module that imports os."""
    cmd = f"touch {marker}".encode()
    part = lambda b: b"\x8c" + bytes([len(b)]) + b  # noqa: E731 (SHORT_BINUNICODE)
    return (b"\x80\x04" + part(b"torch.distributed.checkpoint.metadata") + part(b"os.system") + b"\x93"  # STACK_GLOBAL
            + part(cmd) + b"\x85R.")  # TUPLE1, REDUCE, STOP


def test_a_dotted_name_in_the_metadata_is_refused_unrun(trained, tiny_model_dir, tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(checkpoint.UnsafeCheckpoint):  # what the old allow-list let through (any name in that module)
        checkpoint._MetadataUnpickler(open(_write(tmp_path / "m", dotted(marker)), "rb")).load()
    out = crafted_copy(trained, tmp_path, lambda c: (c / "sharded" / ".metadata").write_bytes(dotted(marker)),
                       verifies=False)  # the verification reads the metadata (the files it names) with the same guard
    proc = run_script("train.py", *args(tiny_model_dir, out, "--adv", "grpo", "--resume", steps=2), env=CPU_ENV,
                      timeout=600)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and err[-1].startswith("error: --resume: no complete checkpoint"), err[-3:]
    assert "sharded/.metadata: torch.distributed.checkpoint.metadata.os.system is not part of" in proc.stdout
    assert not marker.exists() and "Traceback" not in proc.stderr
    assert pickle.loads(dotted(marker)) == 0 and marker.exists()  # the payload is real


def _write(path, data):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("module, name", [("builtins", "eval"), ("torch", "load"), ("os", "system"),
                                          ("torch", "serialization._get_layout"), ("pathlib", "Path"),
                                          ("torch.distributed.checkpoint.filesystem", "FileSystemReader")])
def test_only_exact_names_of_the_metadata_classes_unpickle(module, name, tmp_path):
    data = pickle.dumps(torch.zeros(0).dtype, protocol=2).replace(b"ctorch\nfloat32\n", f"c{module}\n{name}\n".encode())
    with pytest.raises(checkpoint.UnsafeCheckpoint, match="is not part of a checkpoint's metadata"):
        checkpoint._MetadataUnpickler(open(_write(tmp_path / "m", data), "rb")).load()


@contextlib.contextmanager
def actor_and_optimiser(model_dir):
    """The tiny actor, FSDP2-sharded on a one-rank group, and its AdamW with an LR schedule, as train.py builds them
    (GRPO)."""
    import torch.distributed as dist

    collectives.init_distributed()
    try:
        actor = weights.load_sharded(functools.partial(hf.load_causal_lm, model_dir), model_dir, torch.device("cpu"))
        opt = torch.optim.AdamW(actor.parameters(), lr=1e-4, foreach=True)
        torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)  # it adds initial_lr to the param groups
        yield actor, opt
    finally:
        dist.destroy_process_group()


def test_a_callable_in_an_optimiser_entry_is_refused_unrun(trained, tiny_model_dir, tmp_path):
    """torch's own load planner reads every non-tensor entry (an optimiser's learning rate, say) with
    torch.load(weights_only=False): a checkpoint saved by the real save path with a Payload as the learning rate
    ran it, and the resumed run went on with lr = 0 (os.system's return value)."""
    marker = tmp_path / "ran"

    def rewrite(ckpt):
        with actor_and_optimiser(tiny_model_dir) as (actor, opt):
            state = checkpoint.load_checkpoint(ckpt, {"actor": (actor, opt)})  # the real one loads, runs nothing
            opt.param_groups[0]["lr"] = Payload(marker)
            shutil.rmtree(ckpt)
            checkpoint.save_checkpoint(ckpt.parent, 1, {"actor": (actor, opt)}, hf.load_tokenizer(tiny_model_dir), state)
        assert not marker.exists()  # saving pickles the payload; it runs only when loaded
    out = crafted_copy(trained, tmp_path, rewrite)
    resume_refused(out, tiny_model_dir, marker, "entry actor.optim.param_groups.0.lr is not plain data")


def test_metadata_written_by_python_3_13_loads(trained, tiny_model_dir, tmp_path):
    """Python 3.13 pickles paths as pathlib._local.PosixPath (the metadata's checkpoint id): such a checkpoint
    resumes on every Python we admit."""
    ckpt = tmp_path / "step_000001"
    shutil.copytree(trained / "step_000001", ckpt)
    meta = ckpt / "sharded" / ".metadata"
    with open(meta, "rb") as f:
        data = pickle.dumps(checkpoint._MetadataUnpickler(f).load(), protocol=2)
    assert b"cpathlib\nPurePosixPath\n" in data
    meta.write_bytes(data.replace(b"cpathlib\nPurePosixPath\n", b"cpathlib._local\nPosixPath\n"))
    with actor_and_optimiser(tiny_model_dir) as (actor, opt):
        state = checkpoint.load_checkpoint(ckpt, {"actor": (actor, opt)})
        assert state["step"] == 1 and opt.param_groups[0]["lr"] == pytest.approx(1e-4)
        assert opt.state  # Adam's moments came back


def test_every_file_and_directory_is_fsynced_before_its_rename(tiny_model_dir, tmp_path, monkeypatch):
    """A node that crashes after the rename of step_N (or of latest) finds whole files: every file and directory of the
    checkpoint is fsynced first, OUT itself after; and the manifest's hashes, taken while the files were written,
    are those of the bytes on disk."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
                        or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("replace", str(a), str(b))) or real_replace(a, b))
    with actor_and_optimiser(tiny_model_dir) as (actor, opt):
        checkpoint.save_checkpoint(tmp_path, 1, {"actor": (actor, opt)}, hf.load_tokenizer(tiny_model_dir), {},
                                   export=True)
    final, tmp = tmp_path / "step_000001", str(tmp_path / "step_000001.tmp")
    rename = events.index(("replace", tmp, str(final)))
    synced = {path.removesuffix(".tmp") if path != tmp else path  # (torch writes .metadata as .metadata.tmp first)
              for kind, path, *_ in events[:rename] if kind == "fsync"}
    on_disk = [p for p in final.rglob("*")] + [final]
    assert all(str(p).replace(str(final), tmp) in synced for p in on_disk), \
        sorted(str(p) for p in on_disk if str(p).replace(str(final), tmp) not in synced)
    latest = events.index(("replace", str(tmp_path / "latest.tmp"), str(tmp_path / "latest")))
    assert ("fsync", str(tmp_path)) in events[latest:]  # the directory entry of latest, after its swap
    assert json.loads((final / checkpoint.MANIFEST).read_text()) == checkpoint.manifest(final)
