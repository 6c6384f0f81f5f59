"""Reading a model directory's safetensors files: which files hold the model (its index), and each rank's own rows
of each tensor, straight into its FSDP2 shard, so that no rank ever holds the whole model."""
import json
import math
from pathlib import Path

import torch

from infra.cli import die
from infra.sharding import shard, state_tensors

VALUE_HEAD_FILE = "value_head.safetensors"


def load_sharded(build, path, device, init_missing=None, **shard_kwargs):
    """shard(build(meta=...)) with the weights of `path`, without any rank ever holding the whole model: the model is
    built on the meta device, sharded, allocated shard by shard on `device` (CPU with --offload), and each rank
    reads only its own rows of each tensor from the safetensors files (one tensor at a time; no communication,
    and the node's page cache serves all ranks). build(meta=...) -> the model (hf.load_causal_lm/load_critic).
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
    hf = getattr(model, "backbone", model)  # a critic (model.ValueModel) wraps its backbone
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


def read_tensor_rows(entry, start, out):
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
    prefix = getattr(model.backbone, "base_model_prefix", "model") if hasattr(model, "backbone") else None  # a critic
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
                read_tensor_rows(index[key], start, local)
