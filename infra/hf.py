"""Hugging Face model directories as the trainer reads them: the tokenizer, a causal LM (on the meta device for
sharding), the attention implementations the trainer computes and the model features it refuses, the decoder layers."""
import torch

from infra import packing
from infra.cli import die


def load_tokenizer(path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


ATTN_IMPLEMENTATIONS = (packing.VARLEN, "sdpa", "flash_attention_2", "eager")


def check_attn_implementation(name, device=None):
    """A bad --attn-implementation fails in one line, before any model is loaded."""
    import importlib.util

    if name not in ATTN_IMPLEMENTATIONS:
        die(f"--attn-implementation {name!r}: choose one of {', '.join(ATTN_IMPLEMENTATIONS)}")
    if name == "flash_attention_2":
        if importlib.util.find_spec("flash_attn") is None:
            die("--attn-implementation flash_attention_2: flash-attn is not installed "
                "(pip install -e '.[flash]' on a CUDA machine), or use varlen")
        if device is not None and torch.device(device).type != "cuda":
            die("--attn-implementation flash_attention_2 needs a CUDA device; use varlen on CPU")
    return name


def attention(name):
    """attn_implementation as transformers takes it: ours (varlen) registered first."""
    if name == packing.VARLEN:
        packing.register_varlen_attention()
    return name


def on_meta(auto_cls, path, dtype, attn):
    """auto_cls (AutoModelForCausalLM, AutoModel) built from the config at `path` on the meta device: no weights."""
    from transformers import AutoConfig

    with torch.device("meta"):
        return auto_cls.from_config(AutoConfig.from_pretrained(path), dtype=dtype, attn_implementation=attn)


def unsupported_features(config, attn_implementation, head=True):
    """What the trainer would silently compute differently from the model's own definition -> list of strings:
    under varlen attention a sliding window (Mistral-7B-v0.1, Gemma 2, Qwen2 with use_sliding_window) or attention
    logit soft-capping (Gemma 2); with an LM head (token_logprobs computes the logits itself) final-logit
    soft-capping. Attention sinks (gpt-oss) arrive only at run time: packing.varlen_attention refuses them there."""
    found = []
    if attn_implementation == packing.VARLEN:
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None:
            sliding = any(t in ("sliding_attention", "chunked_attention") for t in layer_types)
        else:
            sliding = bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True)
        if sliding:
            found.append(f"sliding-window attention (sliding_window={getattr(config, 'sliding_window', None)})")
        if getattr(config, "attn_logit_softcapping", None):
            found.append(f"attention logit soft-capping ({config.attn_logit_softcapping})")
    if head and getattr(config, "final_logit_softcapping", None):
        found.append(f"final logit soft-capping ({config.final_logit_softcapping})")
    return found


def refuse_unsupported(path, attn_implementation, head=True):
    """One line naming the model and what it needs (unsupported_features), before any weight is read."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    config = getattr(config, "text_config", None) or config
    if found := unsupported_features(config, attn_implementation, head):
        hint = ("; use --attn-implementation sdpa" if any(not f.startswith("final") for f in found)
                else ": this model cannot be trained here")
        die(f"{path}: the trainer does not compute {' or '.join(found)}{hint}")


def load_causal_lm(path, dtype=torch.float32, attn_implementation="sdpa", meta=False):
    """The causal LM at `path`; meta=True builds it from its config on the meta device, reading no weights
    (weights.load_sharded then fills each rank's shard). An attention the implementation does not compute: one
    line (refuse_unsupported; the log-prob head is checked where token_logprobs will run: train.py)."""
    from transformers import AutoModelForCausalLM

    refuse_unsupported(path, attn_implementation, head=False)
    attn = attention(attn_implementation)
    if meta:
        return on_meta(AutoModelForCausalLM, path, dtype, attn)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn)


def decoder_layers(model):
    """The decoder layers of a causal LM or a critic (model.ValueModel, which wraps its backbone)."""
    backbone = getattr(model, "backbone", None) or model.base_model
    return backbone.layers
