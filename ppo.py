"""PPO maths for MuTIS: pure tensor functions, torch only, no I/O.

Everything works on response-aligned tensors of shape [B, T] (T = response length) and an
`action_mask` [B, T] that is True exactly on the tokens the policy sampled. Intervention
tokens (text the environment appended between turns) and padding are context, not actions:
they get no reward, no value target, no loss and no KL. Every function below masks with
`torch.where`, so garbage (even inf/nan) at non-action positions never leaks into results.

Sections, in the order train.py uses them:
  1. masked statistics     masked_mean, masked_var, masked_whiten
  2. rewards               kl_penalty, token_rewards
  3. advantages            compute_gae, group_advantages
  4. losses                rollout_is_weights, agg_loss, policy_loss, kl_loss, value_loss
  5. KL coefficient        FixedKLController, AdaptiveKLController

Loss statistics are returned as 0-dim detached tensors (not python floats), so a training
step never forces a device sync; call float() / .item() when logging.

References: Schulman et al. 2017 (PPO, clipped surrogate), Schulman et al. 2016 (GAE),
Ziegler et al. 2019 (per-token KL reward, adaptive KL controller), Ye et al. 2020 (dual clip),
Shao et al. 2024 (GRPO), Ahmadian et al. 2024 (RLOO), Yao et al. 2025 (truncated importance sampling).
"""
import math

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
IS_LEVELS = ("token", "sequence")


# ---------------------------------------------------------------------------------------
# 1. Masked statistics
# ---------------------------------------------------------------------------------------
def masked_mean(x, mask, dim=None):
    """Mean of x over positions where mask is true; 0 where nothing is selected."""
    mask = mask.bool()
    total = torch.where(mask, x, torch.zeros_like(x)).sum(dim=dim)
    count = mask.sum(dim=dim).clamp(min=1)  # empty selection -> 0, not nan
    return total / count


def masked_var(x, mask, dim=None):
    """Population variance (ddof=0, like numpy's default) of x over the mask."""
    mask = mask.bool()
    mean = masked_mean(x, mask, dim=dim)
    if dim is not None:
        mean = mean.unsqueeze(dim)
    return masked_mean((x - mean) ** 2, mask, dim=dim)


def masked_whiten(x, mask, shift_mean=True, eps=1e-8, sum_over_ranks=None):
    """(x - mean) / std over the mask (population std); zero outside the mask.
    shift_mean=False only rescales, keeping the mean (useful for rewards). sum_over_ranks: a function summing a
    list of floats over data-parallel ranks (train.py's all_reduce_sum); then mean and std are those of every
    rank's masked entries, so that all ranks' advantages share one scale."""
    mask = mask.bool()
    if sum_over_ranks is None:
        mean, var = masked_mean(x, mask), masked_var(x, mask)
    else:
        xm = torch.where(mask, x, torch.zeros_like(x))
        total, total_sq, count = sum_over_ranks([float(xm.sum()), float((xm * xm).sum()), float(mask.sum())])
        m = total / max(count, 1)
        mean = torch.tensor(m, dtype=x.dtype, device=x.device)
        var = torch.tensor(max(total_sq / max(count, 1) - m * m, 0.0), dtype=x.dtype, device=x.device)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask, out, torch.zeros_like(out))


# ---------------------------------------------------------------------------------------
# 2. Rewards: per-token KL penalty to the reference policy + sequence score
# ---------------------------------------------------------------------------------------
def kl_penalty(logprobs, ref_logprobs, kind="k1"):
    """Per-token estimator of KL(pi || pi_ref) from tokens sampled from pi. # [B, T]
    k1 = log r (unbiased, can be < 0), k2 = (log r)^2 / 2 (biased, >= 0),
    k3 = exp(-log r) + log r - 1 (unbiased, >= 0), with log r = logp - ref (Schulman's 'Approximating KL')."""
    log_ratio = logprobs - ref_logprobs  # [B, T]
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio ** 2
    if kind == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1
    raise ValueError(f"ppo.kl_penalty: unknown kind {kind!r} (expected k1, k2 or k3)")


