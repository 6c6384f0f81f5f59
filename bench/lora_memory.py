"""The trainer's memory on one rank, full fine-tuning against --lora-rank, counted from the real tensors.

    python bench/lora_memory.py                       # SmolLM2-135M, --adv gae and grpo, rank 16
    python bench/lora_memory.py --model DIR --lora-rank 8 --rows 8 --tokens 512

Builds the models as train.py does (train_setup.load_models: FSDP2 on one rank, the trainer's dtype), runs one
micro-batch of `rows` x `tokens` through the actor's log-probs and backward, one optimiser step, and counts bytes:
weights (trained and frozen), gradients, optimiser state, and activations (what autograd saved for backward, each
storage once, parameters not counted). Every figure is exact for these tensors; the allocator's own overhead and
the CPU's autocast weight cache are not in them.
"""
import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train  # noqa: E402
import train_setup  # noqa: E402
from infra import packing  # noqa: E402
from infra.collectives import close_distributed, init_distributed  # noqa: E402
from infra.system import choose_dtype, quiet_logs  # noqa: E402
from model import resolve_model, token_logprobs  # noqa: E402

MIB = 2 ** 20


def nbytes(t):
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def saved_bytes(fn, exclude):
    """fn() under a saved-tensors hook -> (fn's result, bytes autograd saved for backward: each storage once, none of
    the storages in `exclude`)."""
    seen = set(exclude)
    total = [0]

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        return fn(), total[0]


def measure(flags, rows, tokens, device):
    args = train.parse_args(["--data", "arith_train", "--steps", "1", *flags])
    args.dtype = choose_dtype(args.dtype, device)[0]
    run = SimpleNamespace(model_path=resolve_model(args.model), device=device, total_steps=1)
    train_setup.load_models(args, run)
    models = [m for m in (run.actor, run.ref, run.critic) if m is not None]
    params = [p for m in models for p in m.parameters()]
    out = {"trained weights": sum(nbytes(p) for p in params if p.requires_grad),
           "frozen weights": sum(nbytes(p) for p in params if not p.requires_grad)}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 5000, (rows, tokens), generator=g)
    mb = packing.from_padded(ids, torch.ones_like(ids), tokens // 3)
    mb = {k: v.to(device) if torch.is_tensor(v) else v for k, v in mb.items()}
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bfloat16" else torch.autocast(
        device.type, enabled=False)
    exclude = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr() for p in params}
    run.actor.train()
    with autocast:
        logp, out["activations (actor, one micro-batch)"] = saved_bytes(lambda: token_logprobs(run.actor, mb), exclude)
    (-logp.float().mean()).backward()
    out["gradients"] = sum(nbytes(p.grad) for p in run.actor.parameters() if p.grad is not None)
    run.actor_opt.step()
    out["optimiser state"] = sum(nbytes(v) for s in run.actor_opt.state.values() for v in s.values()
                                 if torch.is_tensor(v) and v.dim())
    if run.critic_opt is not None:  # the critic's state, as it stands after its own step (same shapes)
        out["optimiser state"] += 2 * sum(nbytes(p) for p in run.critic.parameters() if p.requires_grad)
    out["total"] = sum(out.values())
    return args.dtype, out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--rows", type=int, default=8, help="trajectories in the micro-batch")
    ap.add_argument("--tokens", type=int, default=192, help="tokens per trajectory (prompt a third)")
    args = ap.parse_args(argv)
    quiet_logs()
    _, _, _, device = init_distributed()
    cols = {}
    for adv in ("gae", "grpo"):
        for name, extra in (("full", []), (f"LoRA r={args.lora_rank}", ["--lora-rank", str(args.lora_rank)])):
            dtype, cols[f"{adv}, {name}"] = measure(["--model", args.model, "--adv", adv, *extra], args.rows,
                                                    args.tokens, device)
    print(f"{args.model}, one rank, trainer dtype {dtype}, one micro-batch of {args.rows} x {args.tokens} tokens; MiB")
    print("\n| | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    for key in next(iter(cols.values())):
        print(f"| {key} | " + " | ".join(f"{c[key] / MIB:.1f}" for c in cols.values()) + " |")
    close_distributed()


if __name__ == "__main__":
    main()
