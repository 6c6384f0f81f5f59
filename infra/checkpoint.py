"""Training checkpoints: written atomically, verified before they are trusted, free of pickle where we read them, and
loadable on another number of ranks.

    OUT/step_N/actor/, critic/      the HF export (safetensors: safe to share); with LoRA the merged models
    OUT/step_N/adapter/             LoRA only: the actor's adapters in PEFT's layout, on the base --model
    OUT/step_N/sharded/             each model's and optimiser's FSDP2 state (torch.distributed.checkpoint): the
                                    trained parameters only (LoRA: the adapters; trainer_state has the base's digests)
    OUT/step_N/rng_rankR.json       each rank's Python, NumPy and torch RNG states
    OUT/step_N/trainer_state.json   step, schedulers, KL controller, arguments (and a pending validation)
    OUT/step_N/manifest.json        every file's size and SHA-256 (hashed while written), written last
    OUT/latest -> step_N            the newest complete checkpoint

Another world size: the sharded state is resharded by torch.distributed.checkpoint on load; trainer_state is
global; the RNG states are per rank, and rank r takes rank r's, or rank (r mod old world size)'s when the old run
had fewer ranks. No step depends on them (sampling seeds come from (seed, step, prompt, sample, turn), the update's
shuffling from its own generator), so resuming on another world size changes only how rows are cut into
micro-batches: the same run within float tolerance.
No file of a checkpoint runs code when it is loaded: torch.distributed.checkpoint pickles two things, its
`sharded/.metadata` and every non-tensor entry of the state (an optimiser's param_groups values), and reads both
with plain pickle. load_checkpoint reads them itself: the metadata through an unpickler that admits exact (module,
name) pairs of the classes torch writes there (_MetadataUnpickler), the entries under torch.load(weights_only=True)
(_SafePlanner); anything else is refused in one line before it can run. Tensors torch reads with weights_only=True
itself. Everything else is JSON or safetensors.
"""
import hashlib
import io
import json
import os
import pathlib
import pickle
import random
import shutil
import stat
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from infra import collectives, hf_export
from infra.cli import die

MANIFEST = "manifest.json"


def save_checkpoint(out, step, models, tokenizer, trainer_state, keep_last=None, rng=None, export=True, complete=(),
                    resumed=None):
    """OUT/step_N (the module docstring's layout). Written to step_N.tmp, fsynced, renamed, then OUT/latest points at
    it: latest always names a complete checkpoint that survives a crash of the node. models: {"actor": (model,
    optimiser), "critic": ...}. rng: this rank's RNG states to record (rng_states(); default: now). export=False (a
    preemption's checkpoint): no actor/ and critic/ export, only what --resume needs. An existing step_N is written
    over only when it is this run's (trainer_state's run_id) and damaged; otherwise one line, nothing written.
    keep_last: prune this run's older checkpoints (prune: `complete`, the steps this process knows to be complete,
    and `resumed`, the step it resumed from). Every rank calls it."""
    out, rank = Path(out), collectives.current_rank()
    final, tmp = out / f"step_{step:06d}", out / f"step_{step:06d}.tmp"
    if why := collectives.broadcast_object(_occupied(final, trainer_state.get("run_id"), step == resumed)
                                        if rank == 0 else None):
        die(why)
    if rank == 0:
        if tmp.is_symlink():
            tmp.unlink()
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    collectives.barrier()
    try:
        if export:
            adapters = trainer_state.get("lora")  # LoRA: the merged model, and the adapters in PEFT's layout
            hf_export.save_hf(models["actor"][0], tokenizer, tmp / "actor",
                             **dict(adapter_dir=tmp / "adapter", base=adapters["base"]) if adapters else {})
            if "critic" in models:
                hf_export.save_critic(models["critic"][0], tmp / "critic")
        sharded = {name: _trained_state(m, o) for name, (m, o) in models.items()}
        # one file per writer thread: serialising and writing ~12 bytes per parameter is most of a preemption's grace
        writer = _HashingWriter(str(tmp / "sharded"), thread_count=min(8, torch.get_num_threads()))
        dcp.save(sharded, storage_writer=writer)
        digests = {str(Path(path).relative_to(tmp)): d for path, d in writer.fs.digests.items()}
        digests[f"rng_rank{rank}.json"] = write_durable(tmp / f"rng_rank{rank}.json", json.dumps(rng or rng_states()))
        write_durable(tmp / f"{MANIFEST}.rank{rank}", json.dumps(digests))
    except (OSError, RuntimeError):
        disk_full_error(out, step, tmp)
        raise
    collectives.barrier()
    if rank == 0:
        files = {"trainer_state.json": write_durable(tmp / "trainer_state.json",
                                                     json.dumps(dict(trainer_state, step=step), indent=1))}
        parts = sorted(tmp.glob(f"{MANIFEST}.rank*"))
        for part in parts:
            files.update(json.loads(part.read_text()))
            part.unlink()
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):  # the export, read back (the sharded state's
            if str(path.relative_to(tmp)) not in files:                   # entries are there: hashed while written)
                files[str(path.relative_to(tmp))] = file_digest(path, sync=True)
        write_durable(tmp / MANIFEST, json.dumps(dict(sorted(files.items())), indent=0))
        for d in sorted((p for p in tmp.rglob("*") if p.is_dir()), reverse=True) + [tmp]:
            fsync_path(d)  # the entries of every file: a crash after the rename finds them all
        old = final.with_name(f"{final.name}.old")  # an earlier step_N (_occupied): kept until the new one is in
        shutil.rmtree(old, ignore_errors=True)
        if final.is_dir():
            os.replace(final, old)
        os.replace(tmp, final)
        link = out / "latest.tmp"
        link.unlink(missing_ok=True)
        link.symlink_to(final.name)
        os.replace(link, out / "latest")
        fsync_path(out)
        shutil.rmtree(old, ignore_errors=True)
        if keep_last:
            prune(out, keep_last, trainer_state.get("run_id"), {*complete, step}, {step, resumed})
    collectives.barrier()
    return final


