"""Data parallelism for train.py: the process group and its collectives, FSDP2 sharding, loading each rank's
shard, the engine's weight sync and the Hugging Face export (micro-batches: packing.py; checkpoints:
checkpoint.py).

Plumbing only: the method lives in rollout.py (sampling), reward.py, ppo.py and train.py; this file makes it
run on one rank or many. Every function that gathers or reduces is a collective: every rank calls it.
"""
import contextlib
import copy
import json
import math
import os
import random
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import lora
from cli import die, no_link
from model import VALUE_HEAD_FILE, ValueModel, decoder_layers


# ----------------------------------------------------------------------------- process group and collectives

def init_distributed(timeout=None):
    """(rank, world_size, local_rank, device). Under torchrun: one process group over all ranks
    (gloo for CPU tensors, nccl for CUDA). Without torchrun: a 1-rank group in an in-process
    store, so shard()/full_state_dict() work the same way in a plain `python train.py`.
    timeout: seconds any collective may wait (NCCL's watchdog and gloo's); ranks wait for the slowest
    rank's rollout at the first collective after it, so it must outlast that (None: torch's default)."""
    import datetime

    import torch.distributed as dist

    timeout = None if timeout is None else datetime.timedelta(seconds=timeout)
    rank, world, local = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"  # gloo also serves offloaded params
        if "RANK" in os.environ:
            dist.init_process_group(backend, store=attempt_store(world, timeout), rank=rank, world_size=world,
                                    device_id=device if device.type == "cuda" else None, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return rank, world, local, device


def attempt_store(world, timeout=None):
    """The rendezvous store of this attempt of the group, or None (init_process_group's env:// store). torchrun's
    agent hosts one TCPStore for all restarts of a group (TORCHELASTIC_USE_AGENT_STORE) and hands it to the workers
    without a per-attempt prefix, so a restarted group's ranks could read the dead attempt's keys (gloo's peer
    addresses, NCCL's unique id) and connect to dead peers: each attempt's keys go under their own prefix, the
    attempt's number agreed through the store itself (agree_on_attempt). TORCHELASTIC_RESTART_COUNT cannot be it:
    each node's agent counts its own restarts, and an agent whose workers hung rather than failed (NCCL peers of a
    dead rank usually do) restarts them through its membership-change path, which does not count."""
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None  # rank 0 hosts a fresh store (env://), or another launcher's own
    timeout = timeout or default_pg_timeout
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    attempt = agree_on_attempt(store, int(os.environ["RANK"]), world, timeout.total_seconds())
    return dist.PrefixStore(f"attempt_{attempt}", store)


def agree_on_attempt(store, rank, world, timeout):
    """A number that every worker of this attempt of the group gets, and no worker of an earlier attempt got; `store`
    outlives attempts, and every worker of an earlier attempt is dead when this one's start (torchrun stops them all
    before the next rendezvous). Rank 0 draws the next number from a counter and posts it; every other rank answers
    the number it read with a nonce of its own, and takes it once rank 0 has listed that nonce: a number left over
    from an earlier attempt is never confirmed with this attempt's nonces, so that rank reads again."""
    deadline = time.monotonic() + timeout
    if rank == 0:
        attempt = store.add("mutis/attempts", 1)
        store.set("mutis/attempt", str(attempt))
        acks = [f"mutis/attempt_{attempt}/ack/{r}" for r in range(1, world)]
        if missing := wait_for_keys(store, acks, deadline):
            raise TimeoutError(f"rank(s) {[r for r, k in enumerate(acks, 1) if k in missing]} did not join attempt "
                               f"{attempt} of the group")
        store.set(f"mutis/attempt_{attempt}/go", json.dumps(sorted(store.get(k).decode() for k in acks)))
        return attempt
    nonce, answered = f"{rank}-{os.getpid()}-{random.getrandbits(64):016x}", None
    while time.monotonic() < deadline:
        if store.check(["mutis/attempt"]):
            attempt = int(store.get("mutis/attempt"))
            if attempt != answered:
                store.set(f"mutis/attempt_{attempt}/ack/{rank}", nonce)
                answered = attempt
            go = f"mutis/attempt_{attempt}/go"
            if store.check([go]) and nonce in json.loads(store.get(go)):
                return attempt
        time.sleep(0.01)
    raise TimeoutError("rank 0 did not start this attempt of the group")


def wait_for_keys(store, keys, deadline):
    """Wait until every key is set in the store -> [], or the keys still missing once time.monotonic() passes
    deadline. Polled, not store.wait: the calling thread stays in Python between checks (a signal handler runs), and
    the store logs no warning per timed-out wait."""
    pause = 0.01
    while not store.check(keys):
        if time.monotonic() > deadline:
            return [k for k in keys if not store.check([k])]
        time.sleep(pause)
        pause = min(2 * pause, 0.25)
    return []


def close_distributed():
    """End the process group while the interpreter is whole. FSDP's modules hold the group in reference cycles that
    only the garbage collector frees; left to interpreter shutdown, the group's gloo worker threads touch Python
    after it is finalising and the process aborts ("terminate called without an active exception")."""
    import gc

    if dist.is_initialized():
        dist.barrier()  # no rank tears the group down while another still uses it
        gc.collect()
        dist.destroy_process_group()
    gc.collect()


def _rank():
    return dist.get_rank() if dist.is_initialized() else 0


def _world():
    return dist.get_world_size() if dist.is_initialized() else 1


def broadcast_object(obj, src=0):
    """Rank src's obj on every rank (small JSON-like values: a decision, a list of names)."""
    if _world() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj):
    """[every rank's obj] on every rank, in rank order (small JSON-like values)."""
    if _world() == 1:
        return [obj]
    out = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


