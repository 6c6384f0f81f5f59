"""LoRA (infra/lora.py), each against an independent computation: the formula by hand, the merged weights in a plain model,
PEFT's own loader, plain PyTorch for FSDP2 on 2 ranks; and train.py with --lora-rank end to end on 2 ranks."""
import json
import shutil

import pytest
import torch
from conftest import CPU_ENV, VALIDATE, metrics, run_script, train_args

from infra import checkpoint, hf, hf_export, lora
from train_setup import lora_mismatch

RANK, ALPHA = 4, 8.0


def adapted(model_dir, dtype=torch.float32, targets=lora.TARGETS, seed=0):
    m = hf.load_causal_lm(model_dir)
    return lora.adapt(m, hf.decoder_layers(m), RANK, ALPHA, targets, dtype, seed=seed).eval()


def perturb(m, seed=0):
    """Non-zero B in every adapter (B = 0 at the start makes every adapted model the base)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in lora.adapted_layers(m):
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=g) * 0.05)
    return m


def logits(m, ids):
    with torch.no_grad():
        return m(input_ids=ids).logits


def test_an_adapted_layer_computes_the_formula():
    """h = W x + b + (alpha / r) B A x, and W x + b with the adapters off."""
    torch.manual_seed(0)
    block = torch.nn.Module()
    block.q_proj = torch.nn.Linear(6, 5)
    w, bias = block.q_proj.weight.detach().clone(), block.q_proj.bias.detach().clone()
    lora.adapt(block, [block], rank=3, alpha=6.0, targets=("q_proj",), base_dtype=torch.float32)
    a, b = block.q_proj.lora_A.weight, block.q_proj.lora_B.weight
    with torch.no_grad():
        b.normal_()
    x = torch.randn(2, 4, 6)                                                       # [b, t, in]
    want = x @ w.T + bias + 2.0 * (x @ a.T @ b.T)
    assert torch.allclose(block.q_proj(x), want, atol=1e-6)
    with lora.adapters_off(block):
        assert torch.allclose(block.q_proj(x), x @ w.T + bias, atol=1e-6)
    assert [n for n, p in block.named_parameters() if p.requires_grad] == ["q_proj.lora_A.weight", "q_proj.lora_B.weight"]
    assert a.abs().max() <= 1 / 6 ** 0.5 and a.std() > 0  # nn.Linear's init bound, 1 / sqrt(in)


def test_the_adapted_model_starts_as_the_base_merges_exactly_and_switches_off(tiny_model_dir):
    ids = torch.randint(0, 5000, (2, 12), generator=torch.Generator().manual_seed(1))
    base = hf.load_causal_lm(tiny_model_dir).eval()
    m = adapted(tiny_model_dir)
    assert torch.equal(logits(m, ids), logits(base, ids))  # B = 0
    perturb(m)
    merged = hf.load_causal_lm(tiny_model_dir).eval()
    state = dict(merged.named_parameters())
    weights = dict(lora.merged_weights(m, torch.float32))
    assert list(weights) == list(state)  # the whole base, in its order (an engine that slept holds none of it)
    with torch.no_grad():
        for name, w in weights.items():
            state[name].copy_(w)
    assert (logits(m, ids) - logits(base, ids)).abs().max() > 1e-2  # the adapters change the model
    assert torch.allclose(logits(m, ids), logits(merged, ids), atol=1e-4)
    with lora.adapters_off(m):
        assert torch.equal(logits(m, ids), logits(base, ids))
    assert torch.allclose(logits(m, ids), logits(merged, ids), atol=1e-4)  # on again after the block


def test_the_base_is_frozen_in_the_compute_dtype_and_only_adapters_train(tiny_model_dir):
    m = adapted(tiny_model_dir, dtype=torch.bfloat16, targets=("q_proj", "v_proj"))
    trained = {n: p.dtype for n, p in m.named_parameters() if p.requires_grad}
    assert set(trained) == {f"model.layers.{i}.self_attn.{p}_proj.lora_{x}.weight" for i in range(2) for p in "qv"
                            for x in "AB"}
    assert set(trained.values()) == {torch.float32}
    assert {p.dtype for p in m.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert m.model.rotary_emb.inv_freq.dtype == torch.float32  # buffers keep theirs


def test_a_target_the_blocks_lack_is_named(tiny_model_dir):
    with pytest.raises(ValueError, match="c_attn is not a linear layer of the decoder blocks .*q_proj"):
        adapted(tiny_model_dir, targets=("q_proj", "c_attn"))
    assert lora.parse_targets("all-linear") == lora.TARGETS
    assert lora.parse_targets("q_proj, v_proj") == ("q_proj", "v_proj")


def test_the_export_is_the_merged_model_and_peft_loads_the_adapter(tiny_model_dir, tmp_path):
    """hf_export.save_hf of an adapted model: actor/ reloads as the merged model, adapter/ through PEFT's own
    PeftModel.from_pretrained on the base gives the adapted model's logits."""
    peft = pytest.importorskip("peft")
    m = perturb(adapted(tiny_model_dir))
    hf_export.save_hf(m, hf.load_tokenizer(tiny_model_dir), tmp_path / "actor", dtype=torch.float32,
                     adapter_dir=tmp_path / "adapter", base=tiny_model_dir)
    ids = torch.randint(0, 5000, (2, 12), generator=torch.Generator().manual_seed(2))
    want = logits(m, ids)
    reloaded = hf.load_causal_lm(tmp_path / "actor").eval()
    assert not any("lora" in n for n, _ in reloaded.named_parameters())
    assert torch.allclose(logits(reloaded, ids), want, atol=1e-4)
    config = json.loads((tmp_path / "adapter" / lora.PEFT_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (RANK, ALPHA, str(tiny_model_dir))
    with_peft = peft.PeftModel.from_pretrained(hf.load_causal_lm(tiny_model_dir), tmp_path / "adapter").eval()
    assert torch.allclose(logits(with_peft, ids), want, atol=1e-5)


def test_adapters_start_alike_and_train_as_plain_pytorch_on_two_ranks(tiny_model_dir, tmp_path, torchrun,
                                                                     two_rank_env):
    proc = torchrun("tests/_lora_worker.py", tiny_model_dir, tmp_path, env=two_rank_env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["trained"] == res["expected_trained"] and len(res["trained"]) == 28, res
    assert res["init_diff"] == 0.0, res  # each rank's rows of lora.initial_value, as a whole model draws it
    assert res["grad_max"] > 1e-3 and res["grad_diff"] < 1e-5, res
    assert res["a_moved"] > 1e-3 and res["step_diff"] < 1e-5, res
    assert res["frozen_moved"] == 0.0, res
    assert res["merged_names_equal"] and res["merged_diff"] < 1e-5, res


def test_resume_refuses_other_adapters_or_another_base(tiny_model_dir, tmp_path):
    base = checkpoint.base_digests(tiny_model_dir)
    saved = {"r": 4, "alpha": 32.0, "targets": list(lora.TARGETS), "base": "/models/x", "base_files": [base]}
    assert lora_mismatch(saved, dict(saved)) is None and lora_mismatch(None, None) is None
    assert lora_mismatch(None, saved) == "is a full fine-tune's checkpoint: resume it without --lora-rank"
    assert lora_mismatch(saved, None) == "holds LoRA adapters: resume with --lora-rank 4"
    assert lora_mismatch(saved, dict(saved, r=8, alpha=16.0)) == (
        "holds adapters of --lora-rank 4 --lora-alpha 32: resume with the flags it was trained with")
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    assert checkpoint.base_digests(other) == base  # the same files elsewhere: the same base
    f = other / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    f.write_bytes(bytes(data))
    assert lora_mismatch(saved, dict(saved, base_files=[checkpoint.base_digests(other)])) == (
        "was trained on another base than this --model (model.safetensors differ): resume with the model its "
        "adapters belong to (/models/x)")


# ----------------------------------------------------------------------------- train.py --lora-rank end to end

def lora_args(model_dir, out, *extra):
    # test_train's fp32 run with a higher LR (the adapters must move the policy), checkpoints at 2, validation at 3;
    # q and v only: two thirds of each of vLLM's fused qkv_proj layers are adapted, the rest must be synced whole
    return train_args(model_dir, out, 3, "--actor-lr", "1e-3", "--critic-lr", "1e-3", "--lora-rank", str(RANK),
                      "--lora-alpha", str(ALPHA), "--lora-targets", "q_proj,v_proj", "--save-freq", "2", *VALIDATE,
                      *extra)


@pytest.fixture(scope="module")
def lora_run(tiny_model_dir, tmp_path_factory, vllm_two_rank_env, torchrun):
    """3 steps of gae (the critic adapted too) on 2 ranks sharing one tensor-parallel engine, which samples with the
    merged weights synced after each step (each sleep destroys the engine's weights, as on a GPU); checkpoints at
    steps 2 and 3."""
    out = tmp_path_factory.mktemp("lora") / "run"
    proc = torchrun("train.py", *lora_args(tiny_model_dir, out, "--engine-tp", "2"), env=vllm_two_rank_env,
                    timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, proc


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_lora_training_samples_the_merged_adapters_and_checkpoints_only_them(lora_run, tiny_model_dir):
    out, proc = lora_run
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows[1:]:  # the engine samples what the trainer scores: the synced merge, to fp32 precision
        assert r["rollout/logprob_gap"] < 1e-4, r
        assert abs(r["kl/mean"]) > 1e-4, r  # the adapters moved the policy off the reference (the base; k1: signed)
    assert "Failed to load weights" not in proc.stderr and "were not loaded" not in proc.stderr
    ckpt = out / "step_000003"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert (state["lora"]["r"], state["lora"]["alpha"], state["lora"]["base"]) == (RANK, ALPHA, str(tiny_model_dir))
    stored = checkpoint.read_metadata(ckpt / "sharded").state_dict_metadata
    weights = {k for k in stored if ".model." in k.split("optim")[0] and not k.startswith(("actor.optim", "critic.optim"))}
    assert weights and all("lora_" in k or "value_head" in k for k in weights), sorted(weights)[:5]  # no base
    assert checkpoint.damage(ckpt) is None
    merged = hf.load_causal_lm(ckpt / "actor")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert json.loads((ckpt / "adapter" / lora.PEFT_CONFIG).read_text())["r"] == RANK
    r = run_script("eval.py", ckpt, "--benchmarks", "arith_test", "--limit", 2, "--max-response-tokens", 8,
                   "--engine", "hf", "--out", out / "eval", env=CPU_ENV, timeout=600)  # eval.py finds actor/
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "eval" / "summary.json").read_text())["models"] == {str(ckpt): str(ckpt / "actor")}


@pytest.mark.slow
@pytest.mark.vllm
def test_the_adapter_serves_in_vllm_on_its_base_as_the_merged_actor(lora_run, tiny_model_dir):
    """What a user serving the result does: vLLM on the base model named by adapter_config.json, the checkpoint's
    adapter/ through enable_lora and a LoRARequest. Greedy, fp32: the tokens the merged actor/ decodes; log-probs
    those of PEFT's own adapted base to float noise, and actor/'s to its bf16 rounding; the base alone is another
    model."""
    import os

    peft = pytest.importorskip("peft")
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    ckpt = lora_run[0] / "step_000003"
    base = json.loads((ckpt / "adapter" / lora.PEFT_CONFIG).read_text())["base_model_name_or_path"]
    assert base == str(tiny_model_dir)  # what --model named
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = LLM(model=base, dtype="float32", enable_lora=True, max_lora_rank=8, max_loras=1, enforce_eager=True,
              max_model_len=256, kv_cache_memory_bytes=2**30, block_size=32, enable_chunked_prefill=False,
              max_num_batched_tokens=4096)
    try:
        tok = hf.load_tokenizer(base)
        prompts = [tok.encode(f"What is {i} + {3 * i}? Answer:") for i in range(4)]
        params = SamplingParams(max_tokens=12, temperature=0, logprobs=0)
        served = {name: [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                           lora_request=request, use_tqdm=False)]
                  for name, request in (("adapter", LoRARequest("actor", 1, str(ckpt / "adapter"))), ("base", None))}
    finally:
        llm.llm_engine.engine_core.shutdown()
    models = {"peft": peft.PeftModel.from_pretrained(hf.load_causal_lm(base), ckpt / "adapter").eval(),
              "actor": hf.load_causal_lm(ckpt / "actor").eval()}
    gaps = {}
    for (model, served_by), outs in [((m, s), served[s]) for m in models for s in served]:
        gap = 0.0
        for p, o in zip(prompts, outs):
            with torch.no_grad():
                logp = models[model](input_ids=torch.tensor([p + list(o.token_ids)])).logits[0, len(p) - 1:-1]
            logp = logp.float().log_softmax(-1)                                                  # [R, V]
            if (model, served_by) == ("actor", "adapter"):
                assert logp.argmax(-1).tolist() == list(o.token_ids)  # what actor/ decodes greedily
            mine = logp.gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0]
            vllm = torch.tensor([lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)])
            gap = max(gap, float((mine - vllm).abs().max()))
        gaps[f"{served_by} vs {model}"] = gap
    print("adapter served by vLLM, largest log-prob gap per token:", {k: f"{v:.1e}" for k, v in gaps.items()})
    assert gaps["adapter vs peft"] < 1e-4 and gaps["adapter vs actor"] < 1e-2, gaps
    assert gaps["base vs peft"] > 100 * max(gaps["adapter vs peft"], 1e-6), gaps


