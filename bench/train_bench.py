"""Trainer throughput on the CPU, one run, ratios (target >= 0.95 each):

  1. update: train.ppo_update (FSDP2-wrapped actor, packed micro-batches, chunked head under checkpointing,
     entropy, clip + AdamW step) over a plain forward + backward of the same tokens on the bare HF model (one
     unpadded sequence at a time, logits of the response positions, log-prob + entropy);
  2. log-probs: packing.forward_pass with model.token_logprobs twice (reference, old) over two plain no-grad
     forwards of the same tokens on the bare model (one unpadded sequence at a time);
  plus the padding waste of each phase (share of computed tokens that are padding), the dtype and the CPU's bf16
  flags. Each phase runs once untimed, then timed (a step after the first). --code DIR runs the same measurement
  through an earlier commit's code (git archive COMMIT | tar -x -C DIR): before/after on one machine.

The batch is rollout-like (the demo's shape): 24 SmolLM2 trajectories of 80-120 prompt and 64-192 response
tokens, a third of them with an intervention (12 context tokens, action mask 0) after each 64-token turn.

    python bench/train_bench.py                     # dtype auto (system.choose_dtype)
    python bench/train_bench.py --dtype float32 --micro-batch-size 4
    python bench/train_bench.py --glibc-default      # without system.keep_freed_memory (before/after)
    python bench/train_bench.py --code .before       # the padded trainer of an earlier commit
    python bench/train_bench.py --compile            # train.py's --compile (the warm-up step compiles)
"""
import argparse
import importlib
import json
import math
import os
import subprocess
import sys
import time
from contextlib import nullcontext

import torch

from trainer_phases import Phases, load_code, plain_pass, rollout_like


