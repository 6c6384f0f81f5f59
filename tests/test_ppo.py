"""Tests for ppo.py: every function against an independent computation (naive loops, numpy,
hand-worked numbers) so that a wrong sign, index or mask makes a test fail."""
import math

import numpy as np
import pytest
import torch

import ppo


def random_mask(B, T, gen):
    """Action masks with intervention gaps, right padding and all-masked rows."""
    mask = torch.rand(B, T, generator=gen) < 0.7  # random gaps anywhere
    lengths = torch.randint(0, T + 1, (B,), generator=gen)
    mask &= torch.arange(T) < lengths[:, None]  # right padding
    mask[0] = False  # a row with no action token at all
    mask[1] = True  # a fully dense row
    mask[2, :] = torch.tensor([True, False, False, True] * (T // 4) + [True] * (T % 4))  # gaps in the middle
    return mask


def naive_gae(rewards, values, mask, gamma, lam):
    """Per-row Python loop over the list of action positions only."""
    B, T = mask.shape
    adv = np.zeros((B, T))
    ret = np.zeros((B, T))
    for b in range(B):
        pos = [t for t in range(T) if mask[b, t]]
        next_v, next_a = 0.0, 0.0
        for t in reversed(pos):
            delta = rewards[b, t] + gamma * next_v - values[b, t]
            a = delta + gamma * lam * next_a
            adv[b, t], ret[b, t] = a, a + values[b, t]
            next_v, next_a = values[b, t], a
    return adv, ret


# ----------------------------------------------------------------------------- KL and rewards
def test_kl_estimators_match_formulas():
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 7, generator=gen, dtype=torch.float64) * 5
    ref = -torch.rand(4, 7, generator=gen, dtype=torch.float64) * 5
    lp, rf = logp.numpy(), ref.numpy()
    np.testing.assert_allclose(ppo.kl_penalty(logp, ref, "k1").numpy(), lp - rf)
    np.testing.assert_allclose(ppo.kl_penalty(logp, ref, "k2").numpy(), 0.5 * (lp - rf) ** 2)
    k3 = ppo.kl_penalty(logp, ref, "k3")
    np.testing.assert_allclose(k3.numpy(), np.exp(rf - lp) - (rf - lp) - 1)
    assert (k3 >= 0).all()
    assert torch.equal(ppo.kl_penalty(logp, ref), ppo.kl_penalty(logp, ref, "k1"))  # default k1
    with pytest.raises(ValueError):
        ppo.kl_penalty(logp, ref, "k4")


def test_k1_k3_are_unbiased_for_exact_kl():
    # E_{x~p}[k(x)] over a full categorical distribution must equal KL(p || q) for k1 and k3
    p = torch.softmax(torch.tensor([0.3, -1.2, 2.0, 0.1], dtype=torch.float64), 0)
    q = torch.softmax(torch.tensor([1.0, 0.4, -0.5, 0.0], dtype=torch.float64), 0)
    kl = float((p * (p.log() - q.log())).sum())
    for kind in ("k1", "k3"):
        assert float((p * ppo.kl_penalty(p.log(), q.log(), kind)).sum()) == pytest.approx(kl, rel=1e-12)


def test_token_rewards_hand_example():
    kl = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0],
                       [1.0, 1.0, 1.0, 1.0, 1.0],
                       [9.0, 9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0, 1, 0],   # intervention at 2, padding at 4: last action is 3
                         [0, 0, 0, 0, 0],   # no action token: nothing at all
                         [1, 0, 0, 0, 0]])  # single action token
    scores = torch.tensor([10.0, 7.0, -1.0])
    expected = torch.tensor([[-0.1, -0.2, 0.0, 10.0 - 0.4, 0.0],
                             [0.0, 0.0, 0.0, 0.0, 0.0],
                             [-1.0 - 0.9, 0.0, 0.0, 0.0, 0.0]])
    out = ppo.token_rewards(scores, kl, mask, kl_coef=0.1)
    torch.testing.assert_close(out, expected)


