"""infra/packing.py against independent computations: the padded batch through plain transformers (attention mask,
full [B, L, V] log-softmax) for log-probs, entropies, values and gradients; a brute-force check of the token budget;
2 ranks with very different sequence lengths against one rank holding both."""
import pytest
import torch
from conftest import CPU_ENV, ROOT, run_script

import model as M
import rollout
import train
from infra import hf, packing, sharding


def trajectories(seed=0, n=5):
    """Rollout-like rows: prompts of different lengths, responses of 1-20 tokens, two with an intervention (action
    mask 0 inside the response), one with a one-token response."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, r) in enumerate([(4, 20), (9, 7), (6, 1), (3, 15), (8, 11)][:n]):
        action = [1] * r
        if i in (0, 3):
            action[5:9] = [0] * 4
        out.append(dict(prompt_ids=torch.randint(3, 4000, (p,), generator=g).tolist(),
                        response_ids=torch.randint(3, 4000, (r,), generator=g).tolist(), action_mask=action,
                        rollout_logprobs=[0.0] * r))
    return rollout.to_batch(out, pad_id=2)


def padded_reference(model, batch, temperature):
    """The padded layout through plain transformers: [B, P + R] with an attention mask and positions counted from
    each row's first real token; full log-softmax -> (logprobs [B, R], entropy [B, R], hidden [B, R, H])."""
    ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    P = batch["prompt_ids"].shape[1]
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, output_hidden_states=True)
    logp = torch.log_softmax(out.logits[:, P - 1:-1].float() / temperature, -1)        # [B, R, V]
    token = logp.gather(-1, batch["response_ids"][..., None]).squeeze(-1)              # [B, R]
    return token, -(logp.exp() * logp).sum(-1), out.hidden_states[-1][:, P - 1:-1]


