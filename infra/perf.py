"""Model FLOPs and MFU: one formula for train.py's perf/ metrics and bench/gpu_bench.py.

Model FLOPs count the work a pass needs, not what a kernel happens to do (no padding, no activation recompute):

    forward F = sum over packed sequences of  2 P_layers s + 2 P_head r + 2 L d s^2        training: 3 F

for a sequence of s tokens (prompt + response) whose r response tokens go through the head. P_layers: the decoder
layers' parameters (projections and norms); P_head: the LM head's (vocab x hidden; token_logprobs applies it to
response tokens only) or the critic's value head (hidden + 1); L layers; d = attention heads x head_dim. Causal
attention scores s(s+1)/2 ~ s^2/2 query-key pairs per head, 2 d FLOPs each for QK^T and again for AV:
2 L d s^2. The embedding is a lookup: no FLOPs. With LoRA (a frozen base) training is 3 F less the weights' share of
one F: the base gets no weight gradients (training_flops).
veRL's counter (verl/utils/flops_counter.py) charges 6 x (layers + embedding + head) parameters on every token and
non-causal attention (12 L d s^2 for training): on the same step it reports more than this formula.
"""
import torch

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from NVIDIA's data sheets; the first name found in
# torch.cuda.get_device_name() wins, so the more specific names come first. Others: --peak-tflops.
PEAK_BF16_TFLOPS = (("GH200", 989.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0),
                    ("H800", 989.0), ("B200", 2250.0), ("B100", 1750.0), ("A100", 312.0), ("A800", 312.0),
                    ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0), ("A10", 125.0))


def peak_tflops(device, override=None):
    """The device's dense bf16 peak in TFLOP/s: `override` (--peak-tflops) when given, else the table's for a CUDA
    device it names, else None (a CPU, an unknown GPU: no MFU is reported)."""
    if override:
        return override
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in name), None)


def model_shape(model):
    """The numbers the formula needs -> dict(layer_params, head_params, layers, attn_width), from a causal LM or a
    model.ValueModel (FSDP2's sharded parameters count whole: DTensor.numel is the global size)."""
    config = model.config
    critic = hasattr(model, "value_head")  # model.ValueModel, read by its attributes: benches load older code
    layers = model.backbone.layers if critic else model.base_model.layers
    head = model.value_head if critic else model.get_output_embeddings()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return dict(layer_params=sum(p.numel() for p in layers.parameters()),
                head_params=sum(p.numel() for p in head.parameters()), layers=config.num_hidden_layers,
                attn_width=config.num_attention_heads * head_dim, frozen_base=hasattr(model, "lora_config"))


def training_flops(shape, seq_lens, response_lens):
    """Model FLOPs of forward + backward: 3 F. A frozen base (LoRA) gets no weight gradients: one F's share of the
    weights (2 P s + 2 P_head r) less; the adapters' own gradients, r / hidden of it, are left in."""
    f = forward_flops(shape, seq_lens, response_lens)
    return 3 * f - (forward_flops(dict(shape, attn_width=0), seq_lens, response_lens) if shape.get("frozen_base")
                    else 0.0)


def forward_flops(shape, seq_lens, response_lens):
    """Model FLOPs of one forward over packed sequences of seq_lens tokens with response_lens tokens through the
    head (lists or 1-D tensors of equal length). x3 for forward + backward."""
    s = torch.as_tensor(seq_lens, dtype=torch.float64)
    r = torch.as_tensor(response_lens, dtype=torch.float64)
    return float(2 * shape["layer_params"] * s.sum() + 2 * shape["head_params"] * r.sum()
                 + 2 * shape["layers"] * shape["attn_width"] * (s * s).sum())
