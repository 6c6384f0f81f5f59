"""Run by tests/test_lora.py under `torchrun --nproc_per_node 2`: LoRA adapters sharded by FSDP2 against plain PyTorch.

Every rank builds the adapted model twice: sharded as train.py loads it (meta device, each rank's rows from the file,
adapters from lora.initial_value), and whole (lora.adapt on a loaded model). One AdamW step each on the same
global batch (the sharded one on its slice), then the merged engine weights against W + s B A computed here from
the whole model's tensors. Rank 0 writes the measured differences to OUT/result.json; the test holds thresholds.
"""
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _fsdp_worker import batch, max_diff, policy_loss  # noqa: E402

from infra import lora  # noqa: E402
from infra import collectives, hf, weights  # noqa: E402

RANK, ALPHA = 4, 8.0


def adapted(model):
    return lora.adapt(model, hf.decoder_layers(model), RANK, ALPHA, lora.TARGETS, torch.float32, seed=5)


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def set_rows(p, value, rank, world):
    """p = value: a whole parameter, or this rank's rows of a sharded one (FSDP2 shards dim 0 as torch.chunk)."""
    with torch.no_grad():
        if hasattr(p, "to_local"):
            local, chunk = p.to_local(), -(-value.shape[0] // world)
            local.copy_(value[rank * chunk:rank * chunk + local.shape[0]])
        else:
            p.copy_(value)


def main():
    model_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    rank, world, _, device = collectives.init_distributed()
    ids, mask, start = (t.to(device) if torch.is_tensor(t) else t for t in batch(world))
    rows = ids.shape[0] // world
    mine = (ids[rank * rows:(rank + 1) * rows], mask[rank * rows:(rank + 1) * rows], start)
    res = {}

    build = functools.partial(hf.load_causal_lm, model_dir)
    sharded = weights.load_sharded(lambda meta: adapted(build(meta=meta)), model_dir, device,
                                    init_missing=functools.partial(lora.initial_value, seed=5))
    plain = adapted(build()).to(device)
    res["init_diff"] = max_diff({n: full(p) for n, p in sharded.named_parameters()},
                                {n: p.detach() for n, p in plain.named_parameters()})
    res["trained"] = sorted(n for n, p in sharded.named_parameters() if p.requires_grad)
    res["expected_trained"] = sorted(f"{n}.lora_{x}.weight" for n, _ in lora.adapted_layers(plain) for x in "AB")
    frozen_before = {n: p.detach().clone() for n, p in plain.named_parameters() if not p.requires_grad}

    grads = []  # plain's, then sharded's: {name: full gradient} of the trained parameters
    for m, slices in ((plain, [(ids[r * rows:(r + 1) * rows], mask[r * rows:(r + 1) * rows], start)
                                for r in range(world)]), (sharded, [mine])):
        for i, (name, layer) in enumerate(lora.adapted_layers(m)):  # B = 0 gives A no gradient: a non-zero B first
            b = layer.lora_B.weight
            set_rows(b, torch.randn(tuple(b.shape), generator=torch.Generator().manual_seed(i)) * 0.05, rank, world)
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
        for s in slices:
            (policy_loss(m, *s) / len(slices)).backward()
        grads.append({n: full(p.grad) for n, p in m.named_parameters() if p.requires_grad})
        opt.step()
    res["grad_diff"] = max_diff(grads[1], grads[0])
    res["grad_max"] = max(g.abs().max().item() for g in grads[0].values())

    p_plain = {n: p.detach() for n, p in plain.named_parameters()}
    p_sharded = {n: full(p) for n, p in sharded.named_parameters()}
    res["step_diff"] = max_diff(p_sharded, p_plain)
    initial = {n: lora.initial_value(n, tuple(p_plain[n].shape), seed=5).to(device) for n in res["expected_trained"]}
    res["a_moved"] = max((p_plain[n] - initial[n]).abs().max().item()
                         for n in res["expected_trained"] if "lora_A" in n)  # the step changed the adapters
    res["frozen_moved"] = max_diff({n: p_plain[n] for n in frozen_before}, frozen_before)

    # the engine's weights: the whole base, each adapted W as W + (alpha / r) B A from the whole model, by hand
    merged = dict(lora.merged_weights(sharded, torch.float32))
    want = {n: p for n, p in p_plain.items() if ".lora_" not in n}
    want.update({f"{n}.weight": p_plain[f"{n}.weight"] + ALPHA / RANK * p_plain[f"{n}.lora_B.weight"]
                 @ p_plain[f"{n}.lora_A.weight"] for n, _ in lora.adapted_layers(plain)})
    res["merged_names_equal"] = list(merged) == list(want)
    res["merged_diff"] = max_diff(merged, want)
    if rank == 0:
        (out_dir / "result.json").write_text(json.dumps(res))
    collectives.close_distributed()


if __name__ == "__main__":
    main()
    from infra.system import exit_without_teardown

    exit_without_teardown()  # as the CLIs end
