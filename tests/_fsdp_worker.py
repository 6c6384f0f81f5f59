"""Run by tests/test_model.py under `torchrun --nproc_per_node 2`: FSDP2 against plain PyTorch.

Every rank holds an unsharded copy too. The global batch has one slice per rank; FSDP averages
the per-rank gradients, so the unsharded copy takes the mean of the per-slice losses.
Rank 0 writes the measured differences to OUT_JSON; the test holds the thresholds.
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import model as M  # noqa: E402
from infra import packing  # noqa: E402
from infra import collectives, hf, hf_export, sharding  # noqa: E402


def batch(world, rows=2, prompt=6, response=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 5000, (world * rows, prompt + response), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[-1, :2] = 0
    mask[1, -3:] = 0  # right padding
    return ids, mask, prompt


def policy_loss(m, ids, mask, start):
    logp, ent = M.token_logprobs(m, packing.from_padded(ids, mask, start), temperature=0.8, with_entropy=True,
                                 chunk_size=7)
    resp = mask[:, start:].float()
    return -((logp - 0.01 * ent) * resp).sum() / resp.sum()


def value_loss(c, ids, mask, start):
    resp = mask[:, start:].float()
    return (((c(packing.from_padded(ids, mask, start)) - 1.0) ** 2) * resp).sum() / resp.sum()


def step(m, loss_fn, slices):
    """One AdamW step; returns the parameters' gradients as HF-named full tensors."""
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1)
    for ids, mask, start in slices:
        (loss_fn(m, ids, mask, start) / len(slices)).backward()
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for n, p in m.named_parameters()}
    opt.step()
    return grads


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in b)


def main():
    model_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    rank, world, _, device = collectives.init_distributed()  # CPU/gloo, or this rank's GPU when the test has 2
    torch.manual_seed(0)
    ids, mask, start = (t.to(device) if torch.is_tensor(t) else t for t in batch(world))
    rows = ids.shape[0] // world
    mine = [(ids[rank * rows:(rank + 1) * rows], mask[rank * rows:(rank + 1) * rows], start)]
    all_slices = [(ids[r * rows:(r + 1) * rows], mask[r * rows:(r + 1) * rows], start) for r in range(world)]
    res = {}

    for kind, load, loss_fn in (("policy", hf.load_causal_lm, policy_loss), ("critic", M.load_critic, value_loss)):
        plain, sharded = load(model_dir).to(device), load(model_dir).to(device)
        if kind == "critic":  # a non-zero head, so the backbone gets gradients too
            for m in (plain, sharded):
                torch.nn.init.normal_(m.value_head.weight, std=0.1, generator=torch.Generator(device).manual_seed(3))
        before = {n: p.detach().clone() for n, p in plain.named_parameters()}
        plain.train(), sharded.train()
        sharding.shard(sharded, grad_checkpointing=True)
        g_plain = step(plain, loss_fn, all_slices)
        g_sharded = step(sharded, loss_fn, mine)
        p_plain = dict(plain.named_parameters())
        p_sharded = dict(sharding.full_state_dict(sharded))
        res[f"{kind}_names_equal"] = sorted(p_sharded) == sorted(n for n, _ in plain.named_parameters())
        res[f"{kind}_grad_diff"] = max_diff(g_sharded, g_plain)
        res[f"{kind}_grad_max"] = max(g.abs().max().item() for g in g_plain.values())
        res[f"{kind}_param_diff"] = max((p_sharded[n] - p.detach()).abs().max().item() for n, p in p_plain.items())
        res[f"{kind}_param_moved"] = max_diff(p_sharded, before)  # the step did change the weights

        # export: every rank runs the sharded forward (collectives), rank 0 reloads and compares
        sharded.eval()
        with torch.no_grad():
            if kind == "policy":
                hf_export.save_hf(sharded, hf.load_tokenizer(model_dir), out_dir / kind, dtype=torch.float32)
                out = M.token_logprobs(sharded, packing.from_padded(ids, mask, start))
                want = sharded(input_ids=ids, attention_mask=mask).logits
            else:
                hf_export.save_critic(sharded, out_dir / kind)
                out = sharded(packing.from_padded(ids, mask, start))
        if rank == 0:
            with torch.no_grad():
                if kind == "policy":
                    from safetensors import safe_open
                    with safe_open(str(out_dir / kind / "model.safetensors"), "pt") as f:
                        res["saved_has_lm_head"] = "lm_head.weight" in f.keys()
                    reloaded = hf.load_causal_lm(str(out_dir / kind)).to(device).eval()
                    res["reload_logits_diff"] = (reloaded(input_ids=ids, attention_mask=mask).logits - want).abs().max().item()
                    res["reload_logprobs_diff"] = (M.token_logprobs(reloaded, packing.from_padded(ids, mask, start)) - out).abs().max().item()
                else:
                    reloaded = M.load_critic(str(out_dir / kind)).to(device).eval()
                    res["reload_values_diff"] = (reloaded(packing.from_padded(ids, mask, start)) - out).abs().max().item()
    if rank == 0:
        (out_dir / "result.json").write_text(json.dumps(res))
    collectives.close_distributed()


if __name__ == "__main__":
    main()
    from infra.system import exit_without_teardown

    exit_without_teardown()  # as the CLIs end
