"""Trainer throughput, one run, ratios (target >= 0.8 each):

  1. update: train.ppo_update (FSDP2-wrapped actor, micro_slices padding, micro-batching, chunked head under
     checkpointing, entropy, clip + AdamW step) over a plain forward + backward of the same tokens on the bare
     HF model (one unpadded sequence at a time, logits of the response positions, log-prob + entropy);
  2. log-probs: parallel.forward_pass with model.token_logprobs twice (reference, old) over two plain no-grad
     forwards of the same tokens on the bare model (one unpadded sequence at a time);
  plus the padding waste of each phase (share of computed tokens that are padding, micro-batched as train.py
  does it), the dtype and the CPU's bf16 flags. Each phase runs once untimed, then timed (a step after the first).

The batch is rollout-like (the demo's shape): 24 SmolLM2 trajectories of 80-120 prompt and 64-192 response
tokens, a third of them with an intervention (12 context tokens, action mask 0) after their first 64-token turn.

    python bench/train_bench.py                     # dtype auto (model.choose_dtype)
    python bench/train_bench.py --dtype float32 --micro-batch-size 4
    python bench/train_bench.py --glibc-default      # without model.keep_freed_memory (before/after)
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import model as M  # noqa: E402
import parallel  # noqa: E402
import train  # noqa: E402


def say(msg):
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def cpu_name():
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    text = M._cpuinfo_text() or ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")


def rollout_like(n, vocab, seed, turn=64, intervention=12):
    """Trajectories as rollout.sample returns them (prompt ids, response ids, action mask)."""
    g = torch.Generator().manual_seed(seed)
    ints = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    trajs = []
    for i in range(n):
        p, r = ints(80, 120), ints(64, 192)
        action = [1] * r
        if i % 3 == 0 and r > turn + intervention:  # cut after the first turn, intervention, second turn
            action[turn:turn + intervention] = [0] * intervention
        trajs.append(dict(prompt_ids=torch.randint(0, vocab, (p,), generator=g).tolist(),
                          response_ids=torch.randint(0, vocab, (r,), generator=g).tolist(),
                          action_mask=action, rollout_logprobs=[0.0] * r))
    return trajs


def to_batch(trajs, pad_id):
    import rollout

    return rollout.to_batch(trajs, pad_id)


def plain_pass(model, trajs, autocast, grad, temperature):
    """The bare model, one unpadded sequence at a time: forward (head on the response positions only), log-prob
    of each response token (+ entropy and backward when grad)."""
    for t in trajs:
        ids = torch.tensor([t["prompt_ids"] + t["response_ids"]])
        r = len(t["response_ids"])
        with (nullcontext() if grad else torch.no_grad()), autocast():
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=r + 1).logits[:, :-1].float() / temperature
            logp = torch.log_softmax(logits, -1)
            token = logp.gather(-1, ids[:, -r:, None]).squeeze(-1)
            if grad:
                entropy = -(logp.exp() * logp).sum(-1)
                (token.sum() + 0.001 * entropy.sum()).backward()


SLICES = []  # (computed, real) tokens of every micro-batch parallel.micro_slices cut


def _recording_micro_slices(batch, rows, device, _cut=parallel.micro_slices):
    out = _cut(batch, rows, device)
    SLICES.append((out["attention_mask"].numel(), int(out["attention_mask"].sum())))
    return out


def padding_waste(slices):
    """Share of the computed tokens that are padding."""
    return 1 - sum(r for _, r in slices) / max(sum(c for c, _ in slices), 1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="HF model directory or alias")
    p.add_argument("--dtype", default="auto", help="auto | bfloat16 | float32 (train.py's --dtype)")
    p.add_argument("--trajectories", type=int, default=24, help="rollout batch (the demo: 4 prompts x 6)")
    p.add_argument("--micro-batch-size", type=int, default=8, help="train.py's --micro-batch-size (the demo's: 8)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--glibc-default", action="store_true",
                   help="leave glibc's malloc as it is (no model.keep_freed_memory), for a before/after")
    args = p.parse_args()
    M.quiet_logs()
    t_start = time.time()
    rank, world, _, device = parallel.init_distributed()
    kept = not args.glibc_default and M.keep_freed_memory(device)
    dtype, why = M.choose_dtype(args.dtype, device)
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if dtype == "bfloat16" else nullcontext
    path = M.resolve_model(args.model)
    targs = train.parse_args(["--data", "arith_train", "--adv", "grpo", "--samples-per-prompt", "6", "--dtype", dtype,
                              "--micro-batch-size", str(args.micro_batch_size), "--temperature", str(args.temperature),
                              "--actor-lr", "3e-5", "--actor-warmup-ratio", "0"])
    text = M._cpuinfo_text() or ""
    words = set(text.split())
    flags = [f for f in ("avx512f", *M.CPU_BF16_FLAGS) if f in words]
    print(f"cpu: {cpu_name()} | flags: {' '.join(flags) or '-'} | threads {torch.get_num_threads()} | "
          f"dtype {dtype} ({why}) | freed memory {'kept' if kept else 'returned to the OS (glibc default)'}",
          flush=True)

    tokenizer = M.load_tokenizer(path)
    bare = M.load_causal_lm(path).to(device)
    actor = parallel.shard(M.load_causal_lm(path).to(device))
    ref = parallel.shard(M.load_causal_lm(path).to(device))
    ref.requires_grad_(False)
    opt = train.make_optimizer(actor, targs.actor_lr, targs.weight_decay)
    trajs = rollout_like(args.trajectories, bare.config.vocab_size, args.seed)
    batch = to_batch(trajs, tokenizer.pad_token_id)
    real_tokens = sum(len(t["prompt_ids"]) + len(t["response_ids"]) for t in trajs)
    B, mb = len(trajs), args.micro_batch_size
    print(f"batch: {B} trajectories, {real_tokens} tokens ({batch['prompt_ids'].shape[1]} + "
          f"{batch['response_ids'].shape[1]} columns), micro-batch {mb}", flush=True)

    lp = lambda m, x: M.token_logprobs(m, x["input_ids"], x["attention_mask"], x["response_start"],  # noqa: E731
                                       temperature=args.temperature)
    action_mask = batch["action_mask"].float()
    score = torch.randint(0, 2, (B,), generator=torch.Generator().manual_seed(args.seed)).float()
    adv = (score - score.mean()) / (score.std() + 1e-6)
    mini_size = B // 2  # train.py's default: half the batch
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(targs.seed + 1))
    minis = [perm[s:s + mini_size] for s in range(0, B, mini_size)]
    parallel.micro_slices = train.micro_slices = _recording_micro_slices  # padding as cut (forward_pass, ppo_update)

    # Every phase runs twice on the same batch and the second run is timed: a training step after the first has its
    # kernels, FSDP's lazy init, Adam's state and the allocator's memory ready, and so has every plain pass.
    for timed in (False, True):
        # ---- 2. reference + old log-probs: parallel.forward_pass twice vs two plain no-grad forwards
        SLICES.clear()
        t0 = time.perf_counter()
        ref_lp = parallel.forward_pass(lambda x: lp(ref, x), batch, mb, autocast, device)
        old_lp = parallel.forward_pass(lambda x: lp(actor, x), batch, mb, autocast, device)
        t_lp = time.perf_counter() - t0
        lp_slices = list(SLICES)
        t0 = time.perf_counter()
        for _ in range(2):
            plain_pass(bare, trajs, autocast, grad=False, temperature=args.temperature)
        t_lp_plain = time.perf_counter() - t0

        # ---- 1. the PPO update: train.ppo_update over the mini-batches as train.py's loop makes them
        batch.update(old_logprobs=old_lp, ref_logprobs=ref_lp, advantages=adv[:, None] * action_mask,
                     action_mask=action_mask)
        SLICES.clear()
        t0 = time.perf_counter()
        for mini in minis:
            train.ppo_update(actor, None, opt, None, batch, mini, targs, autocast, device)
        t_up = time.perf_counter() - t0
        up_slices = list(SLICES)
        t0 = time.perf_counter()
        plain_pass(bare, trajs, autocast, grad=True, temperature=args.temperature)
        bare.zero_grad(set_to_none=True)
        t_up_plain = time.perf_counter() - t0
        say(f"{'timed' if timed else 'warm-up'}: log-probs {t_lp:.1f}s, plain {t_lp_plain:.1f}s; update {t_up:.1f}s, "
            f"plain {t_up_plain:.1f}s ({time.time() - t_start:.0f}s)")
    # what the update does beyond forward + backward: clip + AdamW once per mini-batch (timed again on the actor)
    t0 = time.perf_counter()
    for _ in minis:
        torch.nn.utils.clip_grad_norm_(actor.parameters(), targs.grad_clip, foreach=True)
        opt.step()
    t_opt = time.perf_counter() - t0

    res = dict(dtype=dtype, cpu=cpu_name(), bf16_flags=[f for f in flags if f in M.CPU_BF16_FLAGS],
               freed_memory_kept=kept, tokens=real_tokens,
               update_ratio=round(t_up_plain / t_up, 3), update_s=round(t_up, 2), update_plain_s=round(t_up_plain, 2),
               update_optimizer_s=round(t_opt, 2),
               update_ratio_without_optimizer=round(t_up_plain / max(t_up - t_opt, 1e-9), 3),
               logprobs_ratio=round(t_lp_plain / t_lp, 3), logprobs_s=round(t_lp, 2),
               logprobs_plain_s=round(t_lp_plain, 2),
               padding_waste_logprobs=round(padding_waste(lp_slices), 3),
               padding_waste_update=round(padding_waste(up_slices), 3),
               peak_rss_gb=round(M.peak_rss_gb(), 1), kernel_s=round(os.times().system, 1),
               load_average=[round(x, 2) for x in os.getloadavg()], seconds=round(time.time() - t_start, 1))
    print(f"update    {real_tokens / t_up:7.0f} tok/s vs plain {real_tokens / t_up_plain:7.0f} tok/s: "
          f"ratio {res['update_ratio']:.2f} (target >= 0.8; {t_opt:.1f}s of {t_up:.1f}s is clip + AdamW, "
          f"without it {res['update_ratio_without_optimizer']:.2f}), padding {res['padding_waste_update']:.1%}")
    print(f"log-probs {2 * real_tokens / t_lp:7.0f} tok/s vs plain {2 * real_tokens / t_lp_plain:7.0f} tok/s: "
          f"ratio {res['logprobs_ratio']:.2f} (target >= 0.8), padding {res['padding_waste_logprobs']:.1%}")
    print(json.dumps(res))
    if math.isnan(float(old_lp.sum())):
        print("warning: NaN log-probs", file=sys.stderr)


if __name__ == "__main__":
    main()
