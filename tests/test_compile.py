"""--compile (model.compile_model) against the eager model: the same log-probs, entropies, values and gradients over
micro-batches of different packed lengths, compiled once rather than per micro-batch; train.py --compile takes the
same step as without; a machine without a compiler gets one line."""
import copy
import json
import os

import pytest
import torch
from conftest import run_script
from test_packing import trajectories
from torch._dynamo.testing import CompileCounterWithBackend

import model as M
from infra import hf, packing

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.slow  # inductor compiles C++ (CPU) or Triton (CUDA) kernels: seconds to a minute
needs_compiler = pytest.mark.skipif(M.compiler_missing(DEVICE) is not None,
                                    reason=f"torch.compile on {DEVICE}: {M.compiler_missing(DEVICE)}")

BATCHES = [(0, 5), (1, 2), (2, 4), (3, 5)]  # (seed, rows): four packed lengths, sequence counts unlike head counts


def close(got, want, name):
    scale = max(1.0, want.abs().max().item())
    assert (got - want).abs().max().item() < 2e-5 * scale, (name, (got - want).abs().max().item())


def run_pair(eager, compiled, loss_fn, device):
    """Both models through the same micro-batches -> the compiler's frame count after each micro-batch."""
    frames = []
    for seed, rows in BATCHES:
        batch = trajectories(seed, rows)
        mb = packing.pack(batch, torch.arange(rows), device)
        w = torch.randn(mb["response_mask"].shape, generator=torch.Generator().manual_seed(seed)).to(device)
        outs = []
        for m in (eager, compiled):
            m.zero_grad(set_to_none=True)
            out = loss_fn(m, mb)                                   # tuple of [b, r]
            sum((o * w).sum() for o in out).backward()
            outs.append(out)
        for i, (got, want) in enumerate(zip(outs[1], outs[0])):
            close(got.detach(), want.detach(), f"output {i}, batch {seed}")
        for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
            assert p.grad is not None and p.grad.abs().max() > 0, name
            close(q.grad, p.grad, name)
        frames.append(compiled.counter.frame_count)
    return frames


def compiled_copy(model):
    """A compiled deep copy of model whose .counter counts the frames inductor compiles."""
    compiled = copy.deepcopy(model)
    compiled.counter = CompileCounterWithBackend("inductor")
    return M.compile_model(compiled, backend=compiled.counter)


def pair(build, device):
    """(eager, compiled copy), activation checkpointing on in both: the update's --grad-checkpointing path."""
    eager = build().to(device).train()
    backbone = eager.backbone if isinstance(eager, M.ValueModel) else eager
    backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return eager, compiled_copy(eager)


@needs_compiler
def test_compiled_logprobs_entropy_and_gradients_equal_eager(tiny_model_dir):
    eager, compiled = pair(lambda: hf.load_causal_lm(tiny_model_dir, attn_implementation="varlen"), DEVICE)
    frames = run_pair(eager, compiled,
                      lambda m, mb: M.token_logprobs(m, mb, 0.7, with_entropy=True, chunk_size=6), DEVICE)
    # compiled once with symbolic lengths: later micro-batches add at most a specialisation (a 1-token head chunk),
    # not a second copy of every graph
    assert 0 < frames[0] <= frames[-1] < 2 * frames[0], f"frames compiled after each micro-batch: {frames}"
    with torch.no_grad():  # the reference / old log-prob pass: its own graphs, the same numbers
        mb = packing.pack(trajectories(), torch.arange(5), DEVICE)
        close(M.token_logprobs(compiled, mb, 0.7), M.token_logprobs(eager, mb, 0.7), "no-grad log-probs")


@needs_compiler
def test_compiled_critic_values_and_gradients_equal_eager(tiny_model_dir):
    def critic():
        c = M.load_critic(tiny_model_dir, attn_implementation="varlen")
        with torch.no_grad():
            torch.nn.init.normal_(c.value_head.weight, std=0.5)
        return c
    eager, compiled = pair(critic, DEVICE)
    frames = run_pair(eager, compiled, lambda m, mb: (m(mb),), DEVICE)
    assert 0 < frames[0] <= frames[-1] < 2 * frames[0], frames


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's varlen flash kernel runs on CUDA only")
@needs_compiler
def test_compiled_varlen_kernel_on_cuda_in_bf16(tiny_model_dir):
    """The path --compile is for: bf16 on CUDA, where the layers trace through torch's varlen kernel (a custom op).
    bf16 rounding differs between fused and unfused kernels, so the bound is loose (as the eager kernel's test)."""
    eager = hf.load_causal_lm(tiny_model_dir, dtype=torch.bfloat16, attn_implementation="varlen").to("cuda")
    compiled = compiled_copy(eager)
    for seed, rows in BATCHES:
        mb = packing.pack(trajectories(seed, rows), torch.arange(rows), "cuda")
        want, got = (M.token_logprobs(m, mb, 0.7) for m in (eager, compiled))
        assert (got - want).abs().max() < 0.05 * want.abs().max(), (got - want).abs().max()
        got.sum().backward()
    assert all(p.grad is not None for p in compiled.parameters())
    assert 0 < compiled.counter.frame_count


def train_args(model_dir, out, *extra):
    return ["--model", str(model_dir), "--data", "arith_train", "--out", str(out), "--steps", "1", "--batch-size", "4",
            "--samples-per-prompt", "2", "--max-turns", "1", "--turn-tokens", "8", "--micro-batch-size", "2",
            "--mini-batch-size", "4", "--actor-lr", "1e-4", "--critic-lr", "1e-4", "--actor-warmup-ratio", "0",
            "--dtype", "float32", "--engine-dtype", "float32", "--engine", "hf", *extra]


@pytest.mark.skipif(M.compiler_missing("cpu") is not None, reason="torch.compile on the CPU: no C++ compiler")
def test_train_with_compile_takes_the_eager_step(tiny_model_dir, tmp_path):
    """One step (GAE: actor, reference and critic compiled; two optimiser steps, so the second mini-batch runs the
    updated weights) with --compile --grad-checkpointing against the same step eager: every training metric equal."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    rows = {}
    for name, extra in (("eager", ()), ("compiled", ("--compile", "--grad-checkpointing"))):
        proc = run_script("train.py", *train_args(tiny_model_dir, tmp_path / name, *extra), env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows[name] = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[-1])
    keys = [k for k, v in rows["eager"].items() if k.split("/")[0] in ("actor", "critic", "loss", "kl", "rollout")
            and v is not None]
    assert {"actor/grad_norm", "critic/grad_norm", "actor/entropy", "loss/vf"} <= set(keys), keys
    for k in keys:
        assert rows["compiled"][k] == pytest.approx(rows["eager"][k], rel=1e-4, abs=1e-7), k


def test_compile_without_a_compiler_is_one_line(tiny_model_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CXX"}
    env.update(PATH=str(tmp_path), CUDA_VISIBLE_DEVICES="")  # an empty PATH: no g++, c++ or clang++
    proc = run_script("train.py", *train_args(tiny_model_dir, tmp_path / "out", "--compile"), env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --compile: no C++ compiler"), proc.stderr
    assert not (tmp_path / "out").exists()