# ----------------------------------------------------------------------------- GAE
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.5), (1.0, 0.0), (0.5, 1.0)])
def test_gae_matches_naive_loop(gamma, lam):
    gen = torch.Generator().manual_seed(int(gamma * 100 + lam * 10))
    B, T = 9, 13
    mask = random_mask(B, T, gen)
    rewards = torch.randn(B, T, generator=gen, dtype=torch.float64)  # nonzero everywhere, also off-mask
    values = torch.randn(B, T, generator=gen, dtype=torch.float64)
    adv, ret = ppo.compute_gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = naive_gae(rewards.numpy(), values.numpy(), mask.numpy(), gamma, lam)
    np.testing.assert_allclose(adv.numpy(), ref_adv, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ret.numpy(), ref_ret, rtol=1e-12, atol=1e-12)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_gae_gamma_lam_one_is_monte_carlo():
    # with gamma = lam = 1: A_t = (sum of rewards on action tokens from t on) - V(t)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0]], dtype=torch.bool)
    rewards = torch.tensor([[0.1, 0.2, 5.0, 5.0, 0.3, 1.0, 9.0]])
    values = torch.tensor([[0.5, -0.5, 7.0, 7.0, 0.25, 2.0, 3.0]])
    adv, ret = ppo.compute_gae(rewards, values, mask, 1.0, 1.0)
    torch.testing.assert_close(adv, torch.tensor([[1.6 - 0.5, 1.5 + 0.5, 0, 0, 1.3 - 0.25, 1.0 - 2.0, 0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.6, 1.5, 0, 0, 1.3, 1.0, 0]]))


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.95, 0.9)])
def test_gae_interventions_equal_deleted_tokens(gamma, lam):
    gen = torch.Generator().manual_seed(3)
    T = 15
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 0]], dtype=torch.bool)  # 2 interventions + pad
    rewards = torch.randn(1, T, generator=gen, dtype=torch.float64)  # intervention tokens get rewards too
    values = torch.randn(1, T, generator=gen, dtype=torch.float64)
    adv, ret = ppo.compute_gae(rewards, values, mask, gamma, lam)
    keep = mask[0]
    dense = torch.ones(1, int(keep.sum()), dtype=torch.bool)
    adv_del, ret_del = ppo.compute_gae(rewards[:, keep], values[:, keep], dense, gamma, lam)
    torch.testing.assert_close(adv[:, keep], adv_del)
    torch.testing.assert_close(ret[:, keep], ret_del)
    assert (adv[:, ~keep] == 0).all() and (ret[:, ~keep] == 0).all()
    # and changing rewards/values at intervention positions changes nothing
    rewards2, values2 = rewards.clone(), values.clone()
    rewards2[:, ~keep] = 100.0
    values2[:, ~keep] = float("nan")
    adv2, ret2 = ppo.compute_gae(rewards2, values2, mask, gamma, lam)
    torch.testing.assert_close(adv2, adv)
    torch.testing.assert_close(ret2, ret)


# ----------------------------------------------------------------------------- masked statistics
def test_masked_statistics_vs_numpy():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 8, generator=gen, dtype=torch.float64)
    mask = random_mask(5, 8, gen)
    sel = x.numpy()[mask.numpy()]
    assert float(ppo.masked_mean(x, mask)) == pytest.approx(sel.mean())
    assert float(ppo.masked_var(x, mask)) == pytest.approx(sel.var())
    row_means = ppo.masked_mean(x, mask, dim=1)
    for b in range(5):
        row = x.numpy()[b][mask.numpy()[b]]
        assert float(row_means[b]) == pytest.approx(row.mean() if row.size else 0.0)
    w = ppo.masked_whiten(x, mask)
    np.testing.assert_allclose(w.numpy()[mask.numpy()], (sel - sel.mean()) / np.sqrt(sel.var() + 1e-8))
    assert (w[~mask] == 0).all()
    w2 = ppo.masked_whiten(x, mask, shift_mean=False)
    np.testing.assert_allclose(w2.numpy()[mask.numpy()], (sel - sel.mean()) / np.sqrt(sel.var() + 1e-8) + sel.mean())
    assert float(ppo.masked_mean(x, torch.zeros_like(mask))) == 0.0  # empty mask -> 0, not nan


