"""train.py's pieces in isolation: flag checks, advantages, the update step (modes, weights, skips)."""
import contextlib
import math
from types import SimpleNamespace

import pytest
import torch

import model as M
import reward
import train
import train_setup
from infra import checkpoint, collectives, hf, hf_export, packing, sharding


@pytest.mark.parametrize("flag,value", [("--temperature", "0"), ("--samples-per-prompt", "0"),
                                        ("--turn-tokens", "0"), ("--micro-batch-size", "0"),
                                        ("--top-p", "1.5"), ("--max-turns", "-1")])
def test_bad_flags_fail_in_one_line_before_any_model_loads(flag, value, capsys):
    with pytest.raises(SystemExit) as e:  # --model does not exist: a model load would fail differently
        train.parse_args(["--data", "arith_train", "--model", "/no/such/model", flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and flag in err, err


def test_group_estimators_need_two_samples_per_prompt(capsys):
    for adv in ("grpo", "rloo"):
        with pytest.raises(SystemExit):
            train.parse_args(["--data", "arith_train", "--adv", adv, "--samples-per-prompt", "1"])
        assert "--samples-per-prompt" in capsys.readouterr().err
    assert train.parse_args(["--data", "x", "--adv", "grpo"]).kl_loss_coef == 0.001  # veRL's GRPO default
    assert train.parse_args(["--data", "x"]).kl_loss_coef == 0.0


def test_length_coef_charges_every_decoded_token_and_only_those():
    """--length-coef: score = acc - C * the tokens the engine decoded (a cut's dropped tail costs, interventions do
    not: the environment wrote them), correct or not."""
    records = [{"data_source": "arith", "ground_truth": "12"}]
    trajs = [dict(prompt_index=0, policy_text="Answer: 12", action_mask=[1] * 10 + [0] * 30 + [1] * 5,
                  decoded_tokens=15 + 40, stopped=False),  # 40 tokens decoded after the answer, cut off
             dict(prompt_index=0, policy_text="Answer: 13", action_mask=[1] * 20, decoded_tokens=20, stopped=True)]
    for coef in (0.0, 0.01):
        args = SimpleNamespace(cut_at_answer=True, length_coef=coef, require_stop=False)
        got = train.score(trajs, records, args)
        assert [r["acc"] for r in got] == [1.0, 0.0]
        assert [r["score"] for r in got] == pytest.approx([1.0 - coef * 55, 0.0 - coef * 20])
    # --require-stop: the right answer that a token limit cut earns nothing; acc still counts it (validation, eval)
    got = train.score(trajs, records, SimpleNamespace(cut_at_answer=True, length_coef=0.01, require_stop=True))
    assert [r["acc"] for r in got] == [1.0, 0.0]
    assert [r["score"] for r in got] == pytest.approx([0.0 - 0.01 * 55, 0.0 - 0.01 * 20])
    stopped = [dict(t, stopped=True) for t in trajs]
    got = train.score(stopped, records, SimpleNamespace(cut_at_answer=True, length_coef=0.0, require_stop=True))
    assert [r["score"] for r in got] == [1.0, 0.0]


def test_training_reward_needs_an_explicit_answer():
    """The paper's reward (no answer = 0): a right last number without 'Answer:' earns nothing in training, though
    reward.score_batch's default (eval.py) reads the last number of GSM8K-style sources."""
    records = [{"data_source": "arith", "ground_truth": "12"}, {"data_source": "openai/gsm8k", "ground_truth": "7"}]
    trajs = [dict(prompt_index=0, policy_text="5 + 7 = 12", action_mask=[1] * 6),
             dict(prompt_index=0, policy_text="5 + 7 = 12\nAnswer: 12", action_mask=[1] * 8),
             dict(prompt_index=1, policy_text="she has 7 left", action_mask=[1] * 4),
             dict(prompt_index=1, policy_text=r"so \boxed{7}", action_mask=[1] * 4)]
    got = train.score(trajs, records, SimpleNamespace(cut_at_answer=True, length_coef=0.0, require_stop=False))
    assert [r["score"] for r in got] == [0.0, 1.0, 0.0, 1.0]
    assert [r["has_answer"] for r in got] == [0.0, 1.0, 0.0, 1.0]
    lenient = reward.score_batch([records[t["prompt_index"]]["data_source"] for t in trajs],
                                 [t["policy_text"] for t in trajs], ["12", "12", "7", "7"], first=True)
    assert [r["score"] for r in lenient] == [1.0, 1.0, 1.0, 1.0]


def test_grpo_advantages_ignore_the_kl():
    """An equal-score group gets zero advantage whatever the KL; other groups get (s - mean) / std."""
    args = SimpleNamespace(adv="grpo")
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0])  # group 0: all correct; group 1: mixed
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    mask = torch.ones(6, 5)
    kl = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))  # noise, different in every row
    for kl_coef in (1e-3, 1e-1):
        adv, returns = train.compute_advantages(args, scores, kl, kl_coef, None, mask, groups, "cpu")
        assert returns is None and torch.equal(adv[:3], torch.zeros(3, 5))
        want = (scores[3:] - scores[3:].mean()) / (scores[3:].std() + 1e-6)
        torch.testing.assert_close(adv[3:], want[:, None].expand(3, 5))
    # rloo keeps the KL in the reward: there the coefficient does move the advantages
    a1, _ = train.compute_advantages(SimpleNamespace(adv="rloo"), scores, kl, 1e-3, None, mask, groups, "cpu")
    a2, _ = train.compute_advantages(SimpleNamespace(adv="rloo"), scores, kl, 1e-1, None, mask, groups, "cpu")
    assert not torch.allclose(a1[:3], a2[:3])


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    collectives.init_distributed()
    yield
    dist.destroy_process_group()


