"""Packed micro-batches: every trainer forward computes real tokens only.

A micro-batch's sequences (each one's prompt then its response, no padding) are concatenated into one row
[1, T]; position ids restart at 0 for each sequence, and attention stays inside each sequence (cu_seq_lens,
the cumulative sequence lengths flash-attention's varlen kernels take). What the model computes per token
(log-probs, entropies, values) comes back on the response-aligned layout [b, r] that ppo.py works on, zero
where a row has no response token.

  micro_batches     rows -> micro-batches, by row count or by token budget, as many on every rank (FSDP)
  pack              one micro-batch -> the packed model inputs + its response-aligned tensors
  forward_pass      a no-grad function over every micro-batch of a batch -> [B, R]
  varlen_attention  the transformers attention function for packed rows (--attn-implementation varlen)
"""
import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

VARLEN = "varlen"  # the name transformers knows our attention function by


# ----------------------------------------------------------------------------- micro-batches

def sequence_lengths(batch, rows):
    """Real tokens (prompt + response) of each row. [b]"""
    return batch["prompt_mask"][rows].sum(1) + batch["response_mask"][rows].sum(1)


def micro_batches(batch, rows, size=None, tokens=None, device=None):
    """Split rows (a tensor of row indices) into micro-batches -> list of row-index tensors.

    size: at most `size` rows each, in the given order. tokens: each filled up to `tokens` real tokens (first-fit
    decreasing; a sequence longer than the budget goes alone), like veRL's ppo_max_token_len_per_gpu. FSDP gathers
    each layer's weights inside every forward and backward, so every rank must make the same number of calls: with a
    budget, each rank splits its fullest micro-batches until it has as many as the rank that needs the most (a
    collective; every rank holds as many rows, so this always fits)."""
    if tokens is None:
        return list(rows.split(size))
    lengths = sequence_lengths(batch, rows).tolist()
    bins = []  # [tokens, [positions in rows]]
    for i in sorted(range(len(rows)), key=lambda i: -lengths[i]):
        fit = next((b for b in bins if b[0] + lengths[i] <= tokens), None)
        if fit is None:
            bins.append([lengths[i], [i]])
        else:
            fit[0] += lengths[i]
            fit[1].append(i)
    want = len(bins)
    if dist.is_initialized() and dist.get_world_size() > 1:
        n = torch.tensor([want], device=device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        want = int(n)
    while len(bins) < want:
        splittable = [b for b in bins if len(b[1]) > 1]
        if not splittable:
            raise ValueError(f"{len(rows)} rows cannot make the {want} micro-batches another rank needs")
        fullest = max(splittable, key=lambda b: b[0])
        bins.remove(fullest)
        halves = [[0, []], [0, []]]
        for i in fullest[1]:  # longest first: each to the lighter half
            half = min(halves, key=lambda h: h[0])
            half[0] += lengths[i]
            half[1].append(i)
        bins += halves
    return [rows[sorted(b[1])] for b in bins]


def pack(batch, rows, device):
    """One micro-batch of the trainer batch (rollout.to_batch's layout: prompts left-padded [B, P], responses
    right-padded [B, R]) -> dict:
      input_ids, position_ids  [1, T]   the rows' real tokens back to back; positions restart per sequence
      cu_seq_lens              [b + 1]  int32 sequence boundaries in the packed row; max_length: the longest
      token_index              [N]      packed position whose hidden state predicts each response token
      response_mask            [b, r]   bool, where those N tokens sit on the response-aligned layout
      every other [B, R] tensor of the batch cut to [b, r] (action_mask, advantages, ...), r the rows' longest
    all on `device`."""
    prompt_mask = batch["prompt_mask"][rows].bool()                              # [b, P]
    response_mask = batch["response_mask"][rows].bool()                          # [b, R]
    r = max(int(response_mask.sum(1).max()), 1)
    response_mask = response_mask[:, :r]                                         # [b, r]
    ids = torch.cat([batch["prompt_ids"][rows], batch["response_ids"][rows][:, :r]], 1)  # [b, P + r]
    real = torch.cat([prompt_mask, response_mask], 1)                            # [b, P + r]
    p_len, r_len = prompt_mask.sum(1), response_mask.sum(1)                      # [b]
    seq_len = p_len + r_len                                                      # [b]
    cu = F.pad(seq_len.cumsum(0), (1, 0))                                        # [b + 1]
    T, N = int(cu[-1]), int(r_len.sum())
    position_ids = torch.arange(T) - cu[:-1].repeat_interleave(seq_len)          # [T]
    first = (cu[:-1] + p_len - 1).repeat_interleave(r_len)                       # [N] predictor of token 0
    within = torch.arange(N) - F.pad(r_len.cumsum(0), (1, 0))[:-1].repeat_interleave(r_len)  # [N] t
    out = {k: v[rows][:, :r] for k, v in batch.items()
           if torch.is_tensor(v) and v.dim() == 2 and k not in ("prompt_ids", "prompt_mask", "response_mask")}
    out.update(input_ids=ids[real][None], position_ids=position_ids[None], cu_seq_lens=cu.to(torch.int32),
               token_index=first + within, response_mask=response_mask)
    out = {k: v.to(device, non_blocking=True) for k, v in out.items()}
    out["max_length"] = int(seq_len.max())
    return out


def from_padded(input_ids, attention_mask, response_start):
    """pack() for a padded [B, L] layout whose first response_start columns are the prompt (left-padded) and
    the rest the response (right-padded): scripts and tests that hold such tensors."""
    batch = dict(prompt_ids=input_ids[:, :response_start], prompt_mask=attention_mask[:, :response_start],
                 response_ids=input_ids[:, response_start:], response_mask=attention_mask[:, response_start:])
    return pack(batch, torch.arange(len(input_ids)), input_ids.device)


def model_inputs(mb):
    """The keyword arguments of a transformers forward over a packed micro-batch. cu_seq_lens_* and max_length_*
    reach the attention function (varlen_attention, flash_attention_2); sdpa and eager ignore them and build a
    block-causal mask from the restarting position ids instead (slower, same result)."""
    return dict(input_ids=mb["input_ids"], position_ids=mb["position_ids"], cu_seq_lens_q=mb["cu_seq_lens"],
                cu_seq_lens_k=mb["cu_seq_lens"], max_length_q=mb["max_length"], max_length_k=mb["max_length"])


def unpack(values, mb):
    """[N] values of the response tokens -> [b, r] on the response-aligned layout, 0 elsewhere."""
    return values.new_zeros(mb["response_mask"].shape).masked_scatter(mb["response_mask"], values)


def padding_counts(batch, groups):
    """{"padding", "computed"}: the tokens pack() feeds the model for these micro-batches (packed again here, on the
    CPU), and how many of them are padding: none, unless the layout regresses."""
    computed = sum(pack(batch, rows, "cpu")["input_ids"].numel() for rows in groups)
    real = sum(int(batch["prompt_mask"][rows].sum() + batch["response_mask"][rows].sum()) for rows in groups)
    return {"padding": computed - real, "computed": computed}


def forward_pass(fn, batch, autocast, device, size=None, tokens=None, desc=None, check=None):
    """fn(packed micro-batch) -> [b, r], without gradients, over every micro-batch (micro_batches) -> [B, R] on the
    batch's full width, in batch order. desc: a transient progress bar with this label (None: no bar). check: called
    before each micro-batch (train.py's faults.Guard.check: may end the pass)."""
    B, R = batch["response_ids"].shape
    out = torch.zeros(B, R)
    for rows in tqdm(micro_batches(batch, torch.arange(B), size, tokens, device), desc=desc, disable=desc is None,
                     leave=False, unit="micro"):
        if check is not None:
            check()
        with torch.no_grad(), autocast():
            res = fn(pack(batch, rows, device)).float()   # [b, r]
        out[rows, :res.shape[1]] = res.cpu()
    return out


# ----------------------------------------------------------------------------- attention over packed rows

def _torch_varlen():
    """torch's varlen flash-attention entry (2.10+) as f(q, k, v, cu, max_len, scale, gqa) -> out, or None. Its
    signature moved between releases: 2.10 has `is_causal` and no `scale` (always head_dim ** -0.5), 2.11 has
    `window_size` and `scale`; run.takes_scale says whether another scaling can be passed."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}  # 2.11 / 2.10
    has_gqa, takes_scale = "enable_gqa" in params, "scale" in params

    def run(q, k, v, cu, max_len, scale, groups):
        if groups > 1 and not has_gqa:
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        extra = {"enable_gqa": True} if groups > 1 and has_gqa else {}
        if takes_scale:
            extra["scale"] = scale
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **causal, **extra)
    run.takes_scale = takes_scale
    return run


_VARLEN_KERNEL = []  # resolved once per process (register_varlen_attention), outside any torch.compile trace


def _varlen_kernel():
    if not _VARLEN_KERNEL:
        _VARLEN_KERNEL.append(_torch_varlen())
    return _VARLEN_KERNEL[0]


def kernel_takes(kernel, scaling, head_dim):
    """Can `kernel` (_torch_varlen's run) compute this attention? A kernel without a `scale` argument only where the
    model's scaling is its default, head_dim ** -0.5."""
    return kernel is not None and (kernel.takes_scale or scaling is None
                                   or abs(scaling - head_dim ** -0.5) <= 1e-6 * head_dim ** -0.5)


_BOUNDS = [None, None]  # (cu_seq_lens tensor, its host list): one device sync per forward, not one per layer


def _bounds(cu):
    if _BOUNDS[0] is not cu:
        _BOUNDS[:] = [cu, cu.tolist()]
    return _BOUNDS[1]


@torch.compiler.disable  # a Python loop over the sequences: run as is, not traced again for every sequence count
def _per_sequence_sdpa(query, key, value, cu, scaling):
    bounds, groups = _bounds(cu), query.shape[1] // key.shape[1]
    # On CPU, SDPA's GQA is a fused path. On a GPU, flash and cuDNN take no fp32 and the memory-efficient kernel no
    # GQA: with enable_gqa, fp32 would fall to the math backend and its [Hq, s, s] fp32 scores. Expand k/v instead.
    gqa = groups > 1 and query.device.type == "cpu"
    if groups > 1 and not gqa:
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)  # [1, Hq, T, D]
    return torch.cat([F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e],
                                                     is_causal=True, scale=scaling, enable_gqa=gqa)
                      for s, e in zip(bounds[:-1], bounds[1:])], 2)              # [1, Hq, T, D]


