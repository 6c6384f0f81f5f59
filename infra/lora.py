"""LoRA adapters (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models", sec. 4.1): a frozen linear
layer W [out, in] gets a trained low-rank update,

    h = W x + (alpha / r) B A x,      A [r, in] ~ U(-1/sqrt(in), 1/sqrt(in)),  B [out, r] = 0 at the start,

so the adapted model starts as the base. --lora-rank R adapts the linear layers of every decoder block
(--lora-targets); the base is kept once, frozen, in the trainer's compute dtype: no fp32 master copy, no gradient,
no optimiser state. Plain PyTorch, in PEFT's parameter names (...q_proj.lora_A.weight), sharded by FSDP2 with the
rest of each decoder layer. No dropout on the adapters (PPO's ratio needs the same function in every pass).

What the trainer takes from here:
  adapt(model, ...)           the adapters on a built model (meta or real)
  adapters_off(model)         the reference policy is the base itself: no second copy of the model
  merged_weights(model, dt)   what the engine samples with: the whole base, each adapted W as W + (alpha / r) B A,
                              so vLLM runs its plain kernels (its LoRA path is slower)
  merge_state(state, model)   the HF export: a merged model that any loader reads
  save_peft(adapters, ...)    adapter_config.json + adapter_model.safetensors in PEFT's layout
"""
import json
import math
import zlib
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # a Llama/Qwen/Mistral block


class LoRALinear(nn.Linear):
    """nn.Linear plus lora_A [r, in] and lora_B [out, r] (nn.Linear each: PEFT's names). adapt() turns an existing
    nn.Linear into one by its class, so `weight` and `bias` keep their names, and the model's files still load."""

    def forward(self, x):                                   # x [..., in] -> [..., out]
        out = F.linear(x, self.weight, self.bias)
        if not self.lora_on:
            return out
        return out + self.lora_B(self.lora_A(x)) * self.lora_scaling


def parse_targets(text):
    """--lora-targets: 'all-linear' (TARGETS) or comma-separated module names -> tuple of names."""
    return TARGETS if text == "all-linear" else tuple(t.strip() for t in text.split(",") if t.strip())


def adapt(model, layers, rank, alpha, targets, base_dtype, trainable=(), seed=0):
    """Adapters on the `targets` linear layers of `layers` (the decoder blocks), in place -> model; a target the blocks
    lack is a ValueError naming what they hold. Every parameter already there is frozen and cast
    to base_dtype except those under a `trainable` prefix (a critic's value head); A and B are fp32 and trained.
    Built on the meta device, nothing is allocated (load_sharded fills A and B from initial_value); otherwise
    they are initialised here. model.lora_config records what an export and a resume need."""
    found = {name.rsplit(".", 1)[-1]: m for layer in layers for name, m in layer.named_modules()
             if type(m) is nn.Linear}
    if missing := [t for t in targets if t not in found]:
        raise ValueError(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not a linear layer of the "
                         f"decoder blocks (they have: {', '.join(sorted(found))})")
    for name, p in model.named_parameters():
        p.requires_grad_(any(name.startswith(t) for t in trainable))
        if not p.requires_grad and p.is_floating_point():
            p.data = p.data.to(base_dtype)
    names = {id(m): n for n, m in model.named_modules()}
    for layer in layers:
        for name, m in list(layer.named_modules()):
            if type(m) is nn.Linear and name.rsplit(".", 1)[-1] in targets:
                m.__class__ = LoRALinear
                kw = dict(bias=False, device=m.weight.device, dtype=torch.float32)
                m.lora_A, m.lora_B = nn.Linear(m.in_features, rank, **kw), nn.Linear(rank, m.out_features, **kw)
                m.lora_scaling, m.lora_on = alpha / rank, True
                if m.weight.device.type != "meta":
                    with torch.no_grad():
                        for part in ("lora_A", "lora_B"):
                            w = getattr(m, part).weight
                            w.copy_(initial_value(f"{names[id(m)]}.{part}.weight", w.shape, seed))
    model.lora_config = {"r": rank, "alpha": alpha, "targets": list(targets), "seed": seed}
    return model


