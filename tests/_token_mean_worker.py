"""Run by tests/test_packing.py with 1 rank (plain python) or 2 (torchrun): one train.ppo_update from the same weights
for each micro-batch rule, on a fixed global mini-batch whose rows carry very different numbers of tokens. Rank r takes
rows r::world, so with 2 ranks rank 0 holds the short responses and rank 1 the long ones.

    _token_mean_worker.py MODEL OUT [TOKENS ...]   # each TOKENS: micro-batches by that token budget; "none": a row each

Writes, for each TOKENS, the updated full parameters, the statistics and every rank's number of forward calls (rank
0) to OUT.TOKENS; token-mean must give the same step whatever the split."""
import contextlib
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import model as M  # noqa: E402
import train  # noqa: E402
from infra import packing  # noqa: E402
from infra import collectives, hf, sharding  # noqa: E402


def global_batch(model):
    """4 rows: prompts of 5 tokens; responses of 8 tokens with 3 action tokens in rows 0/2, of 40 tokens with 35
    in rows 1/3 (an intervention-like stretch of context after the first 20)."""
    g = torch.Generator().manual_seed(0)
    B, P, R = 4, 5, 40
    batch = dict(prompt_ids=torch.randint(3, 4000, (B, P), generator=g), prompt_mask=torch.ones(B, P, dtype=torch.long),
                 response_ids=torch.randint(3, 4000, (B, R), generator=g),
                 response_mask=torch.zeros(B, R, dtype=torch.long), action_mask=torch.zeros(B, R))
    for row, (n_tokens, n_actions) in enumerate(((8, 3), (40, 35), (8, 3), (40, 35))):
        batch["response_mask"][row, :n_tokens] = 1
        batch["action_mask"][row, :n_actions] = 1
        batch["action_mask"][row, 20:25] = 0
    with torch.no_grad():
        old = M.token_logprobs(model, packing.pack(batch, torch.arange(B), "cpu"))  # ratio 1: the gradient is -A * grad log p per token
    batch.update(old_logprobs=old, ref_logprobs=old, advantages=torch.randn(B, R, generator=g))
    return batch


def main():
    model_dir, out, budgets = sys.argv[1], sys.argv[2], sys.argv[3:]
    rank, world, _, device = collectives.init_distributed()
    batch = global_batch(hf.load_causal_lm(model_dir))
    mine = {k: v[rank::world] for k, v in batch.items()}
    for budget in budgets:
        update(model_dir, mine, None if budget == "none" else int(budget), f"{out}.{budget}", rank, world, device)
    collectives.close_distributed()


def update(model_dir, mine, tokens, out, rank, world, device):
    actor = sharding.shard(hf.load_causal_lm(model_dir))
    calls = []
    actor.register_forward_pre_hook(lambda *_: calls.append(1))
    args = SimpleNamespace(micro_batch_size=1, loss_agg="token-mean", clip_low=0.2, clip_high=0.2, dual_clip=None,
                           entropy_coef=0.0, kl_loss_coef=0.0, temperature=1.0, grad_clip=1e9,
                           rollout_is_cap=0.0)  # no rollout log-probs here
    opt = torch.optim.SGD(actor.parameters(), lr=1.0)
    micro = packing.micro_batches(mine, torch.arange(len(mine["action_mask"])), args.micro_batch_size, tokens, device)
    stats, skipped = train.ppo_update(actor, None, opt, None, mine, micro, args, contextlib.nullcontext, device)
    params = {n: t.clone() for n, t in sharding.full_state_dict(actor)}
    every = [None] * world
    dist.all_gather_object(every, len(calls))
    if rank == 0:
        torch.save({"params": params, "skipped": skipped, "stats": stats, "calls": every}, out)


if __name__ == "__main__":
    main()
    from infra.system import exit_without_teardown

    exit_without_teardown()  # as the CLIs end
