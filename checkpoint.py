"""Training checkpoints: written atomically, verified before they are trusted, free of pickle where we read them, and
loadable on another number of ranks.

    OUT/step_N/actor/, critic/      the HF export (safetensors: safe to share)
    OUT/step_N/sharded/             each model's and optimiser's FSDP2 state (torch.distributed.checkpoint)
    OUT/step_N/rng_rankR.json       each rank's Python, NumPy and torch RNG states
    OUT/step_N/trainer_state.json   step, schedulers, KL controller, arguments (and a pending validation)
    OUT/step_N/manifest.json        every file's size (and SHA-256 below 16 MiB), written last
    OUT/latest -> step_N            the newest complete checkpoint

Another world size: the sharded state is resharded by torch.distributed.checkpoint on load; trainer_state is
global; the RNG states are per rank, and rank r takes rank r's, or rank (r mod old world size)'s when the old run
had fewer ranks. No step depends on them (sampling seeds come from (seed, step, prompt, sample, turn), the update's
shuffling from its own generator), so resuming on another world size changes only how rows are cut into
micro-batches: the same run within float tolerance.
No pickle runs code: torch.distributed.checkpoint reads its own `sharded/.metadata` with pickle (its
FileSystemReader), so load_checkpoint first unpickles that file with an allow-list of the classes it holds
(metadata_is_safe) and refuses anything else. Everything else is JSON or safetensors.
"""
import hashlib
import json
import os
import pickle
import random
import shutil
from pathlib import Path

import numpy as np
import torch

import parallel
from cli import die

MANIFEST = "manifest.json"
HASHED_BELOW = 16 * 2**20  # files hashed in the manifest (metadata, states, configs); larger ones by size only


def save_checkpoint(out, step, models, tokenizer, trainer_state, keep_last=None, rng=None):
    """OUT/step_N (the module docstring's layout). Written to step_N.tmp and renamed, then OUT/latest points at it:
    latest always names a complete checkpoint. models: {"actor": (model, optimiser), "critic": ...}. rng: this
    rank's RNG states to record (rng_states(); default: now). Every rank calls it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    import torch.distributed.checkpoint as dcp

    out, rank = Path(out), parallel._rank()
    final, tmp = out / f"step_{step:06d}", out / f"step_{step:06d}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    parallel.barrier()
    try:
        parallel.save_hf(models["actor"][0], tokenizer, tmp / "actor")
        if "critic" in models:
            parallel.save_critic(models["critic"][0], tmp / "critic")
        sharded = {name: dict(zip(("model", "optim"), get_state_dict(m, o))) for name, (m, o) in models.items()}
        # one file per writer thread: serialising and writing ~12 bytes per parameter is most of a preemption's grace
        writer = dcp.FileSystemWriter(str(tmp / "sharded"), thread_count=min(8, torch.get_num_threads()))
        dcp.save(sharded, storage_writer=writer)
        (tmp / f"rng_rank{rank}.json").write_text(json.dumps(rng or rng_states()))
    except (OSError, RuntimeError):
        disk_full_error(out, step, tmp)
        raise
    parallel.barrier()
    if rank == 0:
        (tmp / "trainer_state.json").write_text(json.dumps(dict(trainer_state, step=step), indent=1))
        (tmp / MANIFEST).write_text(json.dumps(manifest(tmp), indent=0))
        shutil.rmtree(final, ignore_errors=True)  # a damaged one, written again (os.replace keeps no full directory)
        os.replace(tmp, final)
        link = out / "latest.tmp"
        link.unlink(missing_ok=True)
        link.symlink_to(final.name)
        os.replace(link, out / "latest")
        if keep_last:
            for old in sorted(out.glob("step_[0-9]*[0-9]"))[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    parallel.barrier()
    return final


def disk_full_error(out, step, tmp, spare=64 * 2**20):
    """A checkpoint write failed: when the disk under OUT is (nearly) full, remove the partial step_N.tmp and die
    with one line instead of the writer's traceback (torch's is "unexpected pos"); otherwise return."""
    free = shutil.disk_usage(out).free
    if free >= spare:
        return
    shutil.rmtree(tmp, ignore_errors=True)
    die(f"--out {out}: the disk filled up while writing checkpoint step {step} ({free / 2**20:.1f} MiB were left); "
        f"free space there, write to a larger disk, or keep fewer checkpoints with --keep-last")


# ----------------------------------------------------------------------------- RNG states as JSON

def rng_states():
    """This process's Python, NumPy and torch RNG states as JSON-able values (no pickle)."""
    version, state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(state), gauss], "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
            "torch": torch.get_rng_state().tolist()}


