"""MuTIS: PPO with multi-turn intervention sampling, on FSDP2 with a colocated vLLM engine.

    torchrun --nproc_per_node 8 train.py --data data/limo --model /path/to/hf_model
    python train.py --data arith_train --val-data arith_test --steps 2     # one process

Per step: rollout (multi-turn, vLLM) -> score -> ref/old log-probs and values -> token rewards
-> advantages over action tokens -> PPO epochs (actor, critic) -> sync weights to the engine
-> log -> validate -> checkpoint. Every rank owns one vLLM engine and samples its own shard of
the global batch; actor, critic and reference are FSDP2-sharded across ranks.
"""
import argparse
import json
import math
import os
import random
import shutil
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import data as data_lib
import ppo
import reward
import rollout
from model import (ArgumentParser, check_attn_implementation, choose_dtype, die, end_of_turn_ids, full_state_dict,
                   init_distributed, load_causal_lm, load_critic, load_tokenizer, peak_rss_gb, quiet_logs, resolve_model,
                   save_critic, save_hf, shard, token_logprobs, values)


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    # what to train on
    a("--model", default="smollm2", help="policy: HF model directory or the 'smollm2' alias")
    a("--critic-model", default=None, help="critic backbone (default: the policy's)")
    a("--data", required=True, help="training data: bundled name, .jsonl/.parquet file or a directory")
    a("--val-data", default=None, help="validation data (same forms as --data)")
    a("--val-limit", type=int, default=None, help="use only the first N validation prompts")
    a("--system-prompt", default=None, help="eval | train | none | literal text (default: the eval prompt for raw "
                                            "problems; parquet prompts as stored)")
    a("--out", default="runs/mutis", help="output directory: checkpoints, metrics.jsonl, curves.png")
    # schedule
    a("--steps", type=int, default=None, help="training steps (overrides --epochs)")
    a("--epochs", type=int, default=1, help="passes over the training data when --steps is not given")
    a("--batch-size", type=int, default=64, help="prompts per step, global")
    # --n is ambiguous to torchrun's own parser (--nnodes, --nproc-per-node ...): use --samples-per-prompt there
    a("--n", "--samples-per-prompt", dest="n", type=int, default=8, help="samples per prompt")
    a("--mini-batch-size", type=int, default=None,
      help="trajectories per optimiser step, global (default: half the batch, two steps as in the reference run)")
    a("--micro-batch-size", type=int, default=4, help="trajectories per forward/backward on one rank")
    a("--ppo-epochs", type=int, default=1, help="passes over each rollout batch")
    # optimisation
    a("--actor-lr", type=float, default=1e-6, help="actor learning rate")
    a("--critic-lr", type=float, default=1e-5, help="critic learning rate")
    a("--actor-warmup-ratio", type=float, default=0.95, help="share of steps with linear LR warm-up (actor)")
    a("--critic-warmup-ratio", type=float, default=0.05, help="share of steps with linear LR warm-up (critic)")
    a("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    a("--grad-clip", type=float, default=1.0, help="max gradient norm")
    a("--entropy-coef", type=float, default=0.001, help="entropy bonus coefficient")
    # algorithm
    a("--kl-coef", type=float, default=0.001, help="KL penalty coefficient in the token reward (gae, rloo)")
    a("--kl-loss-coef", type=float, default=None, help="KL-to-reference loss coefficient (default: 0.001 for grpo, else 0)")
    a("--kl-loss-kind", default="k3", choices=["k1", "k2", "k3"], help="KL estimator of the loss term (k3 clamped, as veRL)")
    a("--kl-kind", default="k1", choices=["k1", "k2", "k3"], help="per-token KL estimator")
    a("--kl-target", type=float, default=None, help="adaptive KL controller target (default: fixed coefficient)")
    a("--kl-horizon", type=float, default=10000, help="adaptive KL controller horizon")
    a("--gamma", type=float, default=1.0, help="discount")
    a("--lam", type=float, default=1.0, help="GAE lambda")
    a("--clip-low", type=float, default=0.2, help="PPO ratio clip below 1")
    a("--clip-high", type=float, default=0.2, help="PPO ratio clip above 1")
    a("--dual-clip", type=float, default=None, help="dual-clip constant (> 1) for negative advantages")
    a("--value-clip", type=float, default=0.5, help="value loss clip")
    a("--loss-agg", default="token-mean", choices=ppo.AGG_MODES, help="loss aggregation")
    a("--adv", default="gae", choices=["gae", "grpo", "rloo"], help="advantage estimator (grpo/rloo need no critic)")
    a("--no-whiten", action="store_true", help="do not whiten GAE advantages")
    # rollout
    a("--max-turns", type=int, default=3, help="interventions per trajectory at most (0 = single turn)")
    a("--turn-tokens", type=int, default=1000, help="token budget of one turn")
    a("--max-prompt-length", type=int, default=2048, help="longest prompt in tokens")
    a("--truncate-prompts", action="store_true", help="left-truncate long prompts instead of failing")
    a("--max-response-length", type=int, default=None, help="cap on all response tokens (default: turns * budget + interventions)")
    a("--intervention-text", default="reference", help="reference (the authors' code, default) | paper | literal text")
    a("--turn-rule", default="reference", choices=rollout.TURN_RULES,
      help="reference: intervene on every answerless turn (the authors' code); paper: only on budget cuts")
    a("--no-cut-at-answer", dest="cut_at_answer", action="store_false",
      help="keep a turn's tokens after its first answer (scored on the last answer)")
    a("--stop", action="append", default=None, help="stop string that ends a turn (repeatable), e.g. </answer>")
    a("--temperature", type=float, default=1.0, help="sampling temperature")
    a("--top-p", type=float, default=1.0, help="nucleus sampling")
    a("--engine", default="vllm", choices=["vllm", "hf"], help="rollout engine")
    a("--engine-dtype", default="auto", help="rollout engine dtype: auto (bf16 on CUDA and on CPUs with native bf16, "
                                             "else float32; float32 for --engine hf) | bfloat16 | float32 | float16")
    a("--gpu-memory-utilization", type=float, default=0.4, help="vLLM share of GPU memory")
    a("--enforce-eager", action="store_true", help="vLLM without compilation (faster start)")
    a("--rollout-timeout", type=float, default=None, help="seconds per engine call before failing")
    # bookkeeping
    a("--save-freq", type=int, default=0, help="checkpoint every N steps (0 = only at the end)")
    a("--keep-last", type=int, default=None, help="keep only the newest K checkpoints")
    a("--test-freq", type=int, default=0, help="validate every N steps (0 = never)")
    a("--val-before-train", action="store_true", help="validate before the first step")
    a("--resume", action="store_true", help="continue from OUT/latest")
    a("--seed", type=int, default=0, help="seed for data order, sampling and init")
    a("--grad-checkpointing", action="store_true", help="activation checkpointing")
    a("--offload", action="store_true", help="FSDP2 CPU offload of parameters and optimiser state")
    a("--attn-implementation", default="sdpa", choices=["sdpa", "flash_attention_2", "eager"],
      help="transformers attention of actor, reference and critic (flash_attention_2 needs flash-attn and CUDA)")
    a("--dist-timeout", type=float, default=1800, help="seconds a collective may wait for the slowest rank (NCCL "
                                                       "watchdog): longer than the slowest rank's rollout")
    a("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
      help="compute dtype, params stay fp32 (auto: bf16 on CUDA and on CPUs with avx512_bf16/amx_bf16, else float32)")
    a("--verbose", action="store_true", help="show vLLM's and transformers' info logs")
    a("--max-bad-steps", type=int, default=5, help="stop after K non-finite updates in a row")
    a("--wandb", action="store_true", help="log to Weights & Biases")
    a("--tensorboard", action="store_true", help="log to OUT/tb")
    args = p.parse_args(argv)
    check_args(args)
    return args


def check_args(args):
    """Flags that cannot work fail here, in one line, before any model loads."""
    for flag in ("steps", "epochs", "batch_size", "n", "mini_batch_size", "micro_batch_size", "ppo_epochs",
                 "turn_tokens", "max_prompt_length", "max_response_length", "val_limit", "max_bad_steps"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            die(f"--{flag.replace('_', '-')} must be >= 1, got {value}" if flag != "n" else
                f"--samples-per-prompt must be >= 1, got {value}")
    if args.temperature <= 0:
        die(f"--temperature must be > 0 for training (the PPO ratio needs sampled log-probs), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        die(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.max_turns < 0:
        die(f"--max-turns must be >= 0, got {args.max_turns}")
    if args.adv in ("grpo", "rloo") and args.n < 2:
        die(f"--adv {args.adv} compares samples of the same prompt: needs --samples-per-prompt >= 2, got {args.n}")
    if args.kl_loss_coef is None:
        args.kl_loss_coef = 0.001 if args.adv == "grpo" else 0.0


# ----------------------------------------------------------------------------- helpers

def lr_lambda(total_steps, warmup_ratio):
    warmup = int(total_steps * warmup_ratio)
    return lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0


def all_reduce_sum(values_list, device):
    t = torch.tensor(values_list, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def check_shared_out(out, rank, world, device):
    """--out must be one directory for every rank (a filesystem shared by all nodes): rank 0 writes a token
    file there, every rank must read it back; otherwise every rank stops with one line."""
    if world == 1:
        return
    token = all_reduce_sum([float(random.SystemRandom().getrandbits(48)) if rank == 0 else 0.0], device)[0]
    path = out / f".shared-check-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}"
    if rank == 0:
        path.write_text(str(int(token)))
    barrier()
    try:
        seen = path.read_text() == str(int(token))
    except OSError:
        seen = False
    missing = all_reduce_sum([0.0 if seen else 1.0], device)[0]
    if rank == 0:
        path.unlink(missing_ok=True)
    if missing:
        die(f"--out {out}: {int(missing)} of {world} ranks do not see the file rank 0 wrote there; --out must be "
            f"on a filesystem shared by every node (checkpoints and metrics are written by rank 0 and read by all)")


def all_reduce_dict(d, device):
    """{name: local sum} -> {name: sum over ranks}; every rank passes the same keys."""
    keys = sorted(d)
    return dict(zip(keys, all_reduce_sum([float(d[k]) for k in keys], device)))


def micro_slices(batch, rows, device):
    """Cut a micro-batch of rows, drop the columns that are padding in all of them, move to device."""
    prompt_mask = batch["prompt_mask"][rows]                  # [b, P]
    response_mask = batch["response_mask"][rows]              # [b, R]
    first = int(prompt_mask.any(0).float().argmax())          # left padding shared by every row
    last = max(int(response_mask.sum(1).max()), 1)            # right padding shared by every row
    out = {k: v[rows][:, :last] for k, v in batch.items()
           if torch.is_tensor(v) and v.dim() == 2 and k not in ("prompt_ids", "prompt_mask")}
    out["input_ids"] = torch.cat([batch["prompt_ids"][rows][:, first:], batch["response_ids"][rows][:, :last]], 1)
    out["attention_mask"] = torch.cat([prompt_mask[:, first:], response_mask[:, :last]], 1)
    out = {k: v.to(device) for k, v in out.items()}
    out["response_start"] = batch["prompt_ids"].shape[1] - first
    return out


def micro_batches(batch, rows, size):
    """Split rows into micro-batches of rows with similar response lengths: micro_slices then drops only the
    columns that are padding in all of a micro-batch's rows. About half the padding of rows taken in order,
    the same number of micro-batches (FSDP needs the same number of calls on every rank)."""
    rows = rows[torch.argsort(batch["response_mask"][rows].sum(1), stable=True)]
    return [rows[i:i + size] for i in range(0, len(rows), size)]


def padding_counts(batch, groups):
    """{"padding", "computed"}: tokens micro_slices computes for these micro-batches, and how many are padding."""
    computed = real = 0
    for rows in groups:
        prompt_mask, response_mask = batch["prompt_mask"][rows], batch["response_mask"][rows]
        width = prompt_mask.shape[1] - int(prompt_mask.any(0).float().argmax()) + max(int(response_mask.sum(1).max()), 1)
        computed += len(rows) * width
        real += int(prompt_mask.sum() + response_mask.sum())
    return {"padding": computed - real, "computed": computed}


def forward_pass(fn, batch, micro_size, autocast, device, desc=None):
    """Run fn over micro-batches (micro_batches) without gradients; return [B, R] on the batch's full width,
    in batch order. desc: a transient progress bar with this label (None: no bar, e.g. on ranks other than 0)."""
    B, R = batch["response_ids"].shape
    out = torch.zeros(B, R)
    for rows in tqdm(micro_batches(batch, torch.arange(B), micro_size), desc=desc, disable=desc is None,
                     leave=False, unit="micro"):
        with torch.no_grad(), autocast():
            res = fn(micro_slices(batch, rows, device)).float()   # [b, r]
        out[rows, :res.shape[1]] = res.cpu()
    return out


def save_checkpoint(args, step, actor, critic, actor_opt, critic_opt, schedulers, tokenizer, state, rank):
    """Write OUT/step_N via a temporary directory and rename it; then point OUT/latest at it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    import torch.distributed.checkpoint as dcp

    out = Path(args.out)
    final, tmp = out / f"step_{step:06d}", out / f"step_{step:06d}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    save_hf(actor, tokenizer, tmp / "actor")
    sharded = {"actor": dict(zip(("model", "optim"), get_state_dict(actor, actor_opt)))}
    if critic is not None:
        sharded["critic"] = dict(zip(("model", "optim"), get_state_dict(critic, critic_opt)))
        save_critic(critic, tmp / "critic")
    dcp.save(sharded, checkpoint_id=str(tmp / "sharded"))
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
               tmp / f"rng_rank{rank}.pt")
    barrier()
    if rank == 0:
        state = dict(state, step=step, schedulers=[s.state_dict() for s in schedulers])
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
        os.replace(tmp, final)
        link = out / "latest.tmp"
        link.unlink(missing_ok=True)
        link.symlink_to(final.name)
        os.replace(link, out / "latest")  # atomic: latest always names a complete checkpoint
        if args.keep_last:
            for old in sorted(out.glob("step_[0-9]*[0-9]"))[:-args.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def load_checkpoint(path, actor, critic, actor_opt, critic_opt, schedulers, rank):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import torch.distributed.checkpoint as dcp

    sharded = {"actor": dict(zip(("model", "optim"), get_state_dict(actor, actor_opt)))}
    if critic is not None:
        sharded["critic"] = dict(zip(("model", "optim"), get_state_dict(critic, critic_opt)))
    dcp.load(sharded, checkpoint_id=str(path / "sharded"))
    set_state_dict(actor, actor_opt, model_state_dict=sharded["actor"]["model"],
                   optim_state_dict=sharded["actor"]["optim"])
    if critic is not None:
        set_state_dict(critic, critic_opt, model_state_dict=sharded["critic"]["model"],
                       optim_state_dict=sharded["critic"]["optim"])
    state = json.loads((path / "trainer_state.json").read_text())
    for sched, sd in zip(schedulers, state["schedulers"]):
        sched.load_state_dict(sd)
    rng = torch.load(path / f"rng_rank{rank}.pt", weights_only=False)
    random.setstate(rng["python"]), np.random.set_state(rng["numpy"]), torch.set_rng_state(rng["torch"])
    return state


def score(trajs, records, args):
    """Binary accuracy of each trajectory's final answer, read from the policy's own text (never an
    intervention); the first answer when turns are cut at it, else the last."""
    recs = [records[t["prompt_index"]] for t in trajs]
    return reward.score_batch([r["data_source"] for r in recs], [t["policy_text"] for t in trajs],
                              [r["ground_truth"] for r in recs], first=args.cut_at_answer)


def barrier():
    if dist.is_initialized():
        dist.barrier()


def validate(engine, val_prompts, val_records, args, intervention_ids, eos_ids, rank, world, device):
    """Greedy multi-turn on this rank's shard of the validation set; metrics summed over ranks."""
    idx = list(range(rank, len(val_prompts), world))
    ro = rollout.sample(engine, [val_prompts[i] for i in idx], prompt_indices=idx, n=1, turn_tokens=args.turn_tokens,
                        max_turns=args.max_turns, max_response_tokens=args.max_response_length, temperature=0.0,
                        seed=args.seed, stop=args.stop, turn_rule=args.turn_rule, cut_at_answer=args.cut_at_answer,
                        intervention_ids=intervention_ids, eos_ids=eos_ids, timeout=args.rollout_timeout,
                        desc="validate" if rank == 0 else None)
    scores = score(ro, val_records, args)
    acc, tokens, turns, answered, count = all_reduce_sum([
        sum(s["acc"] for s in scores), sum(len(t["response_ids"]) for t in ro),
        sum(t["turns"] for t in ro), sum(t["answered"] for t in ro), len(scores)], device)
    return {"val/acc": acc / count, "val/response_length": tokens / count, "val/turns": turns / count,
            "val/answered": answered / count}


# ----------------------------------------------------------------------------- main

def main(argv=None):
    args = parse_args(argv)
    quiet_logs(args.verbose)
    args.stop = args.stop or []
    if args.dist_timeout <= 0:
        die("--dist-timeout must be > 0 seconds")
    rank, world, local_rank, device = init_distributed(timeout=args.dist_timeout)
    master = rank == 0
    check_attn_implementation(args.attn_implementation, device)
    torch.manual_seed(args.seed), random.seed(args.seed), np.random.seed(args.seed)
    if args.batch_size % world:
        die(f"--batch-size {args.batch_size} must be divisible by the number of ranks ({world})")
    rollouts = args.batch_size * args.n
    mini_size = args.mini_batch_size or (rollouts // 2 if rollouts % (2 * world) == 0 else rollouts)
    if mini_size % world or (args.batch_size * args.n) % mini_size:
        die(f"--mini-batch-size {mini_size} must divide batch_size*n and be divisible by the number of ranks")
    # One optimiser step per batch and advantages that ignore pi_old (grpo): the old log-probs are exactly the
    # ones the update's own forward computes, so that forward pass is skipped
    reuse_old = args.adv == "grpo" and args.ppo_epochs == 1 and mini_size == rollouts
    if master and reuse_old:
        print("[setup] old log-probs: taken from the update's forward (grpo, one optimiser step per batch), "
              "one forward pass per step saved", flush=True)
    out = Path(args.out)
    if master:
        out.mkdir(parents=True, exist_ok=True)
    check_shared_out(out, rank, world, device)
    args.dtype, dtype_why = choose_dtype(args.dtype, device)
    args.engine_dtype, engine_dtype_why = choose_dtype(args.engine_dtype, device, engine=args.engine)
    if master:
        print(f"[setup] dtype {args.dtype} ({dtype_why}); {args.engine} engine dtype {args.engine_dtype} "
              f"({engine_dtype_why})", flush=True)
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if args.dtype == "bfloat16" else nullcontext

    # ---- data: every rank sees the same order and takes its own shard of each batch
    try:
        train_records = data_lib.load_dataset(args.data, system_prompt=args.system_prompt)
        val_records = (data_lib.load_dataset(args.val_data, system_prompt=args.system_prompt, limit=args.val_limit)
                       if args.val_data else [])
    except data_lib.DataError as e:
        die(str(e))
    model_path = resolve_model(args.model)
    tokenizer = load_tokenizer(model_path)
    try:  # tokenize once up front: a prompt over --max-prompt-length fails now, not hours in
        train_prompts, n_cut = rollout.prepare_prompts([data_lib.prompt_ids(tokenizer, r["messages"]) for r in train_records],
                                                       args.max_prompt_length, args.truncate_prompts)
        val_prompts, _ = rollout.prepare_prompts([data_lib.prompt_ids(tokenizer, r["messages"]) for r in val_records],
                                                 args.max_prompt_length, args.truncate_prompts)
    except rollout.PromptTooLong as e:
        die(f"--data: {e}")
    if n_cut and master:
        print(f"[data] left-truncated {n_cut} prompts to {args.max_prompt_length} tokens", flush=True)
    steps_per_epoch = len(train_records) // args.batch_size
    if steps_per_epoch == 0:
        die(f"--data {args.data}: {len(train_records)} prompts, fewer than --batch-size {args.batch_size}")
    total_steps = args.steps or steps_per_epoch * args.epochs

    # ---- models: actor, frozen reference, critic (GAE only); fp32 master weights, FSDP2-sharded
    mp = torch.bfloat16 if (args.dtype == "bfloat16" and device.type == "cuda") else None
    shard_kw = dict(mixed_precision=mp, offload=args.offload, grad_checkpointing=args.grad_checkpointing)
    attn = args.attn_implementation
    actor = shard(load_causal_lm(model_path, attn_implementation=attn).to(device), **shard_kw)
    ref = shard(load_causal_lm(model_path, attn_implementation=attn).to(device), mixed_precision=mp, offload=args.offload)
    ref.requires_grad_(False)
    use_critic = args.adv == "gae"
    critic = (shard(load_critic(resolve_model(args.critic_model or args.model), attn_implementation=attn).to(device),
                    **shard_kw) if use_critic else None)
    actor_opt = torch.optim.AdamW(actor.parameters(), lr=args.actor_lr, weight_decay=args.weight_decay)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=args.critic_lr, weight_decay=args.weight_decay) if use_critic else None
    schedulers = [torch.optim.lr_scheduler.LambdaLR(actor_opt, lr_lambda(total_steps, args.actor_warmup_ratio))]
    if use_critic:
        schedulers.append(torch.optim.lr_scheduler.LambdaLR(critic_opt, lr_lambda(total_steps, args.critic_warmup_ratio)))
    kl_ctl = (ppo.AdaptiveKLController(args.kl_coef, args.kl_target, args.kl_horizon) if args.kl_target
              else ppo.FixedKLController(args.kl_coef))

    # ---- rollout engine, colocated on this rank
    intervention_ids = rollout.intervention_ids(tokenizer, args.intervention_text)
    if args.max_response_length is None:  # every turn at full budget plus every intervention
        args.max_response_length = (args.max_turns + 1) * args.turn_tokens + args.max_turns * len(intervention_ids)
    longest_prompt = max(len(p) for p in train_prompts + val_prompts)
    engine = rollout.make_engine(model_path, kind=args.engine, dtype=args.engine_dtype, seed=args.seed,
                                 gpu_memory_utilization=args.gpu_memory_utilization,
                                 max_model_len=longest_prompt + args.max_response_length,
                                 enforce_eager=args.enforce_eager, distributed=world > 1,
                                 attn_implementation=args.attn_implementation)  # every rank, after the group exists
    eos_ids = end_of_turn_ids(model_path, tokenizer)

    start_step, state = 0, {}
    if args.resume and (out / "latest").exists():
        ckpt = (out / "latest").resolve()
        state = load_checkpoint(ckpt, actor, critic, actor_opt, critic_opt, schedulers, rank)
        kl_ctl.load_state_dict(state["kl_ctl"])
        start_step = state["step"]
        if master and (out / "metrics.jsonl").exists():  # forget steps logged after this checkpoint
            rows = [line for line in open(out / "metrics.jsonl") if json.loads(line)["step"] <= start_step]
            (out / "metrics.jsonl.tmp").write_text("".join(rows))
            os.replace(out / "metrics.jsonl.tmp", out / "metrics.jsonl")
        engine.sync_weights(full_state_dict(actor))
        if master:
            print(f"[resume] {ckpt} at step {start_step}", flush=True)

    stop_requested = []
    signal.signal(signal.SIGTERM, lambda *_: stop_requested.append(True))
    logger = make_logger(args, out) if master else None
    val_history = []
    if args.val_before_train and val_records and start_step == 0:
        t0 = time.time()
        m = validate(engine, val_prompts, val_records, args, intervention_ids, eos_ids, rank, world, device)
        val_history.append((0, m))
        if master:
            print(f"[val] step 0  acc {m['val/acc']:.3f}  tokens {m['val/response_length']:.1f}  "
                  f"turns {m['val/turns']:.2f}  ({time.time() - t0:.1f}s)", flush=True)
            logger({"step": 0, **m})

    bad_steps = 0
    for step in range(start_step + 1, total_steps + 1):
        timer = {}
        t_step = t0 = time.time()
        bar_label = (lambda phase: f"step {step} {phase}") if master else (lambda phase: None)  # tqdm on rank 0

        # ---- 1. rollout: this rank's share of the global batch, n samples each
        epoch, pos = divmod(step - 1, steps_per_epoch)
        order = np.random.default_rng(args.seed + epoch).permutation(len(train_records))
        batch_idx = [int(i) for i in order[pos * args.batch_size:(pos + 1) * args.batch_size][rank::world]]
        # seeds depend on (seed, step, prompt, sample, turn) only: any world size samples the same batch
        trajs = rollout.sample(engine, [train_prompts[i] for i in batch_idx], prompt_indices=batch_idx, n=args.n,
                               turn_tokens=args.turn_tokens, max_turns=args.max_turns,
                               max_response_tokens=args.max_response_length, temperature=args.temperature,
                               top_p=args.top_p, seed=args.seed * 1_000_003 + step, stop=args.stop,
                               turn_rule=args.turn_rule, cut_at_answer=args.cut_at_answer,
                               intervention_ids=intervention_ids, eos_ids=eos_ids,
                               timeout=args.rollout_timeout, desc=bar_label("rollout"))
        engine.sleep()  # frees the KV cache for training on GPU; a no-op on CPU
        batch = rollout.to_batch(trajs, tokenizer.pad_token_id)
        timer["rollout"] = time.time() - t0

        # ---- 2. score: binary accuracy on the final answer
        t0 = time.time()
        scores_d = score(trajs, train_records, args)
        scores = torch.tensor([s["score"] for s in scores_d], dtype=torch.float32)  # [B]
        timer["reward"] = time.time() - t0

        # ---- 3. reference and old log-probs, values (no grad, micro-batched)
        t0 = time.time()
        lp = lambda m, mb: token_logprobs(m, mb["input_ids"], mb["attention_mask"], mb["response_start"],  # noqa: E731
                                          temperature=args.temperature)
        fwd = dict(micro_size=args.micro_batch_size, autocast=autocast, device=device)
        ref_logprobs = forward_pass(lambda mb: lp(ref, mb), batch, **fwd, desc=bar_label("ref logprobs"))   # [B, R]
        old_logprobs = (None if reuse_old else                                                 # [B, R]
                        forward_pass(lambda mb: lp(actor, mb), batch, **fwd, desc=bar_label("old logprobs")))
        old_values = (forward_pass(lambda mb: values(critic, mb["input_ids"], mb["attention_mask"],
                                                     mb["response_start"]), batch, **fwd, desc=bar_label("values"))
                      if use_critic else None)                                                # [B, R]
        timer["logprobs"] = time.time() - t0

        # ---- 4. token rewards and advantages, over action tokens only
        action_mask = batch["action_mask"].float()                                  # [B, R]
        # KL(old || ref) per token; with reuse_old it is measured in the update (grpo's advantages ignore it)
        kl = ppo.kl_penalty(old_logprobs, ref_logprobs, args.kl_kind) if not reuse_old else torch.zeros_like(ref_logprobs)
        group_ids = torch.tensor([t["prompt_index"] for t in trajs])                 # [B]
        advantages, returns = compute_advantages(args, scores, kl, kl_ctl.value, old_values, action_mask,
                                                 group_ids, device)                 # [B, R] each (returns: GAE)
        batch.update(ref_logprobs=ref_logprobs, advantages=advantages, action_mask=action_mask)
        if not reuse_old:
            batch.update(old_logprobs=old_logprobs)
        if use_critic:
            batch.update(old_values=old_values, returns=returns)

        # ---- 5. PPO epochs over mini-batches, gradient accumulation over micro-batches
        t0 = time.time()
        stats, skipped, update_groups = [], 0, []
        local_mini = mini_size // world
        gen = torch.Generator().manual_seed(args.seed + step)
        progress = tqdm(total=args.ppo_epochs * math.ceil(len(trajs) / local_mini), desc=bar_label("update"),
                        disable=not master, leave=False, unit="mini")
        for _ in range(args.ppo_epochs):
            perm = torch.randperm(len(trajs), generator=gen)
            for start in range(0, len(trajs), local_mini):
                mini = perm[start:start + local_mini]
                update_groups += micro_batches(batch, mini, args.micro_batch_size)  # as ppo_update cuts them
                s, n_skipped = ppo_update(actor, critic, actor_opt, critic_opt, batch, mini, args, autocast, device)
                stats.append(s)
                skipped += n_skipped
                progress.update()
        progress.close()
        for sched in schedulers:
            sched.step()
        bad_steps = bad_steps + 1 if skipped else 0
        timer["update"] = time.time() - t0

        # ---- 6. sync the new weights into the engine
        t0 = time.time()
        engine.sync_weights(full_state_dict(actor))  # wakes a sleeping engine: weights, load, then KV cache
        timer["sync"] = time.time() - t0

        # ---- 7. log: sums over every rank's trajectories
        act = action_mask.bool()
        pad_lp = padding_counts(batch, micro_batches(batch, torch.arange(len(trajs)), args.micro_batch_size))
        pad_up = padding_counts(batch, update_groups)
        totals = all_reduce_dict({
            "pad_lp": pad_lp["padding"], "computed_lp": pad_lp["computed"],
            "pad_up": pad_up["padding"], "computed_up": pad_up["computed"],
            "score": float(scores.sum()), "acc": sum(s["acc"] for s in scores_d), "count": len(trajs),
            "tokens": float(batch["response_mask"].sum()), "turns": sum(t["turns"] for t in trajs),
            "interventions": sum(t["interventions"] for t in trajs), "truncated": sum(t["truncated"] for t in trajs),
            "answered": sum(t["answered"] for t in trajs), "cut_turns": sum(t["cut_turns"] for t in trajs),
            "kl": float(kl[act].sum()), "actions": float(act.sum()),
            "logprob_gap": 0.0 if reuse_old else float((batch["rollout_logprobs"] - old_logprobs).abs()[act].sum())},
            device)
        count, actions = totals["count"], max(totals["actions"], 1.0)
        timer["step"] = time.time() - t_step
        metrics = {"step": step, "reward/mean": totals["score"] / count, "acc/mean": totals["acc"] / count,
                   "response_length/mean": totals["tokens"] / count, "turns/mean": totals["turns"] / count,
                   "interventions/mean": totals["interventions"] / count,
                   "truncated/share": totals["truncated"] / count, "answered/share": totals["answered"] / count,
                   "turns/cut_at_answer_share": totals["cut_turns"] / max(totals["turns"], 1),
                   "kl": totals["kl"] / actions, "kl_coef": kl_ctl.value,  # this step's coefficient
                   "rollout/logprob_gap": totals["logprob_gap"] / actions,
                   "padding/logprobs": totals["pad_lp"] / max(totals["computed_lp"], 1),
                   "padding/update": totals["pad_up"] / max(totals["computed_up"], 1),
                   "actor_lr": schedulers[0].get_last_lr()[0], "skipped_updates": skipped,
                   "throughput/tokens_per_s": totals["tokens"] / timer["step"], "peak_rss_gb": peak_rss_gb()}
        for key in sorted({k for s in stats for k in s}):  # a skipped update leaves its statistics out
            kept = [s[key] for s in stats if key in s and math.isfinite(s[key])]
            metrics[key] = float(np.mean(kept)) if kept else float("nan")
        metrics.update({f"time/{k}": v for k, v in timer.items()})
        kl_ctl.update(metrics["kl"], args.batch_size * args.n)

        if args.test_freq and val_records and (step % args.test_freq == 0 or step == total_steps):
            t0 = time.time()
            m = validate(engine, val_prompts, val_records, args, intervention_ids, eos_ids, rank, world, device)
            val_history.append((step, m))
            metrics.update(m, **{"time/validate": time.time() - t0})
        if master:
            logger(metrics)
            print(format_line(metrics, total_steps), flush=True)

        if bad_steps >= args.max_bad_steps:
            die(f"{bad_steps} steps in a row had a non-finite loss or gradient norm; stopping "
                f"(last good checkpoint: {out / 'latest'})")
        stop = bool(all_reduce_sum([float(bool(stop_requested))], device)[0])
        if (args.save_freq and step % args.save_freq == 0) or step == total_steps or stop:
            t0 = time.time()
            save_checkpoint(args, step, actor, critic, actor_opt, critic_opt, schedulers, tokenizer,
                            {"kl_ctl": kl_ctl.state_dict(), "data_position": step * args.batch_size,
                             "args": vars(args)}, rank)
            if master:
                print(f"[ckpt] step {step} -> {out}/step_{step:06d} ({time.time() - t0:.1f}s)", flush=True)
        if stop:
            if master:
                print(f"[signal] SIGTERM: checkpointed step {step}, exiting", flush=True)
            break

    if master:
        report(val_history, out)
    engine.close()  # vLLM's teardown also destroys the default process group under torchrun
    if dist.is_initialized():
        dist.destroy_process_group()


def ppo_update(actor, critic, actor_opt, critic_opt, batch, mini, args, autocast, device):
    """One optimiser step of the actor and one of the critic on a mini-batch of trajectories (this rank's
    rows `mini`) -> (statistics averaged over every rank's action tokens, number of skipped steps)."""
    tokens = all_reduce_sum([float(batch["action_mask"][mini].sum())], device)[0]  # the global mini-batch's
    stats, skipped = {}, 0
    steps = [(actor, actor_opt, lambda mb: actor_loss(actor, mb, args), "grad_norm")]
    if critic is not None:
        steps.append((critic, critic_opt, lambda mb: critic_loss(critic, mb, args), "critic_grad_norm"))
    for model, opt, loss_fn, norm_key in steps:
        s, grad_norm, ok = accumulate_and_step(model, opt, loss_fn, batch, mini, tokens, args, autocast, device)
        stats.update(s, **{norm_key: grad_norm})
        skipped += not ok
    return stats, skipped


def actor_loss(actor, mb, args):
    """PPO clipped surrogate - entropy bonus (+ KL-to-reference loss, GRPO) on one micro-batch."""
    mask = mb["action_mask"]                                                         # [b, r]
    logprobs, entropy = token_logprobs(actor, mb["input_ids"], mb["attention_mask"], mb["response_start"],
                                       temperature=args.temperature, with_entropy=True)  # [b, r] each
    old = mb.get("old_logprobs")
    if old is None:  # the one optimiser step on this batch: pi_old is the policy computing these log-probs
        old = logprobs.detach().float()
        s = {"kl": ppo.masked_mean(ppo.kl_penalty(old, mb["ref_logprobs"], args.kl_kind), mask),
             "rollout/logprob_gap": ppo.masked_mean((mb["rollout_logprobs"] - old).abs(), mask)}
    else:
        s = {}
    pg, pg_stats = ppo.policy_loss(logprobs.float(), old, mb["advantages"], mask,
                                   args.clip_low, args.clip_high, args.dual_clip, args.loss_agg)
    s.update(pg_stats)
    ent = ppo.agg_loss(entropy.float(), mask, args.loss_agg)
    loss = pg - args.entropy_coef * ent
    s.update(pg_loss=pg.detach(), entropy=ent.detach())
    if args.kl_loss_coef:
        kl = ppo.kl_loss(logprobs.float(), mb["ref_logprobs"], mask, args.kl_loss_kind, args.loss_agg)
        loss = loss + args.kl_loss_coef * kl
        s.update(kl_loss=kl.detach())
    return loss, s


def critic_loss(critic, mb, args):
    v = values(critic, mb["input_ids"], mb["attention_mask"], mb["response_start"])  # [b, r]
    loss, s = ppo.value_loss(v.float(), mb["old_values"], mb["returns"], mb["action_mask"], args.value_clip,
                             args.loss_agg)
    s.update(vf_loss=loss.detach())
    return loss, s


def accumulate_and_step(model, opt, loss_fn, batch, mini, tokens, args, autocast, device):
    """Accumulate loss_fn's gradients over micro-batches, then one clipped optimiser step, skipped on every
    rank when any rank's loss or the gradient norm is not finite -> (stats, grad norm, stepped).

    Micro-batch weights make the accumulated gradient the mini-batch aggregate over *all* ranks: FSDP
    averages gradients over the W ranks, so under token-mean a micro-batch with m action tokens weighs
    m * W / tokens (tokens: the global mini-batch's), and every token counts the same whichever rank holds it."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    opt.zero_grad(set_to_none=True)
    model.train()  # transformers checkpoints activations only in train mode
    sums, finite = {}, True
    for rows in micro_batches(batch, mini, args.micro_batch_size):
        mb = micro_slices(batch, rows, device)
        if args.loss_agg == "token-mean":
            weight = float(mb["action_mask"].sum()) * world / max(tokens, 1.0)
        else:  # sequence means: every rank holds the same number of rows
            weight = len(rows) / len(mini)
        with autocast():
            loss, s = loss_fn(mb)
        (loss * weight).backward()
        finite = finite and math.isfinite(float(loss.detach()))
        for k, val in s.items():
            sums[k] = sums.get(k, 0.0) + float(val) * weight / world
    model.eval()
    stats = all_reduce_dict(sums, device)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    finite = all_reduce_sum([float(not finite)], device)[0] == 0 and math.isfinite(grad_norm)
    if not finite:
        opt.zero_grad(set_to_none=True)
        print(f"[warn] non-finite loss or gradient norm ({grad_norm}); {type(model).__name__} update skipped",
              file=sys.stderr, flush=True)
        return stats, grad_norm, False
    opt.step()
    return stats, grad_norm, True


def compute_advantages(args, scores, kl, kl_coef, old_values, action_mask, group_ids, device):
    """Advantages over action tokens -> (advantages [B, R], returns [B, R] or None).
    gae: token rewards (score on the last action token, -kl_coef * KL on each) through GAE, whitened over
    all ranks. grpo: the group-normalised scores alone -- a group whose scores are all equal gets zero,
    whatever the KL (that goes into the loss, --kl-loss-coef). rloo: leave-one-out baseline of each
    sequence's total reward, score - kl_coef * its summed token KL."""
    rewards = ppo.token_rewards(scores, kl, action_mask, kl_coef)                         # [B, R]
    if args.adv == "gae":
        advantages, returns = ppo.compute_gae(rewards, old_values, action_mask, args.gamma, args.lam)
        return (advantages if args.no_whiten else global_whiten(advantages, action_mask, device)), returns
    if args.adv == "grpo":
        return ppo.group_advantages(scores, group_ids, action_mask, "grpo"), None
    return ppo.group_advantages(rewards.sum(1), group_ids, action_mask, "rloo"), None


def global_whiten(x, mask, device):
    """Whiten over the action tokens of every rank, so that advantages share one scale."""
    s, s2, n = all_reduce_sum([float((x * mask).sum()), float((x * x * mask).sum()), float(mask.sum())], device)
    mean = s / max(n, 1)
    std = math.sqrt(max(s2 / max(n, 1) - mean * mean, 0.0))
    return (x - mean) / (std + 1e-8) * mask


def make_logger(args, out):
    """Append one JSON object per step to OUT/metrics.jsonl (and wandb / tensorboard when asked)."""
    sinks = []
    if args.wandb:
        import wandb
        wandb.init(project="mutis", config=vars(args), dir=str(out))
        sinks.append(lambda m: wandb.log(m, step=m["step"]))
    if args.tensorboard:
        from torch.utils.tensorboard import SummaryWriter
        tb = SummaryWriter(str(out / "tb"))
        sinks.append(lambda m: [tb.add_scalar(k, v, m["step"]) for k, v in m.items() if k != "step"])

    def log(metrics):
        metrics = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in metrics.items()}
        with open(out / "metrics.jsonl", "a") as f:  # strict JSON: NaN (e.g. explained_var of constant returns) -> null
            f.write(json.dumps(metrics) + "\n")
        for sink in sinks:
            sink(metrics)
    return log


def format_line(m, total_steps):
    t = " ".join(f"{k[5:]} {v:.1f}s" for k, v in m.items() if k.startswith("time/") and k != "time/step")
    line = (f"step {m['step']}/{total_steps} | reward {m['reward/mean']:.3f} acc {m['acc/mean']:.3f} "
            f"len {m['response_length/mean']:.0f} turns {m['turns/mean']:.2f} int {m['interventions/mean']:.2f} "
            f"ans {m['answered/share']:.2f} "
            f"| kl {m['kl']:.4f} pg {m.get('pg_loss', 0):.4f} vf {m.get('vf_loss', 0):.4f} "
            f"clip {m.get('clipfrac', 0):.3f} ent {m.get('entropy', 0):.3f} gn {m['grad_norm']:.2f} "
            f"| {t} step {m['time/step']:.1f}s {m['throughput/tokens_per_s']:.0f} tok/s "
            f"pad {m['padding/logprobs']:.0%}/{m['padding/update']:.0%}")
    if "val/acc" in m:
        line += f" | val acc {m['val/acc']:.3f} len {m['val/response_length']:.0f}"
    return line


def report(val_history, out):
    """Before/after validation summary and OUT/curves.png."""
    if len(val_history) >= 2:
        (s0, a), (s1, b) = val_history[0], val_history[-1]
        print(f"[val] step {s0} -> {s1}: acc {a['val/acc']:.3f} -> {b['val/acc']:.3f} "
              f"({100 * (b['val/acc'] - a['val/acc']):+.1f} pts), tokens {a['val/response_length']:.1f} -> "
              f"{b['val/response_length']:.1f} ({100 * (b['val/response_length'] / max(a['val/response_length'], 1e-9) - 1):+.0f}%), "
              f"turns {a['val/turns']:.2f} -> {b['val/turns']:.2f}", flush=True)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    logged = [json.loads(line) for line in open(out / "metrics.jsonl")] if (out / "metrics.jsonl").exists() else []
    rows = [r for r in logged if "reward/mean" in r]
    val_rows = [r for r in logged if r.get("val/acc") is not None]
    if not rows:
        return
    # training rollouts (sampled) and, where it ran, validation (greedy) on the same axes
    keys = [("reward/mean", None), ("acc/mean", "val/acc"), ("response_length/mean", "val/response_length"),
            ("turns/mean", "val/turns")]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.5))
    for ax, (key, val_key) in zip(axes, keys):
        ax.plot([r["step"] for r in rows], [r[key] for r in rows], marker="o", label="train")
        if val_key and val_rows:
            ax.plot([r["step"] for r in val_rows], [r[val_key] for r in val_rows], marker="s", label="validation")
            ax.legend()
        ax.set_title(key), ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out / "curves.png.tmp.png")
    os.replace(out / "curves.png.tmp.png", out / "curves.png")


if __name__ == "__main__":
    main()