def _occupied(final, run_id, resumed):
    """Why step_N cannot be written over (None: it is absent, or this run's and damaged, or the one it resumed from,
    written again whole: a SIGTERM's checkpoint with its export)."""
    if not final.exists() and not final.is_symlink():
        return None
    if final.is_symlink() or not final.is_dir():
        return f"--out: {final} exists and is no checkpoint directory; move it away"
    if run_of(final) != run_id:
        return (f"--out: {final} belongs to another run (its trainer_state.json names another run, or none): "
                f"refusing to write over it; move it away or give another --out")
    if not resumed and damage(final) is None:
        return (f"--out: {final} is a complete checkpoint of this run that --resume did not continue from; refusing "
                f"to write over it (resume from it, or move it away)")
    return None


def step_of(ckpt):
    return int(Path(ckpt).name[len("step_"):])


def prune(out, keep_last, run_id, complete, protected):
    """--keep-last: delete this run's checkpoints older than the keep_last newest known to be complete (`complete`:
    steps this process wrote or verified; a damaged or unknown one never counts as kept, so while fewer are known
    nothing is deleted). Never deletes a checkpoint newer than the oldest kept, one of `protected` (the one just
    written, the one the run resumed from), the one OUT/latest names, nor another run's. -> the steps deleted."""
    kept = sorted(complete, reverse=True)[:keep_last]
    if len(kept) < keep_last:
        return []
    latest = (out / "latest").resolve() if (out / "latest").exists() else None
    doomed = [c for c in sorted(out.glob("step_[0-9]*[0-9]"), key=step_of)
              if step_of(c) < kept[-1] and step_of(c) not in protected and c.resolve() != latest
              and run_of(c) == run_id]
    for c in doomed:
        shutil.rmtree(c, ignore_errors=True)
    return [step_of(c) for c in doomed]


def _trained_only(model):
    """get_state_dict's and set_state_dict's options: trained parameters only, strict only where nothing is frozen."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=all(p.requires_grad for p in model.parameters()))


def _trained_state(model, optim):
    """{"model", "optim"}: what a checkpoint holds of them, the trained parameters (with LoRA the adapters and a
    critic's head; the frozen base is --model's, verified on resume by its digests) and their optimiser state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optim, options=_trained_only(model))
    for name, p in model.named_parameters(remove_duplicate=False):
        if not p.requires_grad:  # a tied head's second name: ignore_frozen_params drops the first only
            model_state.pop(name, None)
    return {"model": model_state, "optim": optim_state}


