"""FSDP2 sharding of the actor and the critic, and the full tensors gathered from it one at a time (the engine's
weight sync reads them in model order)."""
import torch

from infra.hf import decoder_layers


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
        backbone = getattr(model, "backbone", model)  # a critic (model.ValueModel) wraps its backbone
        backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def persistent_buffers(model):
    """[(name, buffer)] of the buffers a state dict holds (rotary frequencies and the like are not in it)."""
    return [(f"{mod_name}.{b}".lstrip("."), buf) for mod_name, mod in model.named_modules()
            for b, buf in mod.named_buffers(recurse=False) if b not in mod._non_persistent_buffers_set]


def reshard(*models):
    """Free the gathered parameters FSDP2 keeps after a forward without backward. It reshards a root module only in
    backward (the layers it reshards after each forward), so after a no-grad pass the embedding, final norm and head
    stay gathered on every rank -- for the reference, which never runs backward, for the whole run -- in the memory
    the engine wakes into next."""
    from torch.distributed.fsdp import FSDPModule

    for model in models:
        if isinstance(model, FSDPModule):
            model.reshard()


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