# Attention variants a model may ask for that varlen_attention does not compute: refused, never dropped
UNSUPPORTED = {"sliding_window": "sliding-window attention", "softcap": "attention logit soft-capping",
               "s_aux": "attention sinks"}


def unsupported_variant(module, kwargs):
    """The first attention variant this call asks for that varlen_attention cannot compute, or None. Models pass
    them as keywords (Mistral: sliding_window=, Gemma 2: softcap=, gpt-oss: s_aux=) or hold them on the module."""
    for name, what in UNSUPPORTED.items():
        if kwargs.get(name) is not None or getattr(module, name, None) is not None:
            return f"{what} ({name}={kwargs.get(name, getattr(module, name, None))!r})"
    return None


def varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, cu_seq_lens_q=None,
                     max_length_q=None, **kwargs):
    """Causal attention inside each sequence of a packed row: query [1, Hq, T, D], key/value [1, Hkv, T, D] ->
    ([1, T, Hq, D], None). On CUDA in bf16/fp16, torch's varlen flash kernel (no flash-attn package needed; a custom
    op, so --compile traces through it); elsewhere (CPU, fp32) one causal SDPA call per sequence, which computes no
    cross-sequence scores either. Without cu_seq_lens_q the row is one sequence."""
    if query.shape[0] != 1 or attention_mask is not None:
        raise ValueError("--attn-implementation varlen takes packed rows (packing.pack) without an attention mask")
    if variant := unsupported_variant(module, kwargs):
        raise ValueError(f"--attn-implementation varlen has no {variant}; use sdpa")
    T, hq, hkv = query.shape[2], query.shape[1], key.shape[1]
    cu = cu_seq_lens_q if cu_seq_lens_q is not None else torch.tensor([0, T], dtype=torch.int32, device=query.device)
    kernel = _varlen_kernel()
    if (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)
            and kernel_takes(kernel, scaling, query.shape[-1])):
        q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))  # [T, H, D]
        return kernel(q, k, v, cu, max_length_q or T, scaling, hq // hkv)[None], None
    return _per_sequence_sdpa(query, key, value, cu, scaling).transpose(1, 2).contiguous(), None


def register_varlen_attention():
    """Make `attn_implementation="varlen"` known to transformers (idempotent). Registered under the attention
    interface only, so transformers builds no mask for it (its mask interface does not know the name)."""
    from transformers import AttentionInterface

    _varlen_kernel()
    AttentionInterface.register(VARLEN, varlen_attention)
