"""Shared fixtures and helpers: models built once per session, the torchrun launcher, the subprocess runner,
and the `vllm` / `dist` markers set from the fixtures a test uses (`make test-fast` deselects them)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import model  # the flat top-level modules: on the path through pyproject's `pythonpath`

ROOT = Path(__file__).resolve().parents[1]
# vLLM's CPU engines zero their whole KV cache at start (infra/engines.py's default: 2 GiB); the tests' contexts fit in 1
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
CPU_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # ranks on CPU tensors, gloo

# A test that uses one of these fixtures, directly or through another fixture, gets these markers.
MARKS_BY_FIXTURE = {"torchrun": ("dist",), "vllm_two_rank_env": ("vllm", "dist"),
                    "vllm_engine": ("vllm",), "smol_engine": ("vllm",)}  # the engines of test_rollout, test_eval


# The longest files, longest first (two workers on 2 cores: test_faults about 520 s of test time down to test_resume
# 70 s; test_compile as on a fresh machine, whose empty inductor cache costs it about 80 s more), started first: `make
# test`'s two workers (pytest-xdist, a file at a time) then end together, not one on a file taken last.
LONGEST_FIRST = ("test_faults.py", "test_train.py", "test_eval_scale.py", "test_multirank.py", "test_compile.py",
                 "test_rollout.py", "test_eval.py", "test_lora.py", "test_resume.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's tests keep their order
    for item in items:
        for name in sorted(MARKS_BY_FIXTURE.keys() & set(getattr(item, "fixturenames", ()))):
            for mark in MARKS_BY_FIXTURE[name]:
                item.add_marker(mark)


def pytest_runtest_setup(item):
    """Every test marked vllm (by a fixture or by hand) skips with its reason printed where vLLM is missing, e.g. a
    GPU machine with PyTorch alone: the trainer's tests still run there."""
    if "vllm" in item.keywords and importlib.util.find_spec("vllm") is None:
        print(f"SKIP: {item.name}: vLLM is not installed", file=sys.stderr)
        pytest.skip("vLLM is not installed")


def run_script(script, *argv, env=None, cwd=ROOT, timeout=300):
    """`python SCRIPT ARGV...` (a path, or a name under the repository root) -> CompletedProcess, text output."""
    return subprocess.run([sys.executable, str(ROOT / script), *map(str, argv)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ----------------------------------------------------------------------------- train.py runs on the tiny model

def train_args(model_dir, out, steps, *extra):
    # fp32 everywhere and a high LR: the run must change the weights, and resume must match to 1e-4
    return ["--model", str(model_dir), "--data", "arith_train", "--out", str(out), "--steps", str(steps),
            "--batch-size", "4", "--samples-per-prompt", "2", "--max-turns", "1", "--turn-tokens", "8",
            "--micro-batch-size", "4", "--mini-batch-size", "4", "--actor-lr", "1e-4", "--critic-lr", "1e-4",
            "--actor-warmup-ratio", "0", "--dtype", "float32", "--engine-dtype", "float32", "--enforce-eager",
            *extra]


VALIDATE = ["--val-data", "arith_test", "--val-limit", "4", "--val-freq", "3"]  # greedy, after step 3


def metrics(out):
    return [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]


@pytest.fixture(scope="session")
def torchrun():
    """torchrun(script, *argv, env=CPU_ENV, nproc=2, timeout=600) -> CompletedProcess: `nproc` ranks on this
    machine (--standalone), from the repository root."""
    def launch(script, *argv, env=CPU_ENV, nproc=2, timeout=600):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(ROOT / script), *map(str, argv)]
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return launch


@pytest.fixture(scope="session")
def smollm2_dir():
    """The embedded SmolLM2-135M-Instruct directory (prepared on first use)."""
    return model.resolve_model("smollm2")


# The tests' tiny Llama: 2 layers, hidden 64, 2 heads of 32 (vLLM's CPU attention rejects 16; --engine-tp 2 needs 2
# KV heads). Its tied 49,152-row embedding is most of its weights: half the width halves every checkpoint that a test
# writes and hashes, and the head's matmuls. (Grouped KV heads: the Qwen2-shaped tiny model of test_rollout.)
TINY = dict(hidden=64, heads=2, kv_heads=2, intermediate=128)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random tiny Llama (TINY) with the SmolLM2 tokenizer, fp32."""
    return model.make_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=0, **TINY)


@pytest.fixture(scope="session")
def two_rank_env():
    """Environment for 2 ranks without vLLM: one GPU per rank where there are 2, else both on the CPU (gloo)."""
    import torch

    return {**os.environ, "OMP_NUM_THREADS": "1"} if torch.cuda.device_count() >= 2 else dict(CPU_ENV)


@pytest.fixture(scope="session")
def vllm_two_rank_env(two_rank_env):
    """Environment for a 2-rank torchrun test with a vLLM engine per rank; skips (with the reason printed)
    where that cannot run. vLLM's CPU build: both ranks on CPU with gloo. Its CUDA build cannot be forced
    onto the CPU, so 2 ranks need 2 GPUs (one per rank)."""
    import torch

    try:
        from vllm.platforms import current_platform
    except ImportError as e:
        reason = f"vLLM is not installed ({e})"
    else:
        if current_platform.is_cpu():
            return dict(CPU_ENV)
        if torch.cuda.device_count() >= 2:
            return two_rank_env
        reason = f"2 ranks with vLLM's CUDA build need 2 GPUs, found {torch.cuda.device_count()}"
    print(f"SKIP: {reason}", file=sys.stderr)
    pytest.skip(reason)


def make_scripted_model(out_dir, text, then="loop", seed=0):
    """A 2-layer Llama whose greedy output is `text` written by real weights, then again and again (then="loop") or
    an end-of-turn token (then="stop"): the layers add nothing to the residual stream (o_proj and down_proj zero),
    so each next token is a function of the current one alone, set in the untied lm_head. `text` starts with the
    chat template's last token ('\\n', after 'assistant'); a token may appear once in it, except that the first
    may come again as its last (then each occurrence is followed alike)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(model.resolve_model("smollm2"))
    ids = tok.encode(text, add_special_tokens=False)
    nxt = dict(zip(ids, ids[1:]))  # the successor of each token
    nxt[ids[-1]] = (nxt[ids[0]] if ids[-1] == ids[0] else ids[1]) if then == "loop" else tok.eos_token_id
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=False, dtype="float32", bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    net = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in net.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = net.model.embed_tokens.weight, net.lm_head.weight
        head.zero_()
        for a, b in nxt.items():
            head[b] += 50 * emb[a] / emb[a].norm()
    out_dir = Path(out_dir)
    net.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return str(out_dir)


@pytest.fixture(scope="session")
def answer_loop_models(tmp_path_factory):
    """Two scripted models (make_scripted_model) that answer at once: 'looper' then writes its answer paragraph
    again and again until a token limit stops it, 'stopper' ends its turn after the answer."""
    base = tmp_path_factory.mktemp("scripted")
    return {"looper": make_scripted_model(base / "looper", "\nAnswer: 7\n\n", then="loop"),
            "stopper": make_scripted_model(base / "stopper", "\nAnswer: 7", then="stop")}