def update_batch(model, rows=4, prompt=6, response=12):
    """A trainer batch on the CPU (as train.py holds it); packing.pack moves each micro-batch to the model's device."""
    g = torch.Generator().manual_seed(0)
    batch = dict(prompt_ids=torch.randint(3, 4000, (rows, prompt), generator=g),
                 prompt_mask=torch.ones(rows, prompt, dtype=torch.long),
                 response_ids=torch.randint(3, 4000, (rows, response), generator=g),
                 response_mask=torch.ones(rows, response, dtype=torch.long), action_mask=torch.ones(rows, response))
    batch.update(old_logprobs=torch.full((rows, response), -8.0), ref_logprobs=torch.full((rows, response), -8.0),
                 advantages=torch.randn(rows, response, generator=g))
    return batch


TWO_MICRO = [torch.tensor([0, 1]), torch.tensor([2, 3])]  # the update's micro-batches: rows 0-1, rows 2-3


def device_of(model):
    """Where FSDP2 put the model: the default device of the process group's mesh (cuda:0 on a GPU machine)."""
    return next(model.parameters()).device


UPDATE_ARGS = dict(micro_batch_size=2, loss_agg="token-mean", clip_low=0.2, clip_high=0.2, dual_clip=None,
                   entropy_coef=0.001, kl_loss_coef=0.001, kl_loss_kind="k3", temperature=1.0, grad_clip=1.0,
                   rollout_is_cap=0.0, rollout_is_level="token")


@pytest.mark.parametrize("checkpointing", [False, True])
def test_grad_checkpointing_recomputes_layers_in_the_update(tiny_model_dir, one_rank_group, checkpointing):
    """--grad-checkpointing: each decoder layer runs forward twice per micro-batch (the recompute in
    backward), which only happens if the update puts the model in train mode; without it, once."""
    actor = sharding.shard(hf.load_causal_lm(tiny_model_dir), grad_checkpointing=checkpointing)
    calls, mlp = [], actor.model.layers[0].mlp
    real_forward = mlp.forward  # counted on the instance: forward hooks do not fire in the recompute
    mlp.forward = lambda *a, **k: calls.append(1) or real_forward(*a, **k)
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-4)
    stats, skipped = train.ppo_update(actor, None, opt, None, update_batch(actor), TWO_MICRO,
                                      SimpleNamespace(**UPDATE_ARGS), contextlib.nullcontext, device_of(actor))
    assert skipped == 0 and {"loss/pg", "actor/entropy", "loss/kl", "actor/grad_norm"} <= set(stats)
    assert len(calls) == (4 if checkpointing else 2)  # 2 micro-batches
    assert not actor.training  # back in eval mode for the no-grad log-prob passes


def test_nonfinite_actor_update_is_skipped_and_the_critic_still_steps(tiny_model_dir, one_rank_group, monkeypatch):
    actor = sharding.shard(hf.load_causal_lm(tiny_model_dir))
    critic = sharding.shard(M.load_critic(tiny_model_dir))
    batch = update_batch(actor)
    batch.update(old_values=torch.zeros(4, 12), returns=torch.ones(4, 12))
    before = {n: t.clone() for n, t in sharding.full_state_dict(actor)}
    real = train.ppo.policy_loss
    monkeypatch.setattr(train.ppo, "policy_loss", lambda *a, **k: (real(*a, **k)[0] * float("nan"), real(*a, **k)[1]))
    a_opt, c_opt = torch.optim.AdamW(actor.parameters(), lr=1e-3), torch.optim.AdamW(critic.parameters(), lr=1e-3)
    stats, skipped = train.ppo_update(actor, critic, a_opt, c_opt, batch, TWO_MICRO,
                                      SimpleNamespace(**UPDATE_ARGS, value_clip=0.5), contextlib.nullcontext,
                                      device_of(actor))
    assert skipped == 1 and "loss/vf" in stats and stats["critic/grad_norm"] > 0
    assert all(torch.equal(t, before[n]) for n, t in sharding.full_state_dict(actor))  # the actor did not move