def token_rewards(scores, kl, action_mask, kl_coef):
    """r_t = -kl_coef * kl_t on action tokens, plus scores[b] on row b's last action token. # [B, T]
    Rows with no action token get all zeros (their score has no token to sit on)."""
    mask = action_mask.bool()  # [B, T]
    B, T = mask.shape
    rewards = torch.where(mask, -kl_coef * kl, torch.zeros_like(kl))  # [B, T]
    pos = torch.arange(T, device=mask.device).expand(B, T)  # [B, T]
    last = torch.where(mask, pos, -1).max(dim=1).values  # [B], -1 when the row has no action
    scores = torch.as_tensor(scores, dtype=rewards.dtype, device=rewards.device)  # [B]
    is_last = pos == last.unsqueeze(1)  # [B, T], never true for rows without actions
    return rewards + torch.where(is_last, scores.unsqueeze(1), torch.zeros_like(rewards))


# ---------------------------------------------------------------------------------------
# 3. Advantages
# ---------------------------------------------------------------------------------------
@torch.no_grad()  # advantages and returns are targets: no gradient flows through them
def compute_gae(rewards, values, action_mask, gamma, lam):
    """GAE over action tokens only. Returns (advantages, returns), both [B, T].

    Non-action positions are skipped as if deleted: for an action position t with next action
    position t' in the same row (V(t') = 0, A(t') = 0 when there is none),
        delta_t   = r_t + gamma * V(t') - V(t)
        A_t       = delta_t + gamma * lam * A(t')
        returns_t = A_t + V(t)
    Advantages and returns are 0 at non-action positions; rewards and values there are ignored.
    """
    mask = action_mask.bool()  # [B, T]
    B, T = mask.shape
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)  # V(t') per row
    next_adv = torch.zeros_like(next_value)  # A(t') per row
    zero = torch.zeros_like(next_value)
    advs = [None] * T
    for t in reversed(range(T)):  # vectorised over rows; carries the next *action* token's state
        m = mask[:, t]  # [B]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advs[t] = torch.where(m, adv, zero)
        # a non-action token is transparent: the carried values pass through it unchanged
        next_value = torch.where(m, values[:, t], next_value)
        next_adv = torch.where(m, adv, next_adv)
    advantages = torch.stack(advs, dim=1)  # [B, T]
    returns = torch.where(mask, advantages + values, torch.zeros_like(advantages))  # [B, T]
    return advantages, returns


@torch.no_grad()
def group_advantages(scores, group_ids, action_mask, kind, eps=1e-6):
    """Critic-free advantages from the scores of responses to the same prompt. # [B, T]
      grpo: (s - group mean) / (group std + eps), std with Bessel's correction (ddof=1)
      rloo: s - mean of the other responses in the group
    Groups of size 1 get 0 (no baseline exists). The per-sequence value is broadcast to the
    sequence's action tokens and is 0 elsewhere. group_ids: LongTensor [B], any integer labels."""
    mask = action_mask.bool()  # [B, T]
    scores = torch.as_tensor(scores, device=mask.device)  # [B]
    scores = scores if scores.is_floating_point() else scores.float()
    _, gid = torch.unique(group_ids.to(mask.device), return_inverse=True)  # [B] labels -> 0..G-1
    zeros_g = scores.new_zeros(int(gid.max()) + 1 if gid.numel() else 0)  # [G]
    count = zeros_g.index_add(0, gid, torch.ones_like(scores))  # [G]
    total = zeros_g.index_add(0, gid, scores)  # [G]
    n, s_sum = count[gid], total[gid]  # [B] per-row group size and group sum
    solo = n < 2
    if kind == "grpo":
        mean = s_sum / n
        sq = zeros_g.index_add(0, gid, (scores - mean) ** 2)[gid]  # [B] group sum of squares
        std = torch.sqrt(sq / (n - 1).clamp(min=1))
        adv = (scores - mean) / (std + eps)
    elif kind == "rloo":
        adv = scores - (s_sum - scores) / (n - 1).clamp(min=1)
    else:
        raise ValueError(f"ppo.group_advantages: unknown kind {kind!r} (expected grpo or rloo)")
    adv = torch.where(solo, torch.zeros_like(adv), adv)  # [B]
    return torch.where(mask, adv.unsqueeze(1), adv.new_zeros(mask.shape))