def say(msg):
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def cpu_name(S):
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    text = S._cpuinfo_text() or ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="HF model directory or alias")
    p.add_argument("--dtype", default="auto", help="auto | bfloat16 | float32 (train.py's --dtype)")
    p.add_argument("--trajectories", type=int, default=24, help="rollout batch (the demo: 4 prompts x 6)")
    p.add_argument("--micro-batch-size", type=int, default=8, help="train.py's --micro-batch-size (the demo's: 8)")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="train.py's --micro-batch-tokens")
    p.add_argument("--attn-implementation", default="varlen", help="train.py's --attn-implementation")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--code", default=None, help="import the trainer from this directory (an earlier commit's files)")
    p.add_argument("--compile", action="store_true", help="train.py's --compile: actor and reference compiled")
    p.add_argument("--glibc-default", action="store_true",
                   help="leave glibc's malloc as it is (no system.keep_freed_memory), for a before/after")
    args = p.parse_args()
    code = load_code(args.code)
    M, S, parallel, train = code.model, code.system, code.parallel, code.train
    S.quiet_logs()
    t_start = time.time()
    rank, world, _, device = parallel.init_distributed()
    kept = not args.glibc_default and S.keep_freed_memory(device)
    dtype, why = S.choose_dtype(args.dtype, device)
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if dtype == "bfloat16" else nullcontext
    path = M.resolve_model(args.model)
    flags = ["--data", "arith_train", "--adv", "grpo", "--samples-per-prompt", "6", "--dtype", dtype,
             "--micro-batch-size", str(args.micro_batch_size), "--temperature", str(args.temperature),
             "--actor-lr", "3e-5", "--actor-warmup-ratio", "0"]
    attn = args.attn_implementation if code.packing else "sdpa"  # the padded trainer had no varlen kernel
    if code.packing:
        flags += ["--attn-implementation", attn] + (["--micro-batch-tokens", str(args.micro_batch_tokens)]
                                                    if args.micro_batch_tokens else [])
    targs = train.parse_args(flags)
    text = S._cpuinfo_text() or ""
    words = set(text.split())
    cpu_flags = [f for f in ("avx512f", *S.CPU_BF16_FLAGS) if f in words]
    print(f"cpu: {cpu_name(S)} | flags: {' '.join(cpu_flags) or '-'} | threads {torch.get_num_threads()} | "
          f"dtype {dtype} ({why}) | freed memory {'kept' if kept else 'returned to the OS (glibc default)'} | "
          f"code {args.code or 'this checkout'} ({'packed' if code.packing else 'padded'}, attention {attn}"
          f"{', compiled' if args.compile else ''})",
          flush=True)

    tokenizer = M.load_tokenizer(path)
    bare = M.load_causal_lm(path).to(device)
    actor = parallel.shard(M.load_causal_lm(path, attn_implementation=attn).to(device))
    ref = parallel.shard(M.load_causal_lm(path, attn_implementation=attn).to(device))
    ref.requires_grad_(False)
    if args.compile:
        M.compile_model(actor)
        M.compile_model(ref)
    opt = code.setup.make_optimizer(actor, targs.actor_lr, targs.weight_decay)
    trajs = rollout_like(args.trajectories, bare.config.vocab_size, args.seed)
    batch = importlib.import_module("rollout").to_batch(trajs, tokenizer.pad_token_id)
    real_tokens = sum(len(t["prompt_ids"]) + len(t["response_ids"]) for t in trajs)
    B = len(trajs)
    print(f"batch: {B} trajectories, {real_tokens} tokens ({batch['prompt_ids'].shape[1]} + "
          f"{batch['response_ids'].shape[1]} columns), micro-batch {args.micro_batch_tokens or args.micro_batch_size}"
          f" {'tokens' if args.micro_batch_tokens else 'rows'}", flush=True)
    phases = Phases(code, targs, autocast, device)
    action_mask = batch["action_mask"].float()
    score = torch.randint(0, 2, (B,), generator=torch.Generator().manual_seed(args.seed)).float()
    adv = (score - score.mean()) / (score.std() + 1e-6)
    mini_size = B // 2  # train.py's default: half the batch
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(targs.seed + 1))
    minis = [perm[s:s + mini_size] for s in range(0, B, mini_size)]

    # Every phase runs twice on the same batch and the second run is timed: a training step after the first has its
    # kernels, FSDP's lazy init, Adam's state and the allocator's memory ready, and so has every plain pass.
    for timed in (False, True):
        # ---- 2. reference + old log-probs: the trainer's no-grad pass twice vs two plain no-grad forwards
        t0 = time.perf_counter()
        ref_lp = phases.logprobs(ref, batch)
        old_lp = phases.logprobs(actor, batch)
        t_lp = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(2):
            plain_pass(bare, trajs, autocast, False, args.temperature, device)
        t_lp_plain = time.perf_counter() - t0

        # ---- 1. the PPO update: train.ppo_update over the mini-batches as train.py's loop makes them
        batch.update(old_logprobs=old_lp, ref_logprobs=ref_lp, advantages=adv[:, None] * action_mask,
                     action_mask=action_mask)
        t0 = time.perf_counter()
        for mini in minis:
            phases.update(actor, opt, batch, mini)
        t_up = time.perf_counter() - t0
        t0 = time.perf_counter()
        plain_pass(bare, trajs, autocast, True, args.temperature, device)
        bare.zero_grad(set_to_none=True)
        t_up_plain = time.perf_counter() - t0
        say(f"{'timed' if timed else 'warm-up'}: log-probs {t_lp:.1f}s, plain {t_lp_plain:.1f}s; update {t_up:.1f}s, "
            f"plain {t_up_plain:.1f}s ({time.time() - t_start:.0f}s)")
    # what the update does beyond forward + backward: clip + AdamW once per mini-batch (timed again on the actor)
    t0 = time.perf_counter()
    for _ in minis:
        for prm in actor.parameters():  # the update frees its gradients after the step: give the step some
            prm.grad = torch.zeros_like(prm)
        torch.nn.utils.clip_grad_norm_(actor.parameters(), targs.grad_clip, foreach=True)
        opt.step()
    t_opt = time.perf_counter() - t0
    pad_lp = phases.padding(batch, phases.micro(batch, torch.arange(B)))
    pad_up = phases.padding(batch, [g for mini in minis for g in phases.micro(batch, mini)])

    res = dict(dtype=dtype, cpu=cpu_name(S), bf16_flags=[f for f in cpu_flags if f in S.CPU_BF16_FLAGS],
               code=args.code or "this checkout", attention=attn, compiled=args.compile, freed_memory_kept=kept,
               tokens=real_tokens,
               update_ratio=round(t_up_plain / t_up, 3), update_s=round(t_up, 2), update_plain_s=round(t_up_plain, 2),
               update_optimizer_s=round(t_opt, 2),
               update_ratio_without_optimizer=round(t_up_plain / max(t_up - t_opt, 1e-9), 3),
               logprobs_ratio=round(t_lp_plain / t_lp, 3), logprobs_s=round(t_lp, 2),
               logprobs_plain_s=round(t_lp_plain, 2),
               padding_waste_logprobs=round(pad_lp, 3), padding_waste_update=round(pad_up, 3),
               peak_rss_gb=round(S.peak_rss_gb(), 1), kernel_s=round(os.times().system, 1),
               load_average=[round(x, 2) for x in os.getloadavg()], seconds=round(time.time() - t_start, 1))
    print(f"update    {real_tokens / t_up:7.0f} tok/s vs plain {real_tokens / t_up_plain:7.0f} tok/s: "
          f"ratio {res['update_ratio']:.2f} (target >= 0.95; {t_opt:.1f}s of {t_up:.1f}s is clip + AdamW, "
          f"without it {res['update_ratio_without_optimizer']:.2f}), padding {pad_up:.1%}")
    print(f"log-probs {2 * real_tokens / t_lp:7.0f} tok/s vs plain {2 * real_tokens / t_lp_plain:7.0f} tok/s: "
          f"ratio {res['logprobs_ratio']:.2f} (target >= 0.95), padding {pad_lp:.1%}")
    print(json.dumps(res))
    if math.isnan(float(old_lp.sum())):
        print("warning: NaN log-probs", file=sys.stderr)


if __name__ == "__main__":
    main()