def set_rng_states(s):
    version, state, gauss = s["python"]
    random.setstate((version, tuple(state), gauss))
    kind, keys, pos, has_gauss, cached = s["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(s["torch"], dtype=torch.uint8))


# ----------------------------------------------------------------------------- verification

def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            h.update(block)
    return h.hexdigest()


def manifest(ckpt):
    """{relative path: [size, sha256 or None]} of every file of a checkpoint directory."""
    files = sorted(p for p in Path(ckpt).rglob("*") if p.is_file() and p.name != MANIFEST)
    return {str(p.relative_to(ckpt)): [p.stat().st_size, _sha256(p) if p.stat().st_size < HASHED_BELOW else None]
            for p in files}


def damage(ckpt):
    """Why the checkpoint directory cannot be trusted (a file missing, truncated, changed; no manifest), or None."""
    ckpt = Path(ckpt)
    try:
        want = json.loads((ckpt / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"no readable {MANIFEST} (incomplete, or written by an older version)"
    for rel, (size, digest) in want.items():
        path = ckpt / rel
        if not path.is_file():
            return f"{rel} is missing"
        if path.stat().st_size != size:
            return f"{rel} has {path.stat().st_size} bytes, {size} were written"
        if digest is not None and _sha256(path) != digest:
            return f"{rel} changed since it was written"
    return None


def find_resumable(out, log=print):
    """The checkpoint --resume continues from: OUT/latest when it verifies, else the newest step_N that does (each
    one skipped is one line through `log`); None when OUT has none at all. Checkpoints exist but none verifies:
    one line, exit 2."""
    out = Path(out)
    latest = (out / "latest").resolve() if (out / "latest").exists() else None
    candidates = sorted(out.glob("step_[0-9]*[0-9]"), reverse=True)
    if latest is not None and latest in candidates:
        candidates.remove(latest)
        candidates.insert(0, latest)
    if not candidates:
        return None
    for ckpt in candidates:
        why = damage(ckpt)
        if why is None:
            return ckpt
        log(f"[resume] {ckpt} is damaged ({why}): trying an older checkpoint")
    die(f"--resume: no complete checkpoint in {out} (every step_N failed its {MANIFEST} check); "
        f"start again without --resume, or with another --out")


class _AllowList(pickle.Unpickler):
    """Unpickles torch.distributed.checkpoint's metadata and nothing else: its dataclasses, torch.Size, dtypes and
    layouts, paths."""
    ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
               ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
               ("collections", "OrderedDict")}

    def find_class(self, module, name):
        if (module == "torch.distributed.checkpoint.metadata" or (module, name) in self.ALLOWED
                or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def metadata_is_safe(path):
    """None when torch.distributed.checkpoint's pickled metadata file holds only what it writes, else why not."""
    try:
        with open(path, "rb") as f:
            _AllowList(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
        return str(e)
    return None


def load_checkpoint(path, models):
    """Restore what save_checkpoint wrote into the models and optimisers and this rank's RNGs, on any number of
    ranks (the module docstring) -> trainer_state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    if why := metadata_is_safe(path / "sharded" / ".metadata"):  # before torch's own pickle.load of it
        die(f"--resume: {path}/sharded/.metadata is not a checkpoint's metadata ({why}); not loading it")
    sharded = {name: dict(zip(("model", "optim"), get_state_dict(m, o))) for name, (m, o) in models.items()}
    dcp.load(sharded, checkpoint_id=str(path / "sharded"))
    for name, (m, o) in models.items():
        set_state_dict(m, o, model_state_dict=sharded[name]["model"], optim_state_dict=sharded[name]["optim"])
    old_world = len(list(path.glob("rng_rank*.json")))
    set_rng_states(json.loads((path / f"rng_rank{parallel._rank() % old_world}.json").read_text()))
    return json.loads((path / "trainer_state.json").read_text())