def base_digests(model_dir):
    """{file: [size, sha256]} of a model directory's weights and config: what a LoRA checkpoint records of its frozen
    base. Every rank calls it and hashes every world-th file."""
    rank, world = collectives.current_rank(), collectives.current_world_size()
    files = sorted(p for p in Path(model_dir).iterdir() if p.suffix == ".safetensors" or p.name == "config.json")
    mine = {p.name: file_digest(p) for p in files[rank::world]}
    return dict(sorted(item for part in collectives.all_gather_object(mine) for item in part.items()))


def run_of(ckpt):
    """The run_id a checkpoint's trainer_state records (None: none, or unreadable)."""
    try:
        return json.loads((Path(ckpt) / "trainer_state.json").read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


# ----------------------------------------------------------------------------- durable files, hashed as written

def write_durable(path, text):
    """Write text to path and fsync it -> [size, sha256]."""
    data = text.encode()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return [len(data), hashlib.sha256(data).hexdigest()]


def fsync_path(path):
    """fsync a file (its bytes) or a directory (its entries)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_digest(path, sync=False):
    """[size, sha256] of a file read back (sync: fsync it first)."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        if sync:
            os.fsync(f.fileno())
        while block := f.read(1 << 22):
            h.update(block)
            size += len(block)
    return [size, h.hexdigest()]


class _HashingStream:
    """A file being written that hashes every byte on its way (SHA-256, which releases the GIL: the writer threads
    hash in parallel); only appends, as torch.distributed.checkpoint writes."""

    def __init__(self, raw):
        self.raw, self.sha, self.size = raw, hashlib.sha256(), 0

    def write(self, data):
        self.sha.update(data)
        n = self.raw.write(data)
        self.size += n
        return n

    def seek(self, *args):
        raise io.UnsupportedOperation("a hashed checkpoint file is written front to back")

    def __getattr__(self, name):  # tell, flush, fileno, close
        return getattr(self.raw, name)


class _HashingFileSystem(FileSystem):
    """torch's local FileSystem, recording [size, sha256] of every file it writes (`digests`, by path)."""

    def __init__(self):
        super().__init__()
        self.digests, self._lock = {}, threading.Lock()

    @contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = _HashingStream(raw)
            yield stream
        with self._lock:
            self.digests[str(path)] = [stream.size, stream.sha.hexdigest()]

    def rename(self, path, new_path):
        super().rename(path, new_path)
        with self._lock:
            self.digests[str(new_path)] = self.digests.pop(str(path))


class _HashingWriter(dcp.FileSystemWriter):
    """torch's FileSystemWriter (its files fsynced: sync_files) through _HashingFileSystem."""

    def __init__(self, path, **kwargs):
        super().__init__(path, sync_files=True, **kwargs)
        self.fs = _HashingFileSystem()


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

def manifest(ckpt):
    """{relative path: [size, sha256]} of every file of a checkpoint directory, read back (what save_checkpoint records
    while it writes them)."""
    files = sorted(p for p in Path(ckpt).rglob("*") if p.is_file() and p.name != MANIFEST)
    return {str(p.relative_to(ckpt)): file_digest(p) for p in files}


def damage(ckpt, rank=0, world=1, only=None):
    """Why the checkpoint directory cannot be trusted (no manifest, a file missing, truncated, changed, not a regular
    file, outside the checkpoint), or None. rank, world: verify every world-th file from the rank-th only (the ranks
    share the reading and hashing). only="actor": that folder alone (eval.py), every file in it listed."""
    ckpt = Path(ckpt)
    try:
        want = json.loads((ckpt / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"no readable {MANIFEST}"
    if not isinstance(want, dict):
        return f"{MANIFEST} is not a file list"
    if only is not None:
        want = {rel: v for rel, v in want.items() if rel.startswith(f"{only}/")}
        on_disk = {str(p.relative_to(ckpt)) for p in (ckpt / only).rglob("*") if not p.is_dir()}
        if extra := sorted(on_disk - want.keys()):
            return f"{extra[0]} is not in its {MANIFEST} (added after the checkpoint was written)"
    elif rank == 0 and "sharded/.metadata" in want:  # the files it makes torch read: ones the manifest vouches for
        try:
            named = {f"sharded/{info.relative_path}" for info in read_metadata(ckpt / "sharded").storage_data.values()}
        except (OSError, UnsafeCheckpoint) as e:
            return f"sharded/.metadata: {e}"
        if extra := sorted(named - want.keys()):
            return f"sharded/.metadata reads {extra[0]}, which {MANIFEST} does not list"
    for rel, entry in sorted(want.items())[rank::world]:
        if why := _outside(ckpt, rel):
            return f"{MANIFEST} names {rel}: {why}"
        size, digest = entry
        path = ckpt / rel
        try:
            st = os.lstat(path)
        except OSError:
            return f"{rel} is missing"
        if not stat.S_ISREG(st.st_mode):
            return f"{rel} is not a regular file"
        if st.st_size != size:
            return f"{rel} has {st.st_size} bytes, {size} were written"
        if digest is not None and file_digest(path)[1] != digest:  # None: a manifest from before full hashes
            return f"{rel} changed since it was written"
    return None


def _outside(root, rel):
    """Why the relative path `rel` would leave directory `root` (an absolute path, '..', a link on the way), or None."""
    if not isinstance(rel, str) or not rel or Path(rel).is_absolute() or ".." in Path(rel).parts:
        return "it leads outside the checkpoint"
    real = (Path(root) / rel).resolve()
    return None if Path(root).resolve() in real.parents else "it leads outside the checkpoint"


def find_resumable(out, log=print):
    """The checkpoint --resume continues from: OUT/latest when it verifies, else the newest step_N that does (each one
    skipped is one line through `log`); None when OUT has none at all. Every rank calls it: rank 0 lists OUT and every
    rank gets its list (ranks whose filesystem caches differ still pick the same checkpoint), and the ranks share
    verifying every byte of each candidate. A checkpoint written before manifests (no manifest.json, but its
    trainer_state and metadata) is taken unverified, with a line saying so. None verifies: one line, exit 2, and
    nothing is deleted."""
    out, rank, world = Path(out), collectives.current_rank(), collectives.current_world_size()
    names = None
    if rank == 0:
        latest = (out / "latest").resolve() if (out / "latest").exists() else None  # (absolute: compared as such,
        candidates = sorted(out.glob("step_[0-9]*[0-9]"), key=step_of, reverse=True)  # whatever form --out has)
        first = [c for c in candidates if c.resolve() == latest]
        candidates = first + [c for c in candidates if c not in first]
        names = [(c.name, "manifest" if (c / MANIFEST).exists() else
                  "old" if (c / "trainer_state.json").exists() and (c / "sharded" / ".metadata").exists() else "none")
                 for c in candidates]
    names = collectives.broadcast_object(names)
    if not names:
        return None
    for name, kind in names:
        ckpt, t0 = out / name, time.time()
        if kind == "old":
            log(f"[resume] {ckpt} has no {MANIFEST} (written before checkpoints had one): loading it unverified")
            return ckpt
        reasons = collectives.all_gather_object(damage(ckpt, rank, world) if kind == "manifest" else f"no {MANIFEST}")
        why = next((r for r in reasons if r is not None), None)
        if why is None:
            size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
            log(f"[resume] {ckpt}: every byte verified ({size / 2**30:.2f} GiB in {time.time() - t0:.1f}s)")
            return ckpt
        log(f"[resume] {ckpt} is damaged ({why}): trying an older checkpoint")
    die(f"--resume: no complete checkpoint in {out} (every step_N failed its {MANIFEST} check); nothing was deleted: "
        f"copy out what you need, or start afresh with another --out")


class UnsafeCheckpoint(Exception):
    """A checkpoint file holds more than torch.distributed.checkpoint writes: something that would run on loading."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles torch.distributed.checkpoint's `.metadata` and nothing else: exact (module, name) pairs, so that no
    attribute path (pickle protocol 4 resolves `os.system` inside any module that imports os) and no other class or
    function can be named. Paths come back as PurePosixPath, whichever module pickled them (Python 3.13 moved
    PosixPath to pathlib._local)."""
    ALLOWED = {("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
        ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}
    PATHS = {(m, n) for m in ("pathlib", "pathlib._local") for n in ("PosixPath", "PurePosixPath")}

    def find_class(self, module, name):
        if (module, name) in self.PATHS:
            return pathlib.PurePosixPath
        if (module, name) in self.ALLOWED or (
                module == "torch" and name.isidentifier() and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"{module}.{name} is not part of a checkpoint's metadata")


def read_metadata(sharded):
    """torch.distributed.checkpoint's Metadata of the directory `sharded`, read by _MetadataUnpickler; UnsafeCheckpoint
    when the file holds anything else."""
    with open(Path(sharded) / ".metadata", "rb") as f:
        try:
            metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, IndexError) as e:
            raise UnsafeCheckpoint(f".metadata: {e}") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f".metadata holds a {type(metadata).__name__}, not a checkpoint's Metadata")
    for info in (metadata.storage_data or {}).values():  # each a file of this directory, and a plain one (no FIFO)
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or Path(rel).name != rel or rel in (".", ".."):
            raise UnsafeCheckpoint(f".metadata names {rel!r}, not a file of its own directory")
        path = Path(sharded) / rel
        if path.exists() and not stat.S_ISREG(os.lstat(path).st_mode):
            raise UnsafeCheckpoint(f".metadata names {rel}, which is not a regular file")
    return metadata


class _SafeReader(dcp.FileSystemReader):
    """torch's FileSystemReader, serving metadata that read_metadata has read instead of its own pickle.load."""

    def __init__(self, path, metadata):
        super().__init__(path)
        self.metadata = metadata

    def read_metadata(self, *args, **kwargs):
        self.metadata.storage_meta = self.metadata.storage_meta or StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


class _SafePlanner(DefaultLoadPlanner):
    """torch's DefaultLoadPlanner, except that a non-tensor entry (an optimiser's param_groups values: numbers,
    booleans, tuples) must unpickle under torch.load(weights_only=True), which admits primitives and tensors and no
    callable; torch's own planner reads these entries with weights_only=False, i.e. runs whatever they name."""

    def load_bytes(self, read_item, value):
        data = value.read()
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as e:
            why = next((x for x in str(e).splitlines() if "GLOBAL" in x), "not primitives and tensors")
            raise UnsafeCheckpoint(f"entry {read_item.dest_index.fqn} is not plain data ({why.strip()})") from None
        super().load_bytes(read_item, io.BytesIO(data))  # the same bytes, shown to hold plain data only


def load_checkpoint(path, models):
    """Restore what save_checkpoint wrote into the models and optimisers and this rank's RNGs, on any number of
    ranks (the module docstring) -> trainer_state."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(path)
    sharded = {name: _trained_state(m, o) for name, (m, o) in models.items()}
    try:
        reader = _SafeReader(str(path / "sharded"), read_metadata(path / "sharded"))
        dcp.load(sharded, storage_reader=reader, planner=_SafePlanner())
    except UnsafeCheckpoint as e:
        die(f"--resume: {path}/sharded: {e}; not loading it")
    except dcp.api.CheckpointException as e:  # torch gathers each rank's exception (with its stack) into one
        unsafe = [f for f in (x[0] if isinstance(x, tuple) else x for x in e.failures.values())
                  if isinstance(f, UnsafeCheckpoint)]
        if not unsafe:
            raise
        die(f"--resume: {path}/sharded: {unsafe[0]}; not loading it")
    for name, (m, o) in models.items():
        set_state_dict(m, o, model_state_dict=sharded[name]["model"], optim_state_dict=sharded[name]["optim"],
                       options=_trained_only(m))
    old_world = len(list(path.glob("rng_rank*.json")))
    set_rng_states(json.loads((path / f"rng_rank{collectives.current_rank() % old_world}.json").read_text()))
    return json.loads((path / "trainer_state.json").read_text())