class RanksDisagree(RuntimeError):
    """Ranks that must hold the same result do not (the ranks of one tensor-parallel engine, their tokens)."""


def engine_group(tp):
    """The ranks that share this rank's engine (--engine-tp): groups of tp contiguous ranks, as vLLM's
    external_launcher forms them -> (members, a gloo group over them; None when tp == 1). A collective over the
    whole world (new_group): every rank calls it, at once. gloo: the group's few small collectives (a stop flag
    before each engine step, a hash after each call) stay off the GPU and its streams."""
    rank, world = _rank(), _world()
    if tp == 1:
        return [rank], None
    mine = None
    for first in range(0, world, tp):
        members = list(range(first, first + tp))
        group = dist.new_group(members, backend="gloo")
        if rank in members:
            mine = members, group
    return mine


def group_any(flag, group):
    """Whether any rank of `group` passed a true flag (a collective over the group)."""
    t = torch.tensor([int(bool(flag))])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def group_gather_int(value, group):
    """[every member's int64 value] on every member of `group`, in rank order."""
    mine = torch.tensor([value], dtype=torch.int64)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [int(t.item()) for t in out]


def gather_to_first(items, key):
    """Every rank's list of items on rank 0, merged and sorted by key (None on the other ranks): what one process
    would have produced."""
    if _world() == 1:
        parts = [items]
    else:
        parts = [None] * _world() if _rank() == 0 else None
        dist.gather_object(items, parts, dst=0)
        if parts is None:
            return None
    return sorted((x for part in parts for x in part), key=key)


