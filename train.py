"""MuTIS: PPO with multi-turn intervention sampling, on FSDP2 with a colocated vLLM engine.

    torchrun --nproc_per_node 8 train.py --data data/limo --model /path/to/hf_model
    python train.py --data arith_train --val-data arith_test --steps 2     # one process

Per step (main): rollout (multi-turn, vLLM) -> score -> reference/old log-probs and values -> advantages
over action tokens -> PPO epochs (actor, critic) -> sync weights to the engine -> log -> validate ->
checkpoint. Every rank owns one vLLM engine (or shares one with the K-1 ranks beside it: --engine-tp K) and
samples its own shard of the global batch; actor, critic and reference are FSDP2-sharded across ranks. Each phase ends where every rank arrives together (infra/faults.py):
a SIGTERM stops all of them at the same point with a checkpoint, a rank that hangs is named.

The objective (Zhao et al., "MuTIS", EMNLP 2025, eq. 2-3): a trajectory interleaves the policy's tokens
with intervention tokens, and only the policy's count. With m_t = action_mask (1 on sampled tokens,
0 on interventions and padding), rho_t = pi_theta(y_t | y_<t) / pi_old(y_t | y_<t) and A_t the
advantage (GAE over action tokens, or GRPO's group-normalised score broadcast over them):

    L_actor = - sum_t m_t min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t) / sum_t m_t
              - c_ent H[pi_theta] + c_kl KL_k3(pi_theta || pi_ref)      (KL loss term: grpo)
    L_critic = sum_t m_t max((V_t - R_t)^2, (clip(V_t, V_old +- eps_v) - R_t)^2) / (2 sum_t m_t)

the sums running over every rank's action tokens of a mini-batch (token-mean; accumulate_and_step).
With gae and rloo the KL to the reference is a per-token reward instead: r_t = score [t = last] - beta KL_t.
"""
import argparse
import functools
import math
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import ppo
import reward
import rollout
from infra import faults, lora
from infra.checkpoint import rng_states, save_checkpoint
from infra.cli import ArgumentParser, deprecated, die, positive_int
from infra.collectives import all_reduce_dict, all_reduce_sum, barrier, close_distributed
from infra.packing import forward_pass, micro_batches, pack
from infra.sharding import reshard
from infra.system import exit_without_teardown, quiet_logs
from model import token_logprobs
from train_logs import format_line, format_tokens, make_logger, report, step_metrics, sync_metrics, timed
from train_setup import logged_validations, models_and_optimisers, resume, setup, sync_engine, trainer_state