def initial_value(name, shape, seed=0):
    """The starting value of adapter tensor `name` (its full shape), None for any other tensor: B zero, A uniform as
    nn.Linear's own init (kaiming with a = sqrt(5): bound 1 / sqrt(in), as PEFT), drawn from a generator seeded by
    (seed, name), so every rank and every world size starts from the same adapters."""
    if name.endswith("lora_B.weight"):
        return torch.zeros(shape)
    if not name.endswith("lora_A.weight"):
        return None
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return (torch.rand(shape, generator=g) * 2 - 1) / math.sqrt(shape[1])      # [r, in]


def adapted_layers(model):
    """[(name, LoRALinear)] of the model, in module order (the same on every rank)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


@contextmanager
def adapters_off(model):
    """The base model, inside the block: the reference policy (every adapter skipped, nothing copied)."""
    layers = [m for _, m in adapted_layers(model)]
    for m in layers:
        m.lora_on = False
    try:
        yield model
    finally:
        for m in layers:
            m.lora_on = True


def merged(weight, a, b, scaling):
    """W + scaling B A in fp32, a new tensor: weight [n, in] (all or some rows of W), b the same rows of B [n, r],
    a [r, in]. One fp32 copy of W, the product added in place (the sync's cost is memory traffic)."""
    return weight.to(torch.float32, copy=True).addmm_(b.float(), a.float(), alpha=scaling)


def merged_weights(model, dtype):
    """Yield (HF name, full tensor in `dtype`) of every tensor of the base model, one at a time, in the model's order:
    each adapted layer's W merged, the adapters themselves left out. All of it, every sync: an engine that slept
    holds no weights (vLLM's level 2 on a GPU discards them all), and vLLM rebuilds a fused layer it receives in
    part (q/k/v into qkv_proj, gate/up into gate_up_proj) from uninitialised memory; in this order each layer
    completes before the next one starts. Every rank must iterate (gathers are collectives). FSDP2 shards W [out, in]
    and B [out, r] alike along `out`, so each rank merges its own rows with the gathered A [r, in] and one gather in
    the engine's dtype follows. --offload: CPU shards move to the mesh's device first (sharding.on_mesh_device)."""
    from torch.distributed.tensor import DTensor

    from infra.sharding import gathered, on_mesh_device, state_tensors  # (parallel imports this module)

    def local(t):
        return on_mesh_device(t.detach()) if isinstance(t, DTensor) else t.detach()

    layers = dict(adapted_layers(model))
    for name, tensor in state_tensors(model):
        owner, _, leaf = name.rpartition(".")
        if owner.rsplit(".", 1)[-1] in ("lora_A", "lora_B"):
            continue
        if owner not in layers or leaf != "weight":
            yield name, gathered(tensor, dtype)
            continue
        m = layers[owner]
        w, a, b = local(m.weight), local(m.lora_A.weight), local(m.lora_B.weight)
        if not isinstance(w, DTensor):
            yield name, merged(w, a, b, m.lora_scaling).to(dtype)
            continue
        rows = merged(w.to_local(), a.full_tensor(), b.to_local(), m.lora_scaling).to(dtype)   # [out / W, in]
        yield name, DTensor.from_local(rows, w.device_mesh, w.placements, shape=w.shape, stride=w.stride(),
                                       run_check=False).full_tensor()


def merge_state(state, model):
    """A gathered full state dict of `model` ({name: tensor}, rank 0) -> (the merged model's state dict, the adapters
    {name: tensor}), in place: each adapted W becomes W + (alpha / r) B A in W's dtype and A, B move to the second
    dict. A model without adapters, or an empty state (the other ranks): (state, {})."""
    adapters = {}
    for name, m in adapted_layers(model):
        if f"{name}.weight" not in state:
            continue
        a, b = state.pop(f"{name}.lora_A.weight"), state.pop(f"{name}.lora_B.weight")
        adapters.update({f"{name}.lora_A.weight": a, f"{name}.lora_B.weight": b})
        w = state[f"{name}.weight"]
        state[f"{name}.weight"] = merged(w, a, b, m.lora_scaling).to(w.dtype)
    return state, adapters


PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


def save_peft(adapters, config, base, out_dir):
    """The adapters as PEFT saves a LoRA adapter: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
    base), out_dir) rebuilds the trained model. Names gain PEFT's 'base_model.model.' prefix."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({f"base_model.model.{k}": v.contiguous() for k, v in adapters.items()}, out_dir / PEFT_WEIGHTS,
              metadata={"format": "pt"})
    (out_dir / PEFT_CONFIG).write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
        "r": config["r"], "lora_alpha": config["alpha"], "target_modules": sorted(config["targets"]),
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None}, indent=1))