@pytest.mark.slow
@pytest.mark.timeout(1900)
def test_lora_resume_on_one_rank_reproduces_the_two_rank_run(lora_run, tiny_model_dir, tmp_path):
    """Step 2's adapters, optimiser state and the base verified by its digests, resumed on 1 rank with an engine of
    its own: step 3 is the 2-rank run's (the same samples, validation and update)."""
    full, _ = lora_run
    out = tmp_path / "resumed"
    out.mkdir()
    shutil.copytree(full / "step_000002", out / "step_000002")
    (out / "latest").symlink_to("step_000002")
    proc = run_script("train.py", *lora_args(tiny_model_dir, out, "--resume"), env=CPU_ENV, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want, got = metrics(full)[-1], metrics(out)[-1]
    assert got["step"] == want["step"] == 3
    for key in ("reward/mean", "decoded_tokens/mean", "val/acc", "val/decoded_tokens"):
        assert got[key] == want[key], key
    for key in ("loss/pg", "loss/vf", "kl/mean", "actor/entropy", "actor/approx_kl", "actor/grad_norm"):
        assert got[key] == pytest.approx(want[key], abs=1e-4), key


@pytest.mark.slow  # a train.py start
def test_bad_lora_flags_are_one_line_before_anything_is_written(tiny_model_dir, tmp_path):
    """--dtype auto (not yet resolved when the targets are checked): a target the blocks lack, and bad numbers."""
    base = ["--model", tiny_model_dir, "--data", "arith_train", "--out", tmp_path / "out", "--steps", "1"]
    for extra, needle in ((["--lora-rank", "4", "--lora-targets", "q_proj,c_attn"],
                           "error: --lora-targets: c_attn is not a linear layer of the decoder blocks (they have: "),
                          (["--lora-rank", "-1"], "error: --lora-rank must be >= 0")):
        proc = run_script("train.py", *base, *extra, env=CPU_ENV, timeout=300)
        errors = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode != 0 and len(errors) == 1 and errors[0].startswith(needle), proc.stderr[-2000:]
        assert not (tmp_path / "out").exists()