@pytest.mark.parametrize("attn", ["varlen", "sdpa"])
def test_packed_logprobs_entropy_and_gradients_equal_the_padded_path(tiny_model_dir, attn):
    batch = trajectories()
    resp, act = batch["response_mask"].bool(), batch["action_mask"].float()              # [B, R]
    w = torch.randn(act.shape, generator=torch.Generator().manual_seed(1)) * act          # a loss on action tokens
    grads, got = [], []
    for path in ("packed", "padded"):
        m = hf.load_causal_lm(tiny_model_dir, attn_implementation=attn if path == "packed" else "eager").train()
        if path == "packed":
            logp, ent = M.token_logprobs(m, packing.pack(batch, torch.arange(5), "cpu"), 0.7, with_entropy=True,
                                         chunk_size=6)
        else:
            logp, ent, _ = padded_reference(m, batch, 0.7)
            logp, ent = logp * resp, ent * resp
        ((logp + 0.1 * ent) * w).sum().backward()
        got.append((logp.detach(), ent.detach()))
        grads.append({n: p.grad for n, p in m.named_parameters()})
    torch.testing.assert_close(got[0][0], got[1][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[0][1], got[1][1], atol=1e-5, rtol=1e-5)
    assert not got[0][0][~resp].any()  # nothing computed where there is no response token
    for name, g in grads[1].items():
        assert g.abs().max() > 0, name
        assert (grads[0][name] - g).abs().max() < 1e-5 * max(1.0, g.abs().max().item()), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's varlen flash kernel runs on CUDA only")
def test_varlen_kernel_on_cuda_matches_the_padded_path_in_bf16(tiny_model_dir):
    """The CUDA path of varlen_attention (torch's flash kernel, GQA) against padded SDPA with a mask, both bf16."""
    batch, device = trajectories(), torch.device("cuda")
    resp = batch["response_mask"].bool().to(device)
    out = []
    for path in ("packed", "padded"):
        m = hf.load_causal_lm(tiny_model_dir, dtype=torch.bfloat16,
                             attn_implementation="varlen" if path == "packed" else "sdpa").to(device)
        with torch.no_grad():
            if path == "packed":
                out.append(M.token_logprobs(m, packing.pack(batch, torch.arange(5), device), 0.7))
            else:
                on_device = {k: v.to(device) for k, v in batch.items()}
                out.append(padded_reference(m, on_device, 0.7)[0] * resp)
    assert (out[0] - out[1]).abs().max() < 0.05 * out[1].abs().max(), (out[0] - out[1]).abs().max()


def test_packed_values_equal_the_padded_path(tiny_model_dir):
    batch = trajectories()
    critic = M.load_critic(tiny_model_dir, attn_implementation="varlen")
    with torch.no_grad():
        torch.nn.init.normal_(critic.value_head.weight, std=0.5)
        critic.value_head.bias.fill_(0.25)
        v = critic(packing.pack(batch, torch.arange(5), "cpu"))                               # [B, R]
        plain = hf.load_causal_lm(tiny_model_dir, attn_implementation="eager")
        plain.model.load_state_dict(critic.backbone.state_dict())
        _, _, hidden = padded_reference(plain, batch, 1.0)
        want = (hidden @ critic.value_head.weight[0] + 0.25) * batch["response_mask"]
    torch.testing.assert_close(v, want, atol=1e-5, rtol=0)


def test_pack_layout():
    batch = trajectories()
    rows = torch.tensor([4, 1, 2])
    mb = packing.pack(batch, rows, "cpu")
    lengths = [8 + 11, 9 + 7, 6 + 1]
    assert mb["input_ids"].shape == (1, sum(lengths)) and mb["cu_seq_lens"].tolist() == [0, 19, 35, 42]
    assert mb["position_ids"][0].tolist() == [i for n in lengths for i in range(n)] and mb["max_length"] == 19
    assert mb["action_mask"].shape == mb["response_mask"].shape == (3, 11)  # cut to the rows' longest response
    # each response token sits right after the position that predicts it, and unpack puts it back in its column
    targets = mb["input_ids"][0, mb["token_index"] + 1]                                       # [N]
    real = batch["response_mask"][rows, :11].bool()
    assert targets.tolist() == batch["response_ids"][rows, :11][real].tolist()
    assert torch.equal(packing.unpack(targets, mb), batch["response_ids"][rows, :11] * real)
    assert packing.padding_counts(batch, [rows, torch.tensor([0, 3])])["padding"] == 0


def test_token_budget_fills_micro_batches_and_keeps_every_row_once():
    batch = trajectories()
    lengths = packing.sequence_lengths(batch, torch.arange(5)).tolist()                   # [24, 16, 7, 18, 19]
    for budget in (7, 24, 30, 45, 1000):
        groups = packing.micro_batches(batch, torch.arange(5), tokens=budget)
        assert sorted(torch.cat(groups).tolist()) == list(range(5))
        for g in groups:  # within the budget, unless one sequence alone is longer
            assert sum(lengths[i] for i in g.tolist()) <= budget or len(g) == 1
        # first-fit decreasing: no two micro-batches could have been merged
        sizes = sorted(sum(lengths[i] for i in g.tolist()) for g in groups)
        assert len(sizes) == 1 or sizes[0] + sizes[1] > budget
    assert len(packing.micro_batches(batch, torch.arange(5), tokens=1000)) == 1
    assert [g.tolist() for g in packing.micro_batches(batch, torch.tensor([3, 0, 4]), size=2)] == [[3, 0], [4]]


@pytest.fixture(scope="module")
def token_mean_steps(tiny_model_dir, tmp_path_factory, torchrun):
    """tests/_token_mean_worker.py on 1 rank and on 2, each taking the step by rows and by a 50-token budget ->
    {(ranks, budget): what the worker saved}."""
    out = tmp_path_factory.mktemp("token_mean")
    worker, budgets = ROOT / "tests" / "_token_mean_worker.py", ("none", "50")
    one = run_script(worker, tiny_model_dir, out / "one", *budgets, env=CPU_ENV, timeout=300)
    assert one.returncode == 0, one.stderr[-4000:]
    two = torchrun(worker, tiny_model_dir, out / "two", *budgets, timeout=300)
    assert two.returncode == 0, two.stderr[-4000:]
    return {(ranks, budget): torch.load(out / f"{name}.{budget}") for ranks, name in ((1, "one"), (2, "two"))
            for budget in budgets}


@pytest.mark.parametrize("budget", ["none", "50"])
def test_token_budget_on_two_uneven_ranks_takes_the_one_rank_step(token_mean_steps, tiny_model_dir, budget):
    """Rank 0 holds two short sequences (3 action tokens each), rank 1 two long ones (30): token-mean weighs every
    token the same whichever rank holds it, so the step equals one rank holding all four rows. By token budget
    rank 0 needs one micro-batch and rank 1 two, so rank 0 must split (FSDP hangs otherwise)."""
    one, two = token_mean_steps[1, budget], token_mean_steps[2, budget]
    base = dict(sharding.full_state_dict(hf.load_causal_lm(tiny_model_dir)))
    moved = max((one["params"][n] - base[n]).abs().max().item() for n in base)
    diff = max((one["params"][n] - two["params"][n]).abs().max().item() for n in base)
    assert moved > 1e-3 and diff < 1e-3 * moved, (moved, diff)
    assert two["stats"]["loss/pg"] == pytest.approx(one["stats"]["loss/pg"], abs=1e-5)
    if budget == "50":
        assert one["calls"] == [3]  # 45 | 45 | 13 + 13 tokens
        assert two["calls"] == [2, 2]  # rank 0 alone would have packed its 13 + 13 into one
    else:
        assert one["calls"] == [4] and two["calls"] == [2, 2]  # a row each


def test_train_flag_micro_batch_tokens(capsys):
    assert train.parse_args(["--data", "x", "--micro-batch-tokens", "4096"]).micro_batch_tokens == 4096
    with pytest.raises(SystemExit):
        train.parse_args(["--data", "x", "--micro-batch-tokens", "0"])
    assert "--micro-batch-tokens" in capsys.readouterr().err