# ---------------------------------------------------------------------------------------
# 4. Losses
# ---------------------------------------------------------------------------------------
@torch.no_grad()  # weights, not a path for gradients
def rollout_is_weights(old_logprobs, rollout_logprobs, action_mask, cap=2.0, level="token"):
    """Truncated importance sampling (TIS) for the sampler/trainer mismatch (Yao et al. 2025, "Your efficient RL
    framework secretly brings you off-policy RL training"; TRL and veRL call it rollout IS). The engine samples
    from pi_rollout (its own kernels and precision), the PPO ratio is taken against pi_old (the trainer's
    log-probs of the same tokens), so the samples are off-policy by pi_old / pi_rollout; its weight, capped at
    C, multiplies the per-token surrogate:
      token:    w_t = min(exp(old_t - rollout_t), C)
      sequence: w_t = min(exp(sum over the row's action tokens of (old - rollout)), C), one per row
    Returns (weights [B, T], 0 outside the action mask; stats over action tokens: is_weight_mean (after the cap),
    is_clipped_share (tokens whose weight the cap lowered; at sequence level, the tokens of such rows))."""
    mask = action_mask.bool()  # [B, T]
    log_ratio = torch.where(mask, old_logprobs.float() - rollout_logprobs.float(), 0.0)  # [B, T]
    if level == "sequence":
        log_ratio = log_ratio.sum(1, keepdim=True).expand_as(log_ratio)  # [B, T], the row's total on every token
    elif level != "token":
        raise ValueError(f"ppo.rollout_is_weights: unknown level {level!r} (expected one of {', '.join(IS_LEVELS)})")
    log_cap = math.log(cap)  # a number, not a CPU tensor: the log-probs may live on a GPU
    clipped = mask & (log_ratio > log_cap)
    weights = torch.where(mask, torch.exp(torch.clamp(log_ratio, max=log_cap)), 0.0)  # clamp first: no inf
    stats = {"is_weight_mean": masked_mean(weights, mask), "is_clipped_share": masked_mean(clipped.float(), mask)}
    return weights, stats


def agg_loss(loss_mat, mask, agg="token-mean"):
    """Reduce a per-token loss [B, T] to a scalar over the mask.
      token-mean:          sum over all action tokens / number of action tokens
      seq-mean-token-mean: mean over rows of (mean over the row's action tokens)
      seq-mean-token-sum:  mean over rows of (sum over the row's action tokens)
    The seq-mean modes average over rows that have at least one action token."""
    mask = mask.bool()
    if agg == "token-mean":
        return masked_mean(loss_mat, mask)
    has_action = mask.any(dim=1)  # [B]
    if agg == "seq-mean-token-mean":
        per_seq = masked_mean(loss_mat, mask, dim=1)  # [B]
    elif agg == "seq-mean-token-sum":
        per_seq = torch.where(mask, loss_mat, torch.zeros_like(loss_mat)).sum(dim=1)  # [B]
    else:
        raise ValueError(f"ppo.agg_loss: unknown agg {agg!r} (expected one of {', '.join(AGG_MODES)})")
    return masked_mean(per_seq, has_action)


def policy_loss(logprobs, old_logprobs, advantages, action_mask, clip_low=0.2, clip_high=0.2,
                dual_clip=None, agg="token-mean", is_weights=None):
    """PPO clipped surrogate (Schulman et al. 2017, eq. 7), as a loss to minimise:
        L_t = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - clip_low, 1 + clip_high))
    Dual clip (Ye et al. 2020): for A_t < 0 the loss is also capped at -A_t * dual_clip, so one
    token with a huge ratio cannot dominate. is_weights [B, T] (rollout_is_weights, or None): each token's
    clipped loss is multiplied by its weight before aggregation. Returns (loss, stats); stats over action tokens:
      clipfrac      fraction where the clipped term is active (strictly larger)
      dual_clipfrac fraction where the dual-clip cap is active (0 when dual_clip is None)
      approx_kl     mean k3 estimate of KL(pi_old || pi) = ratio - 1 - log(ratio)
      ratio_mean, ratio_max
    """
    mask = action_mask.bool()  # [B, T]
    advantages = advantages.detach()
    old_logprobs = old_logprobs.detach()
    log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)  # pessimistic bound
    dual_active = torch.zeros_like(mask)
    if dual_clip is not None:
        if dual_clip <= 1:
            raise ValueError(f"ppo.policy_loss: dual_clip must be > 1, got {dual_clip}")
        cap = -advantages * dual_clip  # [B, T]
        dual_active = (advantages < 0) & (pg > cap)
        pg = torch.where(dual_active, cap, pg)
    if is_weights is not None:
        pg = pg * is_weights.detach()  # [B, T]; padding's garbage stays out: agg_loss masks with where
    loss = agg_loss(pg, mask, agg)
    with torch.no_grad():
        stats = {
            "clipfrac": masked_mean((pg_clipped > pg_unclipped).float(), mask),
            "dual_clipfrac": masked_mean(dual_active.float(), mask),
            # samples came from pi_old, so KL(old || new) is estimated with k3(old, new)
            "approx_kl": masked_mean(kl_penalty(old_logprobs, logprobs, "k3"), mask),
            "ratio_mean": masked_mean(ratio, mask),
            "ratio_max": torch.where(mask, ratio, torch.zeros_like(ratio)).max(),  # 0 if no action
        }
    return loss, {k: v.detach() for k, v in stats.items()}