def shard(model, mixed_precision=None, offload=False, grad_checkpointing=False, mesh=None):
    """FSDP2 in place: each decoder layer is one unit, the root (embeddings, norm, head; tied
    weights are one parameter, so they share the root unit) is another. mixed_precision=bf16:
    bf16 compute, fp32 gradient reduction; offload: parameters/grads/optimizer state on CPU.
    The root keeps FSDP's default of staying unsharded after forward: token_logprobs reads the
    head weight after the root forward and relies on that."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": mesh}
    if mixed_precision is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=mixed_precision, reduce_dtype=torch.float32)
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    if grad_checkpointing:  # HF recomputes each decoder layer in backward (only while model.train())
        backbone = model.backbone if isinstance(model, ValueModel) else model
        backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def persistent_buffers(model):
    """[(name, buffer)] of the buffers a state dict holds (rotary frequencies and the like are not in it)."""
    return [(f"{mod_name}.{b}".lstrip("."), buf) for mod_name, mod in model.named_modules()
            for b, buf in mod.named_buffers(recurse=False) if b not in mod._non_persistent_buffers_set]


# ----------------------------------------------------------------------------- loading each rank's shard

def load_sharded(build, path, device, init_missing=None, **shard_kwargs):
    """shard(build(meta=...)) with the weights of `path`, without any rank ever holding the whole model: the model is
    built on the meta device, sharded, allocated shard by shard on `device` (CPU with --offload), and each rank
    reads only its own rows of each tensor from the safetensors files (one tensor at a time; no communication,
    and the node's page cache serves all ranks). build(meta=...) -> the model (model.load_causal_lm/load_critic).
    init_missing(name, full shape) -> the full starting value of a tensor the files do not hold (LoRA adapters:
    lora.initial_value), or None. A path without local safetensors files (a hub id, .bin weights) is loaded whole
    and then sharded (build initialises what the files lack)."""
    try:
        files = weight_files(path)
    except ValueError as e:
        die(str(e))
    if not files:
        return shard(build(meta=False).to(device), **shard_kwargs)
    model = shard(build(meta=True), **shard_kwargs)
    offload = shard_kwargs.get("offload")
    model.to_empty(device="cpu" if offload else device)
    if offload:  # FSDP keeps the parameters on the CPU; buffers stay where the compute runs, as in the path above
        for module in model.modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = buf.to(device)
    _rebuild_buffers(model)
    _fill_shards(model, path, files, init_missing)
    return model


def _rebuild_buffers(model):
    """to_empty leaves buffers uninitialised; the persistent ones are read from the files, the others (rotary
    frequencies, embedding scales) are recomputed by the model's own initialiser, as transformers does after its
    own meta-device loading (parameters it touches there are overwritten from the files next)."""
    hf = model.backbone if isinstance(model, ValueModel) else model
    for module in hf.modules():
        if module._non_persistent_buffers_set:
            with torch.no_grad():
                hf._init_weights(module)


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


INDEX = "model.safetensors.index.json"


def weight_files(path):
    """The safetensors files of a model directory, as its index lists them (model.safetensors.index.json), else its
    one *.safetensors file (and a critic's value_head.safetensors beside either). [] where there is none (a hub id,
    .bin weights). ValueError, naming the file, for a shard the index lists that is missing and for a *.safetensors
    file that it does not list (a stale one of an earlier save, which would otherwise be read as the model's)."""
    path = Path(path)
    present = {p.name for p in path.glob("*.safetensors")} - {VALUE_HEAD_FILE}
    head = [path / VALUE_HEAD_FILE] if (path / VALUE_HEAD_FILE).is_file() else []
    if not (path / INDEX).is_file():
        if len(present) > 1:
            raise ValueError(f"{path}: {len(present)} *.safetensors files ({', '.join(sorted(present))}) and no {INDEX} "
                             f"to say which hold the model: remove the stale ones")
        return [path / n for n in sorted(present)] + head
    listed = set(json.loads((path / INDEX).read_text()).get("weight_map", {}).values())
    if odd := sorted(n for n in listed if not isinstance(n, str) or Path(n).name != n):
        raise ValueError(f"{path / INDEX} names {odd[0]!r}, not a file of its own directory")
    if missing := sorted(listed - present):
        raise ValueError(f"{path}: {INDEX} lists {missing[0]}, which is missing")
    if stray := sorted(present - listed):
        raise ValueError(f"{path}: {stray[0]} is not in its {INDEX} (a shard of an earlier save?): remove it")
    return [path / n for n in sorted(listed)] + head


def safetensors_index(files):
    """{tensor name: (file, dtype, shape, byte offset)} from the headers of safetensors files (8-byte header length,
    JSON header, data); value_head.safetensors' tensors are named value_head.*."""
    index = {}
    for f in files:
        with open(f, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        for key, v in header.items():
            if key != "__metadata__":
                name = f"value_head.{key}" if f.name == VALUE_HEAD_FILE else key
                index[name] = (f, SAFETENSORS_DTYPES[v["dtype"]], v["shape"], 8 + size + v["data_offsets"][0])
    return index


def read_rows(entry, start, out):
    """Rows [start, start + len(out)) of a stored tensor into `out` (any dtype and device) with one plain read: no
    memory map, so the process never holds more of the file than these rows (in host memory, once)."""
    f, dtype, shape, offset = entry
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    direct = out.dtype == dtype and out.device.type == "cpu" and out.is_contiguous()
    buf = out if direct else torch.empty(out.shape, dtype=dtype)
    raw = buf.reshape(-1).view(torch.uint8).numpy()  # [rows * row_bytes]
    with open(f, "rb") as fh:
        fh.seek(offset + start * row_bytes)
        if fh.readinto(raw) != raw.nbytes:
            raise ValueError(f"{f}: truncated safetensors file")
    if not direct:
        out.copy_(buf)


def _fill_shards(model, path, files, init_missing=None):
    """Copy this rank's rows of every parameter and persistent buffer from the safetensors files of `path`
    (a causal LM, or a save_critic directory with value_head.safetensors). FSDP2 shards dim 0 as torch.chunk
    does: rank r holds rows [r * ceil(n / world), ...) of an n-row tensor. A critic's missing head starts at 0;
    other missing tensors take their rows of init_missing's value (load_sharded)."""
    from torch.distributed.tensor import DTensor

    index = safetensors_index(files)
    prefix = getattr(model.backbone, "base_model_prefix", "model") if isinstance(model, ValueModel) else None
    for name, tensor in state_tensors(model):
        keys = [name]
        if prefix and name.startswith("backbone."):  # a causal LM's file names the backbone "model."
            keys = [name[len("backbone."):], f"{prefix}.{name[len('backbone.'):]}"]
        key = next((k for k in keys if k in index), None)
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        with torch.no_grad():
            if key is None and name.startswith("value_head."):
                local.zero_()  # ValueModel's head starts at exactly 0
                continue
            initial = init_missing(name, tuple(tensor.shape)) if key is None and init_missing else None
            if key is None and initial is None:
                raise ValueError(f"{path}: its safetensors files hold no tensor {keys[-1]!r}")
            full, start = list(initial.shape) if initial is not None else index[key][2], 0
            if list(full[1:]) != list(local.shape[1:]) or (local.dim() == 0) != (len(full) == 0):
                raise ValueError(f"{path}: {key or name} has shape {full}, the model's {name} {list(tensor.shape)}")
            if isinstance(tensor, DTensor) and tensor.device_mesh.size() > 1:
                chunk = -(-full[0] // tensor.device_mesh.size())
                start = tensor.device_mesh.get_local_rank() * chunk
                if local.shape[0] != max(0, min(chunk, full[0] - start)):
                    raise AssertionError(f"{name}: a local shard of {local.shape[0]} rows is not torch.chunk's")
            if initial is not None:
                local.copy_(initial[start:start + local.shape[0]])
            elif local.numel():
                read_rows(index[key], start, local)


def all_reduce_sum(values_list, device):
    t = torch.tensor(values_list, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def all_reduce_dict(d, device):
    """{name: local sum} -> {name: sum over ranks}; every rank passes the same keys."""
    keys = sorted(d)
    return dict(zip(keys, all_reduce_sum([float(d[k]) for k in keys], device)))


def barrier():
    if dist.is_initialized():
        dist.barrier()


def check_shared_out(out, rank, world, device):
    """--out must be one directory for every rank (a filesystem shared by all nodes): rank 0 writes a token
    file there, every rank must read it back; otherwise every rank stops with one line."""
    if world == 1:
        return
    token = all_reduce_sum([float(random.SystemRandom().getrandbits(48)) if rank == 0 else 0.0], device)[0]
    path = out / f".shared-check-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}"
    if rank == 0:
        with os.fdopen(no_link(path), "w") as f:
            f.write(str(int(token)))
    barrier()
    try:
        seen = path.read_text() == str(int(token))
    except OSError:
        seen = False
    missing = all_reduce_sum([0.0 if seen else 1.0], device)[0]
    if rank == 0:
        path.unlink(missing_ok=True)
    if missing:
        die(f"--out {out}: {int(missing)} of {world} ranks do not see the file rank 0 wrote there; --out must be "
            f"on a filesystem shared by every node (checkpoints and metrics are written by rank 0 and read by all)")


# ----------------------------------------------------------------------------- weight sync and export

def full_state_dict(model, dtype=None):
    """Yield (HF name, full tensor) one parameter at a time, for the engine's weight sync (DTensor.full_tensor()
    is a collective: every rank must iterate). FSDP2 keeps the HF names. Tied weights appear once, under
    their first name (embed_tokens). dtype: floating tensors cast to it (the engine's) shard by shard, before the
    gather: a bf16 engine then moves half of the fp32 master weights' bytes and never holds a full fp32 copy.
    --offload on GPUs: each CPU shard moves to the GPU first and is gathered there (NCCL), as TRL and veRL do, not
    over gloo between host copies; one tensor at a time, so the GPU holds one shard and one full tensor beyond the
    model's own shards."""
    for name, tensor in state_tensors(model):
        yield name, gathered(tensor, dtype)


def state_tensors(model):
    """[(HF name, parameter or persistent buffer)] in the model's order: what a state dict holds, tied weights once."""
    return [*model.named_parameters(), *persistent_buffers(model)]


def gathered(tensor, dtype=None):
    """The full tensor of a parameter or buffer (a collective for a DTensor: every rank calls it), floating ones cast
    to `dtype` first (None keeps theirs)."""
    from torch.distributed.tensor import DTensor

    tensor = tensor.detach()
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    return on_mesh_device(tensor).full_tensor() if isinstance(tensor, DTensor) else tensor


def on_mesh_device(tensor):
    """A DTensor shard on its mesh's device ("cuda" for FSDP2 on GPUs, offloaded or not: the current device, which
    init_distributed set), where its gather runs; --offload keeps shards on the CPU."""
    mesh_device = tensor.device_mesh.device_type
    return tensor.to(mesh_device) if tensor.device.type != mesh_device else tensor


def reshard(*models):
    """Free the gathered parameters FSDP2 keeps after a forward without backward. It reshards a root module only in
    backward (the layers it reshards after each forward), so after a no-grad pass the embedding, final norm and head
    stay gathered on every rank -- for the reference, which never runs backward, for the whole run -- in the memory
    the engine wakes into next."""
    from torch.distributed.fsdp import FSDPModule

    for model in models:
        if isinstance(model, FSDPModule):
            model.reshard()


def _gather_to_cpu(model, dtype):
    """({HF name: full CPU tensor}, {adapter name: tensor}) on rank 0, ({}, {}) on the others; a collective, so every
    rank calls it. LoRA adapters are merged into their weights in fp32 (lora.merge_state) and returned apart.
    dtype: cast floating tensors to it (None keeps theirs). Tied weights stay one tensor under both
    names, which tells save_pretrained to write it once."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    state, adapters = lora.merge_state(state, model)
    if not state:
        return state, adapters
    names = {}  # id(parameter) -> its names; a tied weight has several
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for first, *others in names.values():
        for name in others:
            state[name] = state[first]
    cast = {}  # id(tensor) -> its cast copy; replaced in place, so the fp32 copy of each is freed in turn
    for name, t in state.items():
        if dtype is not None and t.is_floating_point():
            state[name] = cast.setdefault(id(t), t.to(dtype))
    return state, adapters


@contextlib.contextmanager
def _atomic_dir(out_dir):
    """Rank 0 fills a temp directory beside out_dir (the others get None), which then replaces out_dir:
    a half-written model never looks complete. Every rank waits until it is in place."""
    import shutil

    import torch.distributed as dist

    out_dir, tmp = Path(out_dir), None
    if _rank() == 0:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.tmp"))
    try:
        yield tmp
        if tmp is not None and out_dir.exists():  # os.replace cannot replace a non-empty directory: move it aside
            old = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}.old"))
            os.replace(out_dir, old / "x")
            os.replace(tmp, out_dir)
            shutil.rmtree(old)
        elif tmp is not None:
            os.replace(tmp, out_dir)
    finally:
        if tmp is not None and tmp.exists():  # failed half-way: leave nothing behind
            shutil.rmtree(tmp)
    if dist.is_initialized():
        dist.barrier()  # nobody reads the directory before it is complete


def _save_pretrained(module, tmp, state, dtype, max_shard_size):
    """module.save_pretrained with a gathered state dict; config.json records the saved weights' dtype
    (save_pretrained records the parameters', e.g. the fp32 master weights)."""
    module.save_pretrained(tmp, state_dict=state, max_shard_size=max_shard_size)
    if dtype is not None:
        config = copy.deepcopy(module.config)
        config.dtype = dtype
        config.save_pretrained(tmp)


def save_hf(model, tokenizer, out_dir, dtype=torch.bfloat16, max_shard_size="5GB", adapter_dir=None, base=None):
    """A causal LM directory that transformers and vLLM load, written by save_pretrained: safetensors
    shards of at most max_shard_size (model.safetensors when one is enough, else model-0000k-of-0000n
    .safetensors and model.safetensors.index.json), config, generation config, tokenizer. Every rank
    calls it (the gather is a collective); rank 0 writes. Tied head: only embed_tokens is written and
    config.tie_word_embeddings tells loaders to tie. A LoRA model: the merged model, and with adapter_dir its
    adapters on the model `base` in PEFT's layout (lora.save_peft)."""
    state, adapters = _gather_to_cpu(model, dtype)
    with _atomic_dir(out_dir) as tmp:
        if tmp is not None:
            _save_pretrained(model, tmp, state, dtype, max_shard_size)
            tokenizer.save_pretrained(tmp)
            if adapters and adapter_dir is not None:
                lora.save_peft(adapters, model.lora_config, base, adapter_dir)


def save_critic(critic, out_dir, dtype=None, max_shard_size="5GB"):
    """The backbone as its own save_pretrained directory (AutoModel and AutoModelForCausalLM both load it)
    + value_head.safetensors; load_critic reads both. dtype=None keeps the parameters' own dtype (exact
    resume). Every rank calls it; rank 0 writes."""
    from safetensors.torch import save_file

    state, _ = _gather_to_cpu(critic, dtype)
    head = {k[len("value_head."):]: state.pop(k) for k in list(state) if k.startswith("value_head.")}
    backbone = {k[len("backbone."):]: t for k, t in state.items()}
    with _atomic_dir(out_dir) as tmp:
        if tmp is not None:
            _save_pretrained(critic.backbone, tmp, backbone, dtype, max_shard_size)
            save_file(head, tmp / VALUE_HEAD_FILE, metadata={"format": "pt"})
