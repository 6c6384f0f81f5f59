"""The Hugging Face export: a gathered, merged model written by save_pretrained into a directory that replaces its
target whole (transformers and vLLM load it), a critic's backbone and value head, a LoRA run's PEFT adapters."""
import contextlib
import copy
import os
import tempfile
from pathlib import Path

import torch

from infra import lora
from infra.collectives import current_rank
from infra.weights import VALUE_HEAD_FILE


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
    if current_rank() == 0:
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
