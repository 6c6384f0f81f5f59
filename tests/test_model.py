"""Tests for model.py, each against an independent computation: the full [B, L, V] log-softmax,
an unpadded copy of a padded row, plain (unsharded) PyTorch for FSDP2, a transformers reload."""
import json
from pathlib import Path

import pytest
import torch

import model as M
from infra import hf, hf_export, packing


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return hf.load_causal_lm(tiny_model_dir).eval()


def make_batch(B=3, P=7, R=9, seed=0):
    """Random ids; row 0 and 1 left-padded prompts, row 2 a right-padded response."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 5000, (B, P + R), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, :1] = 0
    mask[2, -2:] = 0
    ids[mask == 0] = 2  # pad id; must not matter
    return ids, mask, P


def naive_logprobs(m, ids, mask, P, temperature=1.0):
    """The textbook way: full logits, full fp32 log-softmax, gather."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = m(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, P - 1:-1].float() / temperature
    logp = torch.log_softmax(logits, -1)  # [B, R, V]
    return logp.gather(-1, ids[:, P:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.slow  # the 135M model on the CPU
def test_smollm2_generates(smollm2_dir):
    tok = hf.load_tokenizer(smollm2_dir)
    lm = hf.load_causal_lm(smollm2_dir).eval()  # fp32: faster than bf16 on CPUs without AMX
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert text.strip(), "empty generation"
    assert sum(c.isascii() for c in text) / len(text) > 0.9, text
    assert "paris" in text.lower(), text  # garbage weights would not know this


def test_tiny_forward(tiny, tiny_model_dir):
    assert len(hf.load_tokenizer(tiny_model_dir)) == tiny.config.vocab_size
    ids = torch.randint(0, tiny.config.vocab_size, (2, 12))
    with torch.no_grad():
        logits = tiny(input_ids=ids).logits
    assert logits.shape == (2, 12, tiny.config.vocab_size)
    assert torch.isfinite(logits).all() and logits.std() > 0


@pytest.mark.parametrize("temperature,chunk_size", [(1.0, 1024), (0.7, 5)])
def test_token_logprobs_matches_full_log_softmax(tiny, temperature, chunk_size):
    ids, mask, P = make_batch()
    with torch.no_grad():
        mb = packing.from_padded(ids, mask, P)
        logp, ent = M.token_logprobs(tiny, mb, temperature, with_entropy=True, chunk_size=chunk_size)
        want_logp, want_ent = naive_logprobs(tiny, ids, mask, P, temperature)
        only = M.token_logprobs(tiny, mb, temperature, chunk_size=chunk_size)
    resp = mask[:, P:].bool()  # row 2's last two response columns are padding: 0 there
    assert logp.shape == ent.shape == (3, 9) and not logp[~resp].any() and not ent[~resp].any()
    torch.testing.assert_close(logp[resp], want_logp[resp], atol=1e-5, rtol=0)
    torch.testing.assert_close(only[resp], want_logp[resp], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent[resp], want_ent[resp], atol=1e-5, rtol=1e-5)  # entropies are ~10 nats


def test_packed_row_gives_each_sequence_its_unpadded_logprobs(tiny):
    ids, mask, P = make_batch()
    seen = {}
    hook = tiny.register_forward_pre_hook(lambda mod, args, kwargs: seen.update(kwargs), with_kwargs=True)
    with torch.no_grad():
        logp = M.token_logprobs(tiny, packing.from_padded(ids, mask, P), chunk_size=4)
    hook.remove()
    # one row of the three sequences' real tokens (13, 15 and 14), positions restarting at each: RoPE is
    # shift-invariant, so check the positions themselves (absolute-position models need them)
    assert seen["input_ids"].shape == (1, 42) and seen["input_ids"][0].tolist() == ids[mask.bool()].tolist()
    assert seen["position_ids"][0].tolist() == list(range(13)) + list(range(15)) + list(range(14))
    assert seen["cu_seq_lens_q"].tolist() == [0, 13, 28, 42] and seen["max_length_q"] == 15
    with torch.no_grad():
        for row, pad in ((0, 3), (1, 1)):
            alone = ids[row:row + 1, pad:]  # the same row with no padding and no mask at all
            logits = tiny(input_ids=alone).logits[0, P - pad - 1:-1]
            want = torch.log_softmax(logits, -1).gather(-1, alone[0, P - pad:, None]).squeeze(-1)
            torch.testing.assert_close(logp[row], want, atol=1e-5, rtol=0)


def test_token_logprobs_gradient_matches_naive(tiny_model_dir):
    ids, mask, P = make_batch()
    weights = torch.randn(3, 9, generator=torch.Generator().manual_seed(1)) * mask[:, P:]
    grads = []
    for fn in ("chunked", "naive"):
        m = hf.load_causal_lm(tiny_model_dir).train()
        if fn == "chunked":
            logp, ent = M.token_logprobs(m, packing.from_padded(ids, mask, P), 0.7, with_entropy=True, chunk_size=5)
        else:
            logp, ent = naive_logprobs(m, ids, mask, P, 0.7)
        ((logp + 0.1 * ent) * weights).sum().backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[1].items():
        assert g.abs().max() > 0, name
        # fp32 round-off scales with the largest entry (the tied head's gradient reaches ~10)
        assert (grads[0][name] - g).abs().max() < 1e-5 * max(1.0, g.abs().max().item()), name


def test_values_alignment(tiny_model_dir):
    critic = M.load_critic(tiny_model_dir).eval()
    ids, mask, P = make_batch()
    with torch.no_grad():
        mb = packing.from_padded(ids, mask, P)
        assert critic(mb).abs().max() == 0  # zero-initialised head
        torch.nn.init.normal_(critic.value_head.weight, std=0.5)
        critic.value_head.bias.fill_(0.25)
        v = critic(mb)
        assert v.shape == (3, 9) and v.dtype == torch.float32
        # independent: the unpadded row through the backbone, read at position P-1+t for token t
        for row, pad in ((0, 3), (1, 1)):
            hidden = critic.backbone(input_ids=ids[row:row + 1, pad:]).last_hidden_state[0]
            want = hidden[P - pad - 1:-1] @ critic.value_head.weight[0] + 0.25
            torch.testing.assert_close(v[row], want, atol=1e-5, rtol=0)
        # the value before token t cannot see token t; the value after it can
        t = 4
        changed = ids.clone()
        changed[:, P + t] = (changed[:, P + t] + 1) % 5000
        v2 = critic(packing.from_padded(changed, mask, P))
    assert torch.equal(v2[:, :t + 1], v[:, :t + 1])
    assert (v2[:, t + 1] - v[:, t + 1]).abs().min() > 0


def test_critic_save_load_round_trip(tiny_model_dir, tmp_path):
    critic = M.load_critic(tiny_model_dir)
    with torch.no_grad():
        torch.nn.init.normal_(critic.value_head.weight, std=0.5)
        critic.backbone.norm.weight.mul_(1.5)  # the backbone must round-trip too, not only the head
    hf_export.save_critic(critic, tmp_path / "critic")
    again = M.load_critic(str(tmp_path / "critic"))
    ids, mask, P = make_batch()
    with torch.no_grad():
        mb = packing.from_padded(ids, mask, P)
        torch.testing.assert_close(again(mb), critic(mb), atol=0, rtol=0)
    # a critic directory is also a causal LM directory (e.g. --critic-model of a later run)
    assert hf.load_causal_lm(str(tmp_path / "critic")).config.vocab_size == critic.config.vocab_size


def test_save_hf_bf16_reloads_and_replaces(tiny, tiny_model_dir, tmp_path):
    tok = hf.load_tokenizer(tiny_model_dir)
    out = tmp_path / "export"
    hf_export.save_hf(tiny, tok, out)
    hf_export.save_hf(tiny, tok, out)  # an existing directory is replaced, not merged or refused
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in out.iterdir()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temp dirs left behind"
    reloaded = hf.load_causal_lm(str(out), dtype=torch.bfloat16)
    ids = torch.randint(0, 5000, (2, 10))
    with torch.no_grad():
        want = hf.load_causal_lm(tiny_model_dir, dtype=torch.bfloat16)(input_ids=ids).logits
        torch.testing.assert_close(reloaded(input_ids=ids).logits, want, atol=0, rtol=0)


def test_save_hf_shards_with_index_and_reloads_equal(tiny, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "export"
    hf_export.save_hf(tiny, hf.load_tokenizer(tiny_model_dir), out, dtype=torch.float32, max_shard_size="100KB")
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index.values()) == {p.name for p in shards}
    want = dict(tiny.named_parameters())
    assert set(index) == set(want) - {"lm_head.weight"}  # tied head: written once, as embed_tokens
    for shard in shards:  # the files themselves, read without transformers
        for name, t in load_file(shard).items():
            assert index[name] == shard.name and torch.equal(t, want[name].detach()), name
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    got = dict(reloaded.named_parameters())
    assert got.keys() == want.keys()
    for name, p in want.items():
        assert torch.equal(got[name], p.detach()), name
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()  # tied again


def test_check_model_decides_without_downloading(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # relative names below are no local paths
    hub_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert M.check_model(hub_id) == ("hub", hub_id)
    assert M.resolve_model(hub_id) == hub_id  # passed through: transformers and vLLM download it
    assert M.check_model("smollm2") == ("alias", "smollm2")
    (tmp_path / "ckpt" / "actor").mkdir(parents=True)
    (tmp_path / "ckpt" / "actor" / "config.json").write_text("{}")
    assert M.resolve_model("ckpt") == str(Path("ckpt") / "actor")
    assert M.resolve_model("ckpt/actor") == str(Path("ckpt") / "actor")
    (tmp_path / "org" / "name").mkdir(parents=True)  # exists locally, so it is no hub id
    (tmp_path / "runs").mkdir()  # runs/typo: a missing run directory under an existing folder, no hub id
    for bad in ("org/name", "/nonexistent/model", "a/b/c", "no-slash", "./x/y", "runs/typo"):
        with pytest.raises(SystemExit) as e:
            M.check_model(bad, flag="--critic-model")
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"error: --critic-model {bad}: not a Hugging Face model directory"), err


@pytest.fixture(scope="module")
def mid_model_dir(tmp_path_factory):
    """A random 4-layer Llama of 453 MB in fp32 (hidden 1024): weights well above the process's own noise."""
    return M.make_tiny(tmp_path_factory.mktemp("mid") / "model", hidden=1024, layers=4, heads=8, kv_heads=4,
                       intermediate=4096)


def test_two_ranks_load_only_their_shard(mid_model_dir, tiny_model_dir, tmp_path, torchrun, two_rank_env):
    """train.py's loading (weights.load_sharded) on 2 ranks: each rank's peak stays near its half of the weights
    (whole-then-shard, measured the same way, needs the full model), and the weights are the file's. A critic
    loads the same way, from a save_critic directory (its head) and from a causal LM (a zero head)."""
    full = sum(p.stat().st_size for p in Path(mid_model_dir).glob("*.safetensors"))
    critic = M.load_critic(tiny_model_dir)
    with torch.no_grad():
        torch.nn.init.normal_(critic.value_head.weight, std=0.5)
    hf_export.save_critic(critic, tmp_path / "critic")
    peaks = {}
    for mode, extra in (("sharded", [tmp_path / "critic"]), ("whole", [])):
        proc = torchrun("tests/_load_worker.py", mid_model_dir, tmp_path / f"{mode}.json", mode, *extra,
                        env=two_rank_env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        peaks[mode] = json.loads((tmp_path / f"{mode}.json").read_text())
    assert all(p >= full for p in peaks["whole"]), (peaks, full)  # the measurement sees a whole model
    assert all(p < 0.6 * full for p in peaks["sharded"]), (peaks, full)  # half of it, plus at most 10 %


def test_fsdp2_two_ranks_match_plain_pytorch(tiny_model_dir, tmp_path, torchrun, two_rank_env):
    proc = torchrun("tests/_fsdp_worker.py", tiny_model_dir, tmp_path, env=two_rank_env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads((tmp_path / "result.json").read_text())
    for kind in ("policy", "critic"):
        assert res[f"{kind}_names_equal"], res  # HF names, no wrapper prefixes
        assert res[f"{kind}_grad_max"] > 1e-3, res
        assert res[f"{kind}_grad_diff"] < 1e-5, res
        assert res[f"{kind}_param_moved"] > 1e-4, res  # the AdamW step did something
        assert res[f"{kind}_param_diff"] < 1e-5, res
    assert not res["saved_has_lm_head"], res  # tied: only embed_tokens, like save_pretrained
    assert res["reload_logits_diff"] < 1e-5 and res["reload_logprobs_diff"] < 1e-5, res
    assert res["reload_values_diff"] < 1e-5, res