def test_masked_whiten_over_ranks_uses_every_ranks_moments():
    """Two 'ranks' holding halves of a batch, whitened with summed moments (train.py's GAE whitening), give
    the whole batch's whitening, not each half's own."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 8, generator=gen, dtype=torch.float64) * 3 + 1
    mask = random_mask(6, 8, gen)
    halves = [(x[:3], mask[:3]), (x[3:] * 5, mask[3:])]  # different scales: local whitening would differ
    whole_x = torch.cat([h[0] for h in halves])

    def sum_over_ranks(local):  # what all_reduce_sum returns on every rank: the sum of both ranks' lists
        return [sum(v) for v in zip(*[[float(torch.where(m.bool(), y, 0).sum()),
                                       float(torch.where(m.bool(), y * y, 0).sum()), float(m.sum())]
                                      for y, m in halves])]

    sel = whole_x.numpy()[mask.numpy()]
    for y, m in halves:
        w = ppo.masked_whiten(y, m, sum_over_ranks=sum_over_ranks)
        np.testing.assert_allclose(w.numpy()[m.numpy()], (y.numpy()[m.numpy()] - sel.mean()) / np.sqrt(sel.var() + 1e-8),
                                   rtol=1e-6)
        local = ppo.masked_whiten(y, m)
        assert not torch.allclose(w, local)


# ----------------------------------------------------------------------------- aggregation
def test_agg_loss_modes_hand_example():
    loss = torch.tensor([[1.0, 2.0, 3.0, 100.0],
                         [4.0, 100.0, 100.0, 100.0],
                         [100.0, 100.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # row 2 has no action
    assert float(ppo.agg_loss(loss, mask, "token-mean")) == pytest.approx(10 / 4)
    assert float(ppo.agg_loss(loss, mask, "seq-mean-token-mean")) == pytest.approx((2 + 4) / 2)
    assert float(ppo.agg_loss(loss, mask, "seq-mean-token-sum")) == pytest.approx((6 + 4) / 2)
    with pytest.raises(ValueError):
        ppo.agg_loss(loss, mask, "mean")


# ----------------------------------------------------------------------------- policy loss
def pg_grad(logp_now, old, adv, mask, **kw):
    logp = logp_now.clone().requires_grad_(True)
    loss, stats = ppo.policy_loss(logp, old, adv, mask, **kw)
    loss.backward()
    return loss.detach(), logp.grad, stats


def test_policy_loss_gradient_at_ratio_one():
    gen = torch.Generator().manual_seed(2)
    B, T = 4, 6
    mask = random_mask(B, T, gen)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64)
    adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
    n = int(mask.sum())
    loss, grad, stats = pg_grad(old, old, adv, mask)
    # d/dlogp of -A * exp(logp - old) at ratio 1 is -A; token-mean divides by #action tokens
    torch.testing.assert_close(grad, torch.where(mask, -adv / n, torch.zeros_like(adv)))
    assert float(loss) == pytest.approx(float(-adv[mask].sum() / n))
    assert float(stats["clipfrac"]) == 0.0 and float(stats["approx_kl"]) == 0.0
    assert float(stats["ratio_mean"]) == pytest.approx(1.0) and float(stats["ratio_max"]) == pytest.approx(1.0)
    # seq-mean-token-mean: each token is weighted by 1 / (#rows with actions * #actions in its row)
    _, grad_seq, _ = pg_grad(old, old, adv, mask, agg="seq-mean-token-mean")
    per_row = mask.sum(1, keepdim=True).clamp(min=1)
    rows = int((mask.sum(1) > 0).sum())
    torch.testing.assert_close(grad_seq, torch.where(mask, -adv / (per_row * rows), torch.zeros_like(adv)))


def test_policy_loss_clipping_hand_cases():
    # one row, 5 action tokens + 1 padding token holding garbage
    ratio = torch.tensor([[1.5, 0.5, 0.5, 1.5, 1.1, 1.0]], dtype=torch.float64)
    adv = torch.tensor([[2.0, -1.0, 3.0, -2.0, 1.0, float("nan")]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    old = torch.full((1, 6), -1.0, dtype=torch.float64)
    old[0, 5] = float("-inf")
    logp = old + ratio.log()
    logp[0, 5] = float("nan")
    loss, grad, stats = pg_grad(logp, old, adv, mask)
    n = 5
    # token 0: A>0, ratio>1.2 -> clipped, loss -2*1.2, grad 0
    # token 1: A<0, ratio<0.8 -> clipped, loss 1*0.8,  grad 0
    # token 2: A>0, ratio<0.8 -> unclipped (pessimistic), loss -3*0.5, grad -A*ratio/n
    # token 3: A<0, ratio>1.2 -> unclipped (pessimistic), loss 2*1.5,  grad -A*ratio/n
    # token 4: inside the trust region, loss -1.1, grad -A*ratio/n
    expected_loss = (-2 * 1.2 + 0.8 - 1.5 + 3.0 - 1.1) / n
    assert float(loss) == pytest.approx(expected_loss)
    expected_grad = torch.tensor([[0.0, 0.0, -3 * 0.5 / n, 2 * 1.5 / n, -1.1 / n, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected_grad)
    assert float(stats["clipfrac"]) == pytest.approx(2 / 5)
    assert float(stats["ratio_max"]) == pytest.approx(1.5)
    assert float(stats["ratio_mean"]) == pytest.approx((1.5 + 0.5 + 0.5 + 1.5 + 1.1) / 5)
    r = ratio[0, :5].numpy()
    assert float(stats["approx_kl"]) == pytest.approx(np.mean(r - 1 - np.log(r)))
    # asymmetric clip (clip-higher): ratio 1.25 with A>0 is inside [0.8, 1.28]
    _, grad_hi, _ = pg_grad(logp, old, adv, mask, clip_high=0.28)
    assert float(grad_hi[0, 0]) == 0.0  # 1.5 still above 1.28
    ratio2 = torch.tensor([[1.25]], dtype=torch.float64)
    _, g, _ = pg_grad(ratio2.log(), torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64),
                      torch.ones(1, 1, dtype=torch.bool), clip_high=0.28)
    assert float(g) == pytest.approx(-1.25)


def test_policy_loss_dual_clip():
    ratio = torch.tensor([[5.0, 2.0, 5.0]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    old = torch.zeros(1, 3, dtype=torch.float64)
    # no dual clip: token 0 contributes 5 with gradient -A*ratio/3 = 5/3
    loss, grad, _ = pg_grad(ratio.log(), old, adv, mask)
    assert float(loss) == pytest.approx((5 + 2 - 1.2) / 3)
    assert float(grad[0, 0]) == pytest.approx(5 / 3)
    # dual clip 3: token 0 (A<0, ratio 5 > 3) capped at -A*3 = 3, gradient 0; token 1 (ratio 2 < 3)
    # and token 2 (A>0) unaffected
    loss, grad, stats = pg_grad(ratio.log(), old, adv, mask, dual_clip=3.0)
    assert float(loss) == pytest.approx((3 + 2 - 1.2) / 3)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 2 / 3, 0.0]], dtype=torch.float64))
    assert float(stats["dual_clipfrac"]) == pytest.approx(1 / 3)
    with pytest.raises(ValueError):
        ppo.policy_loss(ratio.log(), old, adv, mask, dual_clip=1.0)


# ----------------------------------------------------------------------------- rollout IS (TIS)
def naive_is_weights(old, rollout, mask, cap, level):
    """Per-row loop: token level min(exp(old - rollout), C); sequence level one min(exp(sum), C) per row."""
    B, T = mask.shape
    w = np.zeros((B, T))
    for b in range(B):
        pos = [t for t in range(T) if mask[b, t]]
        total = sum(float(old[b, t] - rollout[b, t]) for t in pos)
        for t in pos:
            w[b, t] = min(math.exp(total if level == "sequence" else float(old[b, t] - rollout[b, t])), cap)
    return w


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_is_weights_match_naive_loop(level):
    gen = torch.Generator().manual_seed(5)
    B, T = 6, 9
    mask = random_mask(B, T, gen)
    old = -2 * torch.rand(B, T, generator=gen)
    rollout = old + 0.3 * torch.randn(B, T, generator=gen)  # a gap in both directions
    rollout[~mask] = float("nan")  # garbage outside the mask must not leak
    w, stats = ppo.rollout_is_weights(old, rollout, mask, cap=1.2, level=level)
    want = naive_is_weights(old, rollout, mask, 1.2, level)
    np.testing.assert_allclose(w.numpy(), want, rtol=1e-5, atol=1e-6)
    assert not w.requires_grad and torch.equal(w[~mask], torch.zeros(int((~mask).sum())))
    assert float(stats["is_weight_mean"]) == pytest.approx(want[mask.numpy()].mean(), rel=1e-5)
    raw = naive_is_weights(old, rollout, mask, float("inf"), level)
    assert float(stats["is_clipped_share"]) == pytest.approx((raw[mask.numpy()] > 1.2).mean())
    with pytest.raises(ValueError):
        ppo.rollout_is_weights(old, rollout, mask, level="batch")


def test_rollout_is_with_equal_logprobs_leaves_the_update_unchanged():
    gen = torch.Generator().manual_seed(6)
    B, T = 4, 7
    mask = random_mask(B, T, gen)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64)
    now = old + 0.4 * torch.randn(B, T, generator=gen, dtype=torch.float64)  # some tokens clip
    adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
    w, stats = ppo.rollout_is_weights(old, old, mask, cap=2.0)
    assert float(stats["is_weight_mean"]) == 1.0 and float(stats["is_clipped_share"]) == 0.0
    for agg in ppo.AGG_MODES:
        loss, grad, _ = pg_grad(now, old, adv, mask, agg=agg)
        loss_w, grad_w, _ = pg_grad(now, old, adv, mask, agg=agg, is_weights=w)
        assert float(loss_w) == float(loss) and torch.equal(grad_w, grad)


def test_rollout_is_corrects_a_scripted_gap_and_caps_it():
    """The engine gave token 0 half the trainer's probability (weight 2 up to the cap), token 1 double (weight
    0.5), token 2 a tenth (weight 10, capped): at ratio 1 each token's gradient is -A * w / n."""
    old = torch.log(torch.tensor([[0.4, 0.4, 0.5, 0.3]], dtype=torch.float64))
    rollout = torch.log(torch.tensor([[0.2, 0.8, 0.05, 0.3]], dtype=torch.float64))
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([[1.0, 1.0, -1.0, 1.0]], dtype=torch.float64)
    w, stats = ppo.rollout_is_weights(old, rollout, mask, cap=3.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 3.0, 0.0]]))
    assert float(stats["is_clipped_share"]) == pytest.approx(1 / 3)
    assert float(stats["is_weight_mean"]) == pytest.approx(5.5 / 3)
    loss, grad, _ = pg_grad(old, old, adv, mask, is_weights=w)
    torch.testing.assert_close(grad, torch.tensor([[-2.0 / 3, -0.5 / 3, 3.0 / 3, 0.0]], dtype=torch.float64))
    assert float(loss) == pytest.approx((-2.0 - 0.5 + 3.0) / 3)
    # sequence level: one weight for the row, exp(log 2 + log 0.5 + log 10) = 10, capped at 3
    w_seq, stats = ppo.rollout_is_weights(old, rollout, mask, cap=3.0, level="sequence")
    torch.testing.assert_close(w_seq, torch.tensor([[3.0, 3.0, 3.0, 0.0]]))
    assert float(stats["is_clipped_share"]) == 1.0