def parse_args(argv=None):
    # the sampling and intervention flags are rollout.py's (one vocabulary with rollout.py and eval.py)
    shared = rollout.sampling_flags(samples_per_prompt=8, max_prompt_length=2048, gpu_memory_utilization=0.4)
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, parents=[shared])
    a = p.add_argument
    # what to train on
    a("--model", default="smollm2", help="policy: HF model directory, hub id or the 'smollm2' alias")
    a("--critic-model", default=None, help="critic backbone (default: the policy's)")
    a("--lora-rank", type=int, default=0, metavar="R",
      help="train LoRA adapters of rank R on a frozen base instead of every weight (0 = full fine-tuning); the "
           "reference policy is the base; wants a higher --actor-lr (the demo's task: 10x)")
    a("--lora-alpha", type=float, default=32, help="LoRA scale: the update is (alpha / rank) B A")
    a("--lora-targets", type=lora.parse_targets, default="all-linear",
      help="the decoder blocks' linear layers to adapt: all-linear (q, k, v, o, gate, up, down projections) or "
           "comma-separated names, e.g. q_proj,v_proj")
    a("--data", required=True, help="training data: bundled name, .jsonl/.parquet file or a directory")
    a("--val-data", default=None, help="validation data (same forms as --data)")
    a("--val-limit", type=positive_int, default=None, help="use only the first N validation prompts")
    a("--out", default="runs/mutis", help="output directory: checkpoints, metrics.jsonl, curves.png")
    # schedule
    a("--steps", type=positive_int, default=None, help="training steps (overrides --epochs)")
    a("--epochs", type=positive_int, default=1, help="passes over the training data when --steps is not given")
    a("--batch-size", type=positive_int, default=64, help="prompts per step, global")
    a("--mini-batch-size", type=positive_int, default=None,
      help="trajectories per optimiser step, global (default: half the batch, two steps as in the reference run)")
    a("--micro-batch-size", type=positive_int, default=4, help="trajectories per forward/backward on one rank")
    a("--micro-batch-tokens", type=positive_int, default=None,
      help="fill each forward/backward up to this many tokens (prompt + response) instead of --micro-batch-size "
           "trajectories: a few long trajectories and many short ones each use the GPU well")
    a("--ppo-epochs", type=positive_int, default=1, help="passes over each rollout batch")
    # optimisation
    a("--actor-lr", type=float, default=1e-6, help="actor learning rate")
    a("--critic-lr", type=float, default=1e-5, help="critic learning rate")
    a("--actor-warmup-ratio", type=float, default=0.95, help="share of steps with linear LR warm-up (actor)")
    a("--critic-warmup-ratio", type=float, default=0.05, help="share of steps with linear LR warm-up (critic)")
    a("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    a("--grad-clip", type=float, default=1.0, help="max gradient norm")
    a("--entropy-coef", type=float, default=0.001, help="entropy bonus coefficient")
    # algorithm
    a("--adv", default="gae", choices=["gae", "grpo", "rloo"], help="advantage estimator (grpo/rloo need no critic)")
    a("--kl-coef", type=float, default=0.001, help="KL penalty coefficient in the token reward (gae, rloo)")
    a("--kl-kind", default="k1", choices=["k1", "k2", "k3"], help="per-token KL estimator of the reward term")
    a("--kl-loss-coef", type=float, default=None, help="KL-to-reference loss coefficient (default: 0.001 for grpo, else 0)")
    a("--kl-loss-kind", default="k3", choices=["k1", "k2", "k3"], help="KL estimator of the loss term (k3 clamped, as veRL)")
    a("--kl-target", type=float, default=None, help="adaptive KL controller target (default: fixed coefficient)")
    a("--kl-horizon", type=float, default=10000, help="adaptive KL controller horizon")
    a("--length-coef", type=float, default=0.0,
      help="per-token cost on the reward, score = acc - C * decoded tokens (the length-penalty baseline; 0 = off)")
    a("--require-stop", action="store_true",
      help="a correct answer scores only if the model ended the response itself; one that a token limit cut after "
           "its answer scores 0 (DAPO's overlong punishment, hard; off: the paper's reward)")
    a("--gamma", type=float, default=1.0, help="discount")
    a("--lam", type=float, default=1.0, help="GAE lambda")
    a("--clip-low", type=float, default=0.2, help="PPO ratio clip below 1")
    a("--clip-high", type=float, default=0.2, help="PPO ratio clip above 1")
    a("--dual-clip", type=float, default=None, help="dual-clip constant (> 1) for negative advantages")
    a("--value-clip", type=float, default=0.5, help="value loss clip")
    a("--loss-agg", default="token-mean", choices=ppo.AGG_MODES, help="loss aggregation")
    a("--rollout-is-cap", type=float, default=2.0,
      help="truncated importance sampling: weight each action token by min(pi_old / pi_rollout, C), correcting the "
           "engine/trainer log-prob mismatch (0 = off)")
    a("--rollout-is-level", default="token", help="token | sequence: one weight per token, or per trajectory")
    a("--no-whiten", action="store_true", help="do not whiten GAE advantages")
    # bookkeeping and platform
    a("--save-freq", type=int, default=0, help="checkpoint every N steps (0 = only at the end)")
    a("--save-minutes", type=float, default=None, help="also checkpoint after a step when M minutes have passed "
                                                        "since the last checkpoint")
    a("--shutdown-grace", type=float, default=20, help="seconds a SIGTERM leaves for its checkpoint before this "
                                                        "process exits anyway (torchrun and SLURM kill after 30)")
    a("--keep-last", type=int, default=None, help="keep only the newest K complete checkpoints of this run (never "
                                                  "the one it resumed from, nor a newer one)")
    a("--val-freq", type=int, default=0, help="validate every N steps (0 = never)")
    a("--test-freq", dest="val_freq", type=int, help=argparse.SUPPRESS, action=deprecated("--test-freq", "--val-freq"))
    a("--val-before-train", action=argparse.BooleanOptionalAction, default=False,
      help="validate before the first step")
    a("--resume", action="store_true", help="continue from OUT/latest (or the newest complete checkpoint); refused "
                                            "when a flag that defines the run's maths differs from the checkpoint's")
    a("--allow-changed", type=lambda text: [f.strip().lstrip("-").replace("-", "_") for f in text.split(",")
                                            if f.strip()], default=[], metavar="FLAG,...",
      help="with --resume: continue the run with these flags changed on purpose (e.g. actor-lr,data)")
    a("--overwrite", action="store_true", help="start afresh in an --out that holds an earlier run, replacing its "
                                               "checkpoints and metrics (without it such an --out is refused)")
    a("--grad-checkpointing", action="store_true", help="activation checkpointing")
    a("--compile", action="store_true",
      help="torch.compile the decoder layers and the log-prob head: fused norms, rotary, SwiGLU and log-softmax "
           "(meant for GPUs; the first micro-batches pay for the compiling)")
    a("--offload", action="store_true", help="FSDP2 CPU offload of parameters and optimiser state")
    a("--cpu-threads", type=positive_int, default=None,
      help="threads of the trainer's CPU work (--offload's optimiser step, CPU training); default: the cores this "
           "process may use, divided by the ranks on its node")
    a("--peak-tflops", type=float, default=None,
      help="the device's dense bf16 peak in TFLOP/s for perf/mfu (default: known for common NVIDIA GPUs, else none)")
    a("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
      help="trainer compute dtype, params stay fp32 (auto: bf16 on CUDA and on CPUs with avx512_bf16/amx_bf16)")
    a("--dist-timeout", type=float, default=1800, help="seconds a collective may wait for the slowest rank (NCCL "
                                                       "watchdog): longer than the slowest rank's rollout")
    a("--max-bad-steps", type=positive_int, default=5, help="stop after K non-finite updates in a row")
    a("--wandb", action="store_true", help="log to Weights & Biases")
    a("--tensorboard", action="store_true", help="log to OUT/tb")
    args = p.parse_args(argv)
    check_args(args)
    return args


def check_args(args):
    """Flags that cannot work fail here, in one line, before any model loads."""
    rollout.check_sampling_args(args)
    if args.temperature <= 0:
        die(f"--temperature must be > 0 for training (the PPO ratio needs sampled log-probs), got {args.temperature}")
    if args.adv in ("grpo", "rloo") and args.samples_per_prompt < 2:
        die(f"--adv {args.adv} compares samples of the same prompt: needs --samples-per-prompt >= 2, "
            f"got {args.samples_per_prompt}")
    if args.length_coef < 0:
        die(f"--length-coef must be >= 0, got {args.length_coef}")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        die(f"--peak-tflops must be > 0, got {args.peak_tflops}")
    for flag in ("save_minutes", "shutdown_grace"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            die(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    if args.dist_timeout <= 0:
        die(f"--dist-timeout must be > 0 seconds, got {args.dist_timeout}")
    if args.rollout_is_cap < 0 or 0 < args.rollout_is_cap < 1:
        die(f"--rollout-is-cap must be 0 (off) or >= 1, got {args.rollout_is_cap}")
    if args.rollout_is_level not in ppo.IS_LEVELS:
        die(f"--rollout-is-level must be one of {', '.join(ppo.IS_LEVELS)}, got {args.rollout_is_level!r}")
    if args.lora_rank < 0 or args.lora_alpha <= 0 or not args.lora_targets:
        die(f"--lora-rank must be >= 0 (0 = off), --lora-alpha > 0 and --lora-targets name a layer; got "
            f"{args.lora_rank}, {args.lora_alpha:g}, {','.join(args.lora_targets) or 'none'}")
    if args.kl_loss_coef is None:
        args.kl_loss_coef = 0.001 if args.adv == "grpo" else 0.0


# ----------------------------------------------------------------------------- main: the loop

def main(argv=None):
    args = parse_args(argv)
    quiet_logs(args.verbose)
    run = setup(args)  # process group, dtypes, data, models, engine -> train_setup.Run; every rank
    state = resume(args, run) if args.resume else None  # the checkpoint's trainer state; None: a fresh run
    guard = faults.Guard(run.rank, run.world, args.dist_timeout, args.shutdown_grace,  # SIGTERM, hung ranks
                         engine_group=run.engine.group)
    logger = make_logger(args, run.out) if run.master else None
    log = functools.partial(log_step, run, logger)
    val_history = logged_validations(run) if state else []
    if state and state.get("pending"):  # stopped by a SIGTERM after its update, before its validation
        log({**state["pending"], **validation_metrics(run, validate(run, args))}, val_history)
    if args.val_before_train and run.val_records and state is None:
        log({"step": 0, **validation_metrics(run, validate(run, args))}, val_history)

    bad_steps, last_save = 0, time.time()
    for step in range((state or {}).get("step", 0) + 1, run.total_steps + 1):
        timer, t_step = {}, time.time()
        bar = (lambda phase: f"step {step} {phase}") if run.master else (lambda phase: None)  # tqdm on rank 0
        guard.start_step(step)
        rng_at_start = rng_states()  # what a checkpoint of the state this step starts from records
        try:
            # ---- 1. rollout: this rank's share of the global batch, multi-turn with interventions
            with timed(timer, "rollout"):
                trajs = guard.run("rollout", lambda: sample_batch(run, args, step, desc=bar("rollout"), poll=guard.poll),
                                  interruptible=True)  # a SIGTERM stops it at the engine's next step
                run.engine.sleep()  # frees weights and KV cache for training (on CPU: destroys the weights, as a GPU would)
                batch = rollout.to_batch(trajs, run.tokenizer.pad_token_id)

            # ---- 2. score: binary accuracy of the final answer (minus the length cost, if any)
            with timed(timer, "reward"):
                results = guard.run("reward", lambda: score(trajs, run.train_records, args))
                scores = torch.tensor([r["score"] for r in results], dtype=torch.float32)  # [B]

            # ---- 3. reference and old log-probs, values (no grad, micro-batched)
            with timed(timer, "logprobs"):
                ref_logprobs, old_logprobs, old_values = guard.run(
                    "logprobs", lambda: no_grad_passes(run, args, batch, bar, guard.check))  # [B, R] each or None

            # ---- 4. advantages over action tokens
            action_mask = batch["action_mask"].float()                                          # [B, R]
            kl = (torch.zeros_like(ref_logprobs) if run.reuse_old  # measured in the update (grpo ignores it here)
                  else ppo.kl_penalty(old_logprobs, ref_logprobs, args.kl_kind))                 # [B, R]
            group_ids = torch.tensor([t["prompt_index"] for t in trajs])                         # [B]
            advantages, returns = compute_advantages(args, scores, kl, run.kl_ctl.value, old_values, action_mask,
                                                     group_ids, run.device)                      # [B, R] each
            batch.update(ref_logprobs=ref_logprobs, advantages=advantages, action_mask=action_mask,
                         old_logprobs=old_logprobs, old_values=old_values, returns=returns, prompt_index=group_ids,
                         sample_index=torch.tensor([t["sample_index"] for t in trajs]))
            batch = {k: v for k, v in batch.items() if v is not None}

            # ---- 5. PPO epochs over mini-batches, gradient accumulation over micro-batches
            with timed(timer, "update"):
                stats, skipped, update_groups = guard.run(
                    "update", lambda: ppo_epochs(run, args, batch, step, desc=bar("update"), guard=guard), commits=True)
        except faults.StepAbandoned:  # a SIGTERM before this step changed the weights: keep the state it started from
            save_or_keep(run, args, step - 1, guard, rng_at_start)
            guard.exit_preempted(step - 1, run.master)
        bad_steps = bad_steps + 1 if skipped else 0

        # ---- 6. sync the new weights into the engine (not when stopping: the checkpoint has them)
        with timed(timer, "sync"):
            if not guard.stopping:
                guard.run("sync", lambda: sync_engine(run))

        # ---- 7. log: sums over every rank's trajectories
        timer["step"] = time.time() - t_step
        metrics = guard.run("metrics", lambda: step_metrics(run, args, step, trajs, batch, results, kl, old_logprobs,
                                                            stats, skipped, update_groups, timer))
        run.kl_ctl.update(metrics["kl/mean"], args.batch_size * args.samples_per_prompt)

        # ---- 8. validate (a SIGTERM leaves it to the resumed run: the step's line waits in the checkpoint)
        pending = None
        if args.val_freq and run.val_records and (step % args.val_freq == 0 or step == run.total_steps):
            sums = None if guard.stopping else guard.run("validate", lambda: validate(run, args, guard.poll),
                                                         interruptible=True)
            if guard.stopping:  # every rank agreed at the boundary: the sums of ranks that finished are dropped too
                pending = metrics
            else:
                metrics.update(validation_metrics(run, sums))
        if pending is None:
            log(metrics, val_history)
        if bad_steps >= args.max_bad_steps:
            die(f"{bad_steps} steps in a row had a non-finite loss or gradient norm; stopping "
                f"(last good checkpoint: {run.out / 'latest'})")

        # ---- 9. checkpoint (atomic): every --save-freq steps or --save-minutes, at the end, on SIGTERM
        due_by_time = bool(args.save_minutes) and all_reduce_sum(
            [float(time.time() - last_save >= 60 * args.save_minutes)], run.device)[0] > 0
        if (args.save_freq and step % args.save_freq == 0) or step == run.total_steps or guard.stopping or due_by_time:
            save(run, args, step, guard, pending=pending, export=not guard.stopping)
            last_save = time.time()
        if guard.stopping:
            guard.exit_preempted(step, run.master)

    if not run.exported:  # resumed from a SIGTERM's checkpoint of the last step: its export, now
        save(run, args, run.on_disk, guard)
    if run.master:
        report(val_history, run.out)
    barrier()  # no rank tears the process group down while rank 0 still writes the report
    guard.close()
    run.engine.close()  # vLLM's teardown also destroys the default process group under torchrun
    run = None          # the models: FSDP holds the group in cycles, freed by close_distributed's collection
    close_distributed()


def log_step(run, logger, metrics, val_history):
    """One step's line (metrics.jsonl, the console) on rank 0; a validation joins the before/after report."""
    if "val/acc" in metrics:
        val_history.append((metrics["step"], metrics))
    if not run.master:
        return
    logger(metrics)
    if "reward/mean" in metrics:
        print(format_line(metrics, run.total_steps), flush=True)
    else:
        print(f"[val] step {metrics['step']}  acc {metrics['val/acc']:.3f}  {format_tokens(metrics, 'val/')}  "
              f"turns {metrics['val/turns']:.2f}  ({metrics['time/validate']:.1f}s)", flush=True)


def save(run, args, step, guard, rng=None, pending=None, export=True):
    """Checkpoint `step` (the watchdog lets a started write finish); pending: the step's metrics line, held back
    until the resumed run has validated. export=False when every rank agreed to stop on a SIGTERM: only what --resume
    needs (no HF export: at 7B that is a full gather and ~14 GB from rank 0 inside the grace); the next regular
    checkpoint exports again."""
    t0 = time.time()
    if run.master:
        sync_metrics(run.out)  # the steps it logged survive with the checkpoint
    with guard.writing_checkpoint():
        guard.run("checkpoint", lambda: save_checkpoint(run.out, step, models_and_optimisers(run), run.tokenizer,
                                                         trainer_state(args, run, step, pending, export),
                                                         args.keep_last, rng, export=export, complete=run.complete,
                                                         resumed=run.resumed_from), decides=False)
    run.on_disk, run.exported = step, export
    run.complete.add(step)
    if run.master:
        print(f"[ckpt] step {step} -> {run.out}/step_{step:06d} ({time.time() - t0:.1f}s"
              + ("" if export else "; for --resume only: no actor/ export") + ")", flush=True)


def save_or_keep(run, args, step, guard, rng):
    """The abandoned step's predecessor `step` as a checkpoint: already on disk (this run wrote it, or resumed from
    it), else written now. Step 0 needs none: the resumed run starts afresh, as this one did."""
    for _, opt in models_and_optimisers(run).values():  # the abandoned micro-batches' gradients: not state
        opt.zero_grad(set_to_none=True)
    if step and run.on_disk != step:
        save(run, args, step, guard, rng, export=False)


# ----------------------------------------------------------------------------- the method, step by step

def sample_batch(run, args, step, desc=None, poll=None):
    """This rank's shard of step `step`'s prompts (every rank sees the same order), n samples each; a
    tensor-parallel engine samples its ranks' shards together, each rank keeps its own. Seeds depend on (seed,
    step, prompt, sample, turn) only: any world size and --engine-tp sample the same batch. poll: rollout.sample's."""
    epoch, pos = divmod(step - 1, run.steps_per_epoch)
    order = np.random.default_rng(args.seed + epoch).permutation(len(run.train_records))
    global_idx = order[pos * args.batch_size:(pos + 1) * args.batch_size]
    group, mine = rollout.group_shard(len(global_idx), run.rank, run.world, args.engine_tp)
    idx = [int(global_idx[i]) for i in group]
    trajs = rollout.sample(run.engine, [run.train_prompts[i] for i in idx], prompt_indices=idx, desc=desc, poll=poll,
                           **rollout.sample_kwargs(args, run.intervention_ids, run.eos_ids,
                                                   seed=args.seed * 1_000_003 + step))
    return rollout.own_share(trajs, [int(global_idx[i]) for i in mine])


def score(trajs, records, args):
    """Binary accuracy of each trajectory's final explicit answer, read from the policy's own text (never an
    intervention); the first answer when turns are cut at it, else the last. No explicit answer scores 0, as in
    the paper, also where eval.py would read the last number: the reward then asks for what the turn rule does.
    --length-coef subtracts a cost per decoded token (what a user pays: a cut's dropped tail included,
    interventions not: the environment wrote them); --require-stop takes the credit of a correct answer from a
    response that a token limit cut (reward.require_stop)."""
    recs = [records[t["prompt_index"]] for t in trajs]
    length = ({"length_coef": args.length_coef, "lengths": [t["decoded_tokens"] for t in trajs]}
              if args.length_coef else {})
    return reward.score_batch([r["data_source"] for r in recs], [t["policy_text"] for t in trajs],
                              [r["ground_truth"] for r in recs], first=args.cut_at_answer, last_number=False,
                              stopped=[t["stopped"] for t in trajs] if args.require_stop else None, **length)


def no_grad_passes(run, args, batch, bar, check=None):
    """Reference log-probs, old log-probs (None when the update's own forward supplies them: run.reuse_old)
    and old values (None without a critic), each [B, R]. check: called between micro-batches (faults.Guard)."""
    def lp(model):
        return lambda mb: token_logprobs(model, mb, temperature=args.temperature)

    fwd = dict(size=args.micro_batch_size, tokens=args.micro_batch_tokens, autocast=run.autocast, device=run.device,
               check=check)
    with lora.adapters_off(run.actor) if run.ref is None else nullcontext():  # LoRA: the reference is the base
        ref = forward_pass(lp(run.actor if run.ref is None else run.ref), batch, **fwd, desc=bar("ref logprobs"))
    old = None if run.reuse_old else forward_pass(lp(run.actor), batch, **fwd, desc=bar("old logprobs"))
    values = None
    if run.critic is not None:
        values = forward_pass(run.critic, batch, **fwd, desc=bar("values"))
    reshard(run.ref, run.actor, run.critic)  # no backward follows these passes to free the gathered root parameters
    return ref, old, values


def compute_advantages(args, scores, kl, kl_coef, old_values, action_mask, group_ids, device):
    """Advantages over action tokens -> (advantages [B, R], returns [B, R] or None).
    gae: token rewards (score on the last action token, -kl_coef * KL on each) through GAE, whitened over
    all ranks. grpo: the group-normalised scores alone -- a group whose scores are all equal gets zero,
    whatever the KL (that goes into the loss, --kl-loss-coef). rloo: leave-one-out baseline of each
    sequence's total reward, score - kl_coef * its summed token KL."""
    rewards = ppo.token_rewards(scores, kl, action_mask, kl_coef)                         # [B, R]
    if args.adv == "gae":
        advantages, returns = ppo.compute_gae(rewards, old_values, action_mask, args.gamma, args.lam)
        if not args.no_whiten:
            advantages = ppo.masked_whiten(advantages, action_mask,
                                           sum_over_ranks=lambda xs: all_reduce_sum(xs, device))
        return advantages, returns
    if args.adv == "grpo":
        return ppo.group_advantages(scores, group_ids, action_mask, "grpo"), None
    return ppo.group_advantages(rewards.sum(1), group_ids, action_mask, "rloo"), None


def ppo_epochs(run, args, batch, step, desc=None, guard=None):
    """--ppo-epochs passes over the batch in shuffled mini-batches, one optimiser step each -> (statistics per
    mini-batch, skipped steps, the micro-batches as the update cut them: for the padding metric). guard:
    faults.Guard, asked between micro-batches until the first optimiser step."""
    stats, skipped, groups = [], 0, []
    n_minis = args.batch_size * args.samples_per_prompt // run.mini_size
    progress = tqdm(total=args.ppo_epochs * n_minis, desc=desc, disable=desc is None, leave=False, unit="mini")
    for epoch in range(args.ppo_epochs):
        for rows in mini_batches(batch, n_minis, run.mini_size // run.world, (args.seed, step, epoch)):
            micro = micro_batches(batch, rows, args.micro_batch_size, args.micro_batch_tokens, run.device)
            groups += micro
            s, n_skipped = ppo_update(run.actor, run.critic, run.actor_opt, run.critic_opt, batch, micro, args,
                                      run.autocast, run.device, guard)
            stats.append(s)
            skipped += n_skipped
            progress.update()
    progress.close()
    for sched in run.schedulers:
        sched.step()
    return stats, skipped, groups


def mini_batches(batch, n_minis, local_mini, seed):
    """This rank's rows of each of the n_minis mini-batches of one PPO epoch -> list of row-index tensors. Every
    prompt's samples are dealt evenly over the mini-batches by a permutation seeded by (seed, step, epoch, prompt),
    so which trajectories share a mini-batch does not depend on how many ranks hold them (a run resumed on another
    world size takes the same optimiser steps) and every rank holds local_mini rows of each (FSDP). Samples that do
    not divide evenly: this rank's rows shuffled and cut, which depends on the world size."""
    prompts, samples = batch["prompt_index"], batch["sample_index"]                        # [B] each
    n = int(samples.max()) + 1
    if n % n_minis:
        return list(torch.from_numpy(np.random.default_rng(list(seed)).permutation(len(prompts))).split(local_mini))
    mini = torch.empty_like(samples)                                                       # [B]
    for p in prompts.unique().tolist():
        deal = torch.from_numpy(np.random.default_rng([*seed, p]).permutation(n)) // (n // n_minis)  # [n]
        mini[prompts == p] = deal[samples[prompts == p]]
    return [torch.nonzero(mini == k).squeeze(1) for k in range(n_minis)]


def ppo_update(actor, critic, actor_opt, critic_opt, batch, micro, args, autocast, device, guard=None):
    """One optimiser step of the actor and one of the critic on a mini-batch of trajectories (this rank's rows, cut
    into micro-batches `micro`: packing.micro_batches) -> (statistics averaged over every rank's action tokens,
    number of skipped steps)."""
    tokens = all_reduce_sum([float(batch["action_mask"][torch.cat(micro)].sum())], device)[0]  # the global mini-batch's
    stats, ok = accumulate_and_step(actor, actor_opt, lambda mb: actor_loss(actor, mb, args), batch, micro, tokens,
                                    args, autocast, device, "actor/grad_norm", guard)
    skipped = int(not ok)
    if critic is not None:
        critic_stats, ok = accumulate_and_step(critic, critic_opt, lambda mb: critic_loss(critic, mb, args), batch,
                                               micro, tokens, args, autocast, device, "critic/grad_norm", guard)
        stats.update(critic_stats)
        skipped += not ok
    return stats, skipped


def actor_loss(actor, mb, args):
    """PPO clipped surrogate - entropy bonus (+ KL-to-reference loss, GRPO) on one micro-batch."""
    mask = mb["action_mask"]                                                         # [b, r]
    logprobs, entropy = token_logprobs(actor, mb, temperature=args.temperature, with_entropy=True)  # [b, r] each
    s = {}
    old = mb.get("old_logprobs")                                                     # [b, r]
    if old is None:  # the one optimiser step on this batch: pi_old is the policy computing these log-probs
        old = logprobs.detach().float()
        s["kl/mean"] = ppo.masked_mean(ppo.kl_penalty(old, mb["ref_logprobs"], args.kl_kind), mask)
        s["rollout/logprob_gap"] = ppo.masked_mean((mb["rollout_logprobs"] - old).abs(), mask)
    is_weights = None
    if args.rollout_is_cap:  # the engine sampled from pi_rollout, not pi_old: TIS weights (ppo.rollout_is_weights)
        is_weights, is_stats = ppo.rollout_is_weights(old, mb["rollout_logprobs"], mask, args.rollout_is_cap,
                                                      args.rollout_is_level)                 # [b, r]
        s.update({f"rollout/{k}": v for k, v in is_stats.items()})
    pg, pg_stats = ppo.policy_loss(logprobs.float(), old, mb["advantages"], mask,
                                   args.clip_low, args.clip_high, args.dual_clip, args.loss_agg, is_weights)
    s.update({f"actor/{k}": v for k, v in pg_stats.items()})
    ent = ppo.agg_loss(entropy.float(), mask, args.loss_agg)
    loss = pg - args.entropy_coef * ent
    s["loss/pg"] = pg.detach()
    s["actor/entropy"] = ent.detach()
    if args.kl_loss_coef:
        kl = ppo.kl_loss(logprobs.float(), mb["ref_logprobs"], mask, args.kl_loss_kind, args.loss_agg)
        loss = loss + args.kl_loss_coef * kl
        s["loss/kl"] = kl.detach()
    return loss, s


def critic_loss(critic, mb, args):
    """Clipped value loss on one micro-batch."""
    v = critic(mb)                                                                   # [b, r]
    loss, s = ppo.value_loss(v.float(), mb["old_values"], mb["returns"], mb["action_mask"], args.value_clip,
                             args.loss_agg)
    return loss, {"loss/vf": loss.detach(), **{f"critic/{k}": val for k, val in s.items()}}


def accumulate_and_step(model, opt, loss_fn, batch, micro, tokens, args, autocast, device, norm_key="grad_norm",
                        guard=None):
    """Accumulate loss_fn's gradients over the micro-batches `micro` (row-index tensors), then one clipped optimiser
    step, skipped on every rank when any rank's loss or the gradient norm is not finite -> (stats incl. norm_key,
    stepped).

    Micro-batch weights make the accumulated gradient the mini-batch aggregate over *all* ranks: FSDP
    averages gradients over the W ranks, so under token-mean a micro-batch with m action tokens weighs
    m * W / tokens (tokens: the global mini-batch's), and every token counts the same whichever rank holds it."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    opt.zero_grad(set_to_none=True)
    model.train()  # transformers checkpoints activations only in train mode
    sums, finite = {}, True
    rows_total = sum(len(rows) for rows in micro)
    for rows in micro:
        if guard is not None:
            guard.check()  # a SIGTERM abandons the step here while no optimiser step has changed the weights
        mb = pack(batch, rows, device)
        if args.loss_agg == "token-mean":
            weight = float(mb["action_mask"].sum()) * world / max(tokens, 1.0)
        else:  # sequence means: every rank holds the same number of rows
            weight = len(rows) / rows_total
        with autocast():
            loss, s = loss_fn(mb)
        (loss * weight).backward()
        finite = finite and math.isfinite(float(loss.detach()))
        for k, val in s.items():
            sums[k] = sums.get(k, 0.0) + float(val) * weight / world
    model.eval()
    stats = all_reduce_dict(sums, device)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip, foreach=True)
    stats[norm_key] = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    finite = all_reduce_sum([float(not finite)], device)[0] == 0 and math.isfinite(stats[norm_key])
    if not finite:
        opt.zero_grad(set_to_none=True)
        print(f"[warn] non-finite loss or gradient norm ({stats[norm_key]}); {type(model).__name__} update skipped",
              file=sys.stderr, flush=True)
        return stats, False
    opt.step()
    if guard is not None:
        guard.weights_changed = True
    opt.zero_grad(set_to_none=True)  # the gradients' memory is free before the engine wakes (and between models)
    return stats, True


def validate(run, args, poll=None):
    """Greedy multi-turn on this rank's shard of the validation set -> this rank's sums (validation_metrics gathers
    them: no collective here, so a SIGTERM can stop one rank's shard early, poll, while the others wait at the
    phase's boundary)."""
    t0 = time.time()
    group, mine = rollout.group_shard(len(run.val_prompts), run.rank, run.world, args.engine_tp)
    ro = rollout.sample(run.engine, [run.val_prompts[i] for i in group], prompt_indices=group,
                        desc="validate" if run.master else None, poll=poll,
                        **rollout.sample_kwargs(args, run.intervention_ids, run.eos_ids, n=1, temperature=0.0))
    ro = rollout.own_share(ro, mine)
    run.engine.sleep(keep_weights=True)  # KV cache freed for checkpointing and training; the weights sample next
    results = score(ro, run.val_records, args)
    return {"acc": sum(r["acc"] for r in results), **rollout.trajectory_sums(ro), "count": len(results),
            "seconds": time.time() - t0}


def validation_metrics(run, sums):
    """Every rank's validation sums -> the val/ metrics (a collective: every rank calls it)."""
    t = all_reduce_dict(sums, run.device)
    return {"val/acc": t["acc"] / t["count"], **{f"val/{k}": t[k] / t["count"] for k in rollout.TRAJECTORY_KEYS},
            "time/validate": t["seconds"] / run.world}


if __name__ == "__main__":
    main()
    exit_without_teardown()  # the outputs are written: skip the interpreter's 2-second teardown