def kl_loss(logprobs, ref_logprobs, action_mask, kind="k3", agg="token-mean"):
    """KL(pi || pi_ref) as a loss term instead of a reward (GRPO, Shao et al. 2024, eq. 3, k3 by default).
    For k3 the log-ratio is clamped to [-20, 20] and the per-token value to [-10, 10], as veRL clamps its
    low-variance KL, so one token the reference finds near-impossible cannot blow up the loss. # scalar"""
    if kind == "k3":
        log_ratio = (logprobs - ref_logprobs).clamp(-20, 20)  # [B, T]
        kl = torch.clamp(torch.exp(-log_ratio) + log_ratio - 1, -10, 10)
    else:
        kl = kl_penalty(logprobs, ref_logprobs, kind)
    return agg_loss(kl, action_mask, agg)


def value_loss(values, old_values, returns, action_mask, clip=0.5, agg="token-mean"):
    """Clipped value loss: 0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2).
    clip=None gives the plain 0.5 * (v - R)^2. Returns (loss, stats); stats over action tokens:
      vf_clipfrac    fraction where the clipped term is active (strictly larger)
      explained_var  1 - Var[R - v] / Var[R] (population variances; nan when Var[R] = 0)
      value_mean     mean predicted value
    """
    mask = action_mask.bool()  # [B, T]
    old_values, returns = old_values.detach(), returns.detach()
    err_unclipped = (values - returns) ** 2  # [B, T]
    if clip is None:
        err_clipped = err_unclipped
    else:
        v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        err_clipped = (v_clipped - returns) ** 2
    loss = agg_loss(0.5 * torch.maximum(err_unclipped, err_clipped), mask, agg)
    with torch.no_grad():
        var_r = masked_var(returns, mask)
        var_res = masked_var(returns - values, mask)
        stats = {
            "vf_clipfrac": masked_mean((err_clipped > err_unclipped).float(), mask),
            "explained_var": torch.where(var_r > 0, 1 - var_res / var_r, torch.full_like(var_r, float("nan"))),
            "value_mean": masked_mean(values, mask),
        }
    return loss, {k: v.detach() for k, v in stats.items()}


# ---------------------------------------------------------------------------------------
# 5. KL coefficient controllers (Ziegler et al. 2019)
# ---------------------------------------------------------------------------------------
class FixedKLController:
    """Constant KL coefficient (the MuTIS default, 0.001)."""

    def __init__(self, kl_coef):
        self.value = float(kl_coef)

    def update(self, current_kl, n_steps):
        pass

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = float(state["value"])


class AdaptiveKLController:
    """Steers the observed KL towards `target`:
        err = clip(current_kl / target - 1, -0.2, 0.2);  value *= 1 + err * n_steps / horizon
    n_steps is the number of samples (episodes) in the batch that produced current_kl."""

    def __init__(self, init_kl_coef, target, horizon):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"ppo.AdaptiveKLController: target and horizon must be > 0, got {target}, {horizon}")
        self.value, self.target, self.horizon = float(init_kl_coef), float(target), float(horizon)

    def update(self, current_kl, n_steps):
        err = min(max(float(current_kl) / self.target - 1, -0.2), 0.2)
        self.value *= 1 + err * n_steps / self.horizon

    def state_dict(self):
        return {"value": self.value}  # target/horizon come from the run's flags

    def load_state_dict(self, state):
        self.value = float(state["value"])