def test_reused_old_logprobs_give_the_same_step_as_a_separate_forward(tiny_model_dir, one_rank_group):
    """grpo with one optimiser step per batch skips the old log-prob pass: the update's own forward supplies
    pi_old. The step must equal the one taken with pi_old from a separate no-grad forward."""
    args = SimpleNamespace(**{**UPDATE_ARGS, "kl_kind": "k1"})
    params = []
    for reuse in (False, True):
        actor = sharding.shard(hf.load_causal_lm(tiny_model_dir))
        batch = update_batch(actor)
        batch["rollout_logprobs"] = torch.full_like(batch["advantages"], -9.0)
        with torch.no_grad():
            old = M.token_logprobs(actor, packing.pack(batch, torch.arange(4), device_of(actor))).cpu()
        if reuse:
            del batch["old_logprobs"]
        else:
            batch["old_logprobs"] = old
        opt = torch.optim.SGD(actor.parameters(), lr=1.0)
        stats, _ = train.ppo_update(actor, None, opt, None, batch, TWO_MICRO, args, contextlib.nullcontext,
                                    device_of(actor))
        assert stats["actor/clipfrac"] == 0 and stats["actor/approx_kl"] == pytest.approx(0, abs=1e-6)
        if reuse:  # the diagnostics the skipped pass would have given
            assert stats["kl/mean"] == pytest.approx(float((old - batch["ref_logprobs"]).mean()), abs=1e-4)
            assert stats["rollout/logprob_gap"] == pytest.approx(float((old + 9.0).abs().mean()), abs=1e-4)
        params.append({n: t.clone() for n, t in sharding.full_state_dict(actor)})
    assert max((params[0][n] - params[1][n]).abs().max().item() for n in params[0]) < 1e-5


# ----------------------------------------------------------------------------- rollout IS (--rollout-is-cap)

@pytest.mark.parametrize("flag,value", [("--rollout-is-cap", "-1"), ("--rollout-is-cap", "0.5"),
                                        ("--rollout-is-level", "batch")])