# ----------------------------------------------------------------------------- value loss
def test_value_loss_clipping_hand_cases():
    v = torch.tensor([[1.0, 1.0, 0.3, 9.0]], dtype=torch.float64)
    old = torch.zeros(1, 4, dtype=torch.float64)
    R = torch.tensor([[2.0, 0.0, 1.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    vv = v.clone().requires_grad_(True)
    loss, stats = ppo.value_loss(vv, old, R, mask, clip=0.5)
    loss.backward()
    loss = loss.detach()
    # token 0: v moved 1.0 > 0.5 away from old towards R: clipped (0.5-2)^2 = 2.25 > 1 -> constant, grad 0
    # token 1: v moved away from R: unclipped 1 > clipped 0.25 -> grad (v - R)
    # token 2: inside the clip range: 0.49, grad (v - R)
    assert float(loss) == pytest.approx(0.5 * (2.25 + 1.0 + 0.49) / 3)
    torch.testing.assert_close(vv.grad, torch.tensor([[0.0, 1.0 / 3, -0.7 / 3, 0.0]], dtype=torch.float64))
    assert float(stats["vf_clipfrac"]) == pytest.approx(1 / 3)
    assert float(stats["value_mean"]) == pytest.approx((1.0 + 1.0 + 0.3) / 3)
    loss_nc, _ = ppo.value_loss(v, old, R, mask, clip=None)
    assert float(loss_nc) == pytest.approx(0.5 * (1.0 + 1.0 + 0.49) / 3)
    # the clip range is centred on the old value: old 1, v 2, R 3 -> clipped v 1.5, 0.5 * 1.5^2
    one = torch.ones(1, 1, dtype=torch.float64)
    loss_c, _ = ppo.value_loss(2 * one, one, 3 * one, one.bool(), clip=0.5)
    assert float(loss_c) == pytest.approx(0.5 * 1.5 ** 2)


def test_value_loss_explained_var_vs_numpy():
    gen = torch.Generator().manual_seed(5)
    mask = random_mask(6, 10, gen)
    R = torch.randn(6, 10, generator=gen, dtype=torch.float64)
    v = R + 0.5 * torch.randn(6, 10, generator=gen, dtype=torch.float64)
    _, stats = ppo.value_loss(v, v, R, mask)
    r, p = R.numpy()[mask.numpy()], v.numpy()[mask.numpy()]
    assert float(stats["explained_var"]) == pytest.approx(1 - np.var(r - p) / np.var(r))
    _, stats = ppo.value_loss(R, R, R, mask)
    assert float(stats["explained_var"]) == pytest.approx(1.0)


# ----------------------------------------------------------------------------- group advantages
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_group_advantages_vs_naive(kind):
    gen = torch.Generator().manual_seed(7)
    group_ids = torch.tensor([7, 3, 7, 100, 3, 7, 3, 42, 7])  # 42 is a group of one
    B, T = len(group_ids), 5
    scores = torch.randn(B, generator=gen, dtype=torch.float64)
    mask = random_mask(B, T, gen)
    out = ppo.group_advantages(scores, group_ids, mask, kind)
    s, g = scores.numpy(), group_ids.numpy()
    for b in range(B):
        members = [s[j] for j in range(B) if g[j] == g[b]]
        others = [s[j] for j in range(B) if g[j] == g[b] and j != b]
        if len(members) < 2:
            expected = 0.0
        elif kind == "grpo":
            expected = (s[b] - np.mean(members)) / (np.std(members, ddof=1) + 1e-6)
        else:
            expected = s[b] - np.mean(others)
        for t in range(T):
            want = expected if mask[b, t] else 0.0
            assert float(out[b, t]) == pytest.approx(want, abs=1e-9)
    with pytest.raises(ValueError):
        ppo.group_advantages(scores, group_ids, mask, "ppo")


def test_group_advantages_equal_scores_are_zero():
    mask = torch.ones(4, 3, dtype=torch.bool)
    for kind in ("grpo", "rloo"):
        out = ppo.group_advantages(torch.ones(4), torch.tensor([0, 0, 1, 1]), mask, kind)
        assert torch.isfinite(out).all() and (out == 0).all()


# ----------------------------------------------------------------------------- KL controllers
def test_adaptive_kl_controller():
    c = ppo.AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    c.update(current_kl=12.0, n_steps=256)  # error 1.0 clipped to +0.2
    v1 = 0.1 * (1 + 0.2 * 256 / 10000)
    assert c.value == pytest.approx(v1)
    c.update(current_kl=3.0, n_steps=256)  # error -0.5 clipped to -0.2
    v2 = v1 * (1 - 0.2 * 256 / 10000)
    assert c.value == pytest.approx(v2)
    c.update(current_kl=torch.tensor(6.6), n_steps=100)  # error 0.1 inside the clip range
    v3 = v2 * (1 + 0.1 * 100 / 10000)
    assert c.value == pytest.approx(v3, rel=1e-6)
    c2 = ppo.AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    c2.load_state_dict(c.state_dict())
    assert c2.value == c.value
    c2.update(6.0, 1000)  # on target: unchanged
    assert c2.value == c.value
    assert math.isfinite(c2.value)


def test_kl_loss_k3_matches_naive_and_is_clamped():
    g = torch.Generator().manual_seed(0)
    logp, ref = -torch.rand(3, 5, generator=g) * 3, -torch.rand(3, 5, generator=g) * 3
    mask = torch.ones(3, 5)
    mask[0, 3:] = 0
    naive = [math.exp(r - p) - (r - p) - 1 for p, r, m in zip(logp.flatten().tolist(), ref.flatten().tolist(),
                                                               mask.flatten().tolist()) if m]
    assert float(ppo.kl_loss(logp, ref, mask, "k3")) == pytest.approx(sum(naive) / len(naive), rel=1e-5)
    # a token the reference finds near-impossible: the per-token value is capped at 10, the gradient finite
    far = torch.tensor([[-0.1, -0.2]], requires_grad=True)
    loss = ppo.kl_loss(far, torch.tensor([[-60.0, -0.2]]), torch.ones(1, 2), "k3")
    loss.backward()
    assert float(loss) == pytest.approx(5.0) and torch.isfinite(far.grad).all()
    assert float(ppo.kl_loss(logp, ref, mask, "k1")) == pytest.approx(float(ppo.masked_mean(logp - ref, mask)))