def test_rollout_is_flags_fail_in_one_line(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        train.parse_args(["--data", "arith_train", flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and flag in err, err
    args = train.parse_args(["--data", "x"])
    assert (args.rollout_is_cap, args.rollout_is_level) == (2.0, "token")  # on by default, TRL-like
    assert train.parse_args(["--data", "x", "--rollout-is-cap", "0"]).rollout_is_cap == 0  # off


def actor_mb(model, gap=None):
    """One micro-batch as actor_loss reads it, ratio 1 (old = the model's own log-probs); rollout log-probs = old
    - gap (gap None: equal)."""
    g = torch.Generator().manual_seed(1)
    B, P, R = 3, 5, 8
    ids = torch.randint(3, 4000, (B, P + R), generator=g)
    mb = packing.from_padded(ids, torch.ones_like(ids), P)
    with torch.no_grad():
        old = M.token_logprobs(model, mb)  # [B, R]
    mask = torch.ones(B, R)
    mask[0, 5:] = 0  # an intervention / padding tail
    return dict(mb, action_mask=mask, old_logprobs=old, ref_logprobs=old, advantages=torch.randn(B, R, generator=g),
                rollout_logprobs=old if gap is None else old - gap)


def actor_grads(model, mb, **kw):
    args = SimpleNamespace(**{**UPDATE_ARGS, "kl_loss_coef": 0.0, "kl_kind": "k1", **kw})
    model.zero_grad(set_to_none=True)
    loss, stats = train.actor_loss(model, mb, args)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, stats


def scaled_by(a, b, factor):
    """a == factor * b up to float32 rounding of the summed gradient"""
    return float((a - factor * b).abs().max()) <= 1e-5 * float(b.abs().max())


def test_rollout_is_leaves_an_on_policy_update_unchanged_and_corrects_a_gap(tiny_model_dir):
    model = hf.load_causal_lm(tiny_model_dir)
    off, _ = actor_grads(model, actor_mb(model), rollout_is_cap=0.0)
    on, stats = actor_grads(model, actor_mb(model), rollout_is_cap=2.0)
    assert all(torch.equal(on[n], off[n]) for n in off)  # equal log-probs: every weight is exactly 1
    assert float(stats["rollout/is_weight_mean"]) == 1.0 and float(stats["rollout/is_clipped_share"]) == 0.0
    # a scripted gap: the engine gave every token exp(-0.5) of the trainer's probability -> weight e^0.5 = 1.65,
    # under the cap of 2: the gradient scales by it (entropy off, so the surrogate is the whole loss)
    on, stats = actor_grads(model, actor_mb(model, gap=0.5), rollout_is_cap=2.0, entropy_coef=0.0)
    off, _ = actor_grads(model, actor_mb(model, gap=0.5), rollout_is_cap=0.0, entropy_coef=0.0)
    w = torch.exp(torch.tensor(0.5))
    assert float(stats["rollout/is_weight_mean"]) == pytest.approx(float(w), rel=1e-5)
    assert all(scaled_by(on[n], off[n], float(w)) for n in off)
    # a gap of 1.0 (weight e = 2.72) is capped at 2; at sequence level a row's summed gap is capped too
    on, stats = actor_grads(model, actor_mb(model, gap=1.0), rollout_is_cap=2.0, entropy_coef=0.0)
    assert float(stats["rollout/is_clipped_share"]) == 1.0 and float(stats["rollout/is_weight_mean"]) == pytest.approx(2.0)
    assert all(scaled_by(on[n], off[n], 2.0) for n in off)
    _, stats = actor_grads(model, actor_mb(model, gap=0.05), rollout_is_cap=2.0, rollout_is_level="sequence")
    assert float(stats["rollout/is_clipped_share"]) == 0.0  # 0.05 x 5 or 8 tokens: e^0.25, e^0.4 < 2
    assert float(stats["rollout/is_weight_mean"]) == pytest.approx((5 * math.exp(0.25) +
                                                                   16 * math.exp(0.4)) / 21, rel=1e-4)


def test_rollout_is_with_reused_old_logprobs(tiny_model_dir):
    """grpo with one optimiser step per batch: pi_old is the update's own forward, the weights come from it."""
    model = hf.load_causal_lm(tiny_model_dir)
    mb = actor_mb(model, gap=0.5)
    del mb["old_logprobs"]
    _, stats = actor_grads(model, mb, rollout_is_cap=2.0)
    assert float(stats["rollout/is_weight_mean"]) == pytest.approx(math.exp(0.5), rel=1e-4)


def test_resume_without_checkpoint_says_so(tmp_path, capsys):
    assert train_setup.resume(None, SimpleNamespace(out=tmp_path, master=True)) is None
    assert capsys.readouterr().out == f"[resume] no checkpoint in {tmp_path}: starting at step 0\n"


def test_a_full_disk_during_a_checkpoint_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    """The writer fails (torch says "unexpected pos" when the disk fills): with almost no space left under --out,
    one line naming --out and --keep-last, exit 2, no step_N.tmp, no step_N, no latest; with space left, the
    writer's own error stays itself."""
    from collections import namedtuple

    def writer_fails(model, tokenizer, path):
        path.mkdir(parents=True)
        (path / "partial.bin").write_bytes(b"x" * 1000)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(hf_export, "save_hf", writer_fails)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: usage(10 * 2**30, 10 * 2**30 - 100_000, 100_000))
    with pytest.raises(SystemExit) as e:
        checkpoint.save_checkpoint(tmp_path, 3, {"actor": (None, None)}, None, {})
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and f"--out {tmp_path}" in err[0] and "--keep-last" in err[0]
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: usage(10 * 2**30, 0, 10 * 2**30))
    with pytest.raises(RuntimeError, match="unexpected pos"):
        checkpoint.save_checkpoint(tmp_path, 4, {"actor": (None, None)}, None, {})


@pytest.mark.parametrize("samples, n_minis", [(4, 2), (6, 3), (4, 1)])
def test_mini_batches_are_the_same_on_any_world_size(samples, n_minis):
    """Each prompt's samples dealt evenly over the mini-batches: the global mini-batches do not depend on how the
    prompts are sharded, every rank holds as many rows of each, and every row is in exactly one."""
    prompts = 4
    def rows_of(world, rank):  # rollout.shard_indices: strided prompts, prompt-major trajectories
        mine = list(range(rank, prompts, world))
        return torch.tensor([p for p in mine for _ in range(samples)]), torch.tensor(list(range(samples)) * len(mine))

    def global_minis(world):
        out = [[] for _ in range(n_minis)]
        for rank in range(world):
            p, s = rows_of(world, rank)
            minis = train.mini_batches({"prompt_index": p, "sample_index": s}, n_minis,
                                       prompts * samples // n_minis // world, (0, 7, 0))
            assert [len(m) for m in minis] == [prompts * samples // n_minis // world] * n_minis
            for k, m in enumerate(minis):
                out[k] += [(int(p[i]), int(s[i])) for i in m]
        return [sorted(m) for m in out]

    one = global_minis(1)
    assert sorted(x for m in one for x in m) == [(p, s) for p in range(prompts) for s in range(samples)]
    assert global_minis(2) == global_minis(4) == one
    assert all(len({s for p2, s in m if p2 == p}) == samples // n_minis for m in one for p in range(prompts))
