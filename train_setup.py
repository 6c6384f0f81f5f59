"""train.py's setup, out of the loop's way: the process group, dtypes, data (tokenised and checked up front), models
(FSDP2-sharded), optimisers and LR schedules, the colocated engine, and resuming from a checkpoint.

Plumbing only: the method is in train.py (the loop), rollout.py, reward.py and ppo.py.
"""
import functools
import json
import random
import shutil
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import data as data_lib
import ppo
import rollout
from infra import engines, lora
from infra.checkpoint import base_digests, find_resumable, load_checkpoint
from infra.cli import die, write_atomic
from infra.collectives import barrier, check_shared_out, init_distributed
from infra.hf import check_attn_implementation, decoder_layers, load_causal_lm, load_tokenizer, refuse_unsupported
from infra.perf import model_shape, peak_tflops
from infra.sharding import full_state_dict
from infra.system import choose_dtype, freeze_imports, keep_freed_memory, trainer_threads
from infra.weights import load_sharded
from model import compile_model, compiler_missing, end_of_turn_ids, load_critic, resolve_model
from train_logs import METRICS, read_metrics


@dataclass(slots=True)  # an attribute not declared here is an error
class Run:
    """The state train.py's loop hands from step to step, declared once (setup fills it; resume updates the last five)."""
    rank: int                        # this process's rank
    world: int                       # the number of ranks
    device: torch.device             # this rank's device (cuda:LOCAL_RANK, or the CPU)
    master: bool                     # rank 0: the one that prints, logs and writes checkpoints
    out: Path                        # --out
    mini_size: int = 0               # trajectories per optimiser step, over all ranks
    reuse_old: bool = False          # the old log-probs are the update's own forward's (grpo, one step per batch)
    autocast: Any = None             # () -> the compute dtype's autocast context (bf16) or a null context
    model_path: str = ""             # --model resolved to a directory (or a hub id)
    tokenizer: Any = None            # the model's tokenizer
    train_records: list = None       # --data's records
    val_records: list = None         # --val-data's records ([] without validation)
    train_prompts: list = None       # their prompt ids, tokenised up front
    val_prompts: list = None
    steps_per_epoch: int = 0         # batches in one pass over --data
    total_steps: int = 0             # --steps, or --epochs passes
    actor: Any = None                # the policy, FSDP2-sharded (with LoRA adapters under --lora-rank)
    ref: Any = None                  # the frozen reference policy (None under LoRA: the actor with adapters off)
    critic: Any = None               # the value model (gae only)
    actor_opt: Any = None            # AdamW over the actor's trainable parameters
    critic_opt: Any = None
    schedulers: list = None          # the LR schedules: actor's, then critic's
    kl_ctl: Any = None               # the KL coefficient's controller (ppo.FixedKLController or AdaptiveKLController)
    lora: dict = None                # what a checkpoint records of the adapters and their frozen bases (None: none)
    intervention_ids: list = None    # the intervention text's token ids
    engine: Any = None               # the colocated rollout engine (infra/engines.py)
    eos_ids: list = None             # every token id that ends a turn
    flops: dict = None               # model shapes for the FLOP counts ("actor", "critic")
    peak_tflops: float = None        # the device's bf16 peak (for MFU), None where unknown
    run_id: str = ""                 # this run's id, kept across resumes (checkpoints of other runs are not pruned)
    on_disk: int = None              # the newest step saved as a checkpoint
    exported: bool = True            # whether that checkpoint has its actor/ export (a SIGTERM's has not)
    complete: set = field(default_factory=set)  # checkpoints this process wrote or verified (--keep-last counts them)
    resumed_from: int = None         # the step resumed from, never pruned by this process


def setup(args):
    """Process group, dtypes, data (tokenised and checked up front), models and the colocated engine -> run."""
    freeze_imports()
    rank, world, local_rank, device = init_distributed(timeout=args.dist_timeout)
    run = Run(rank=rank, world=world, device=device, master=rank == 0, out=Path(args.out))
    threads = trainer_threads(args.cpu_threads)  # before the engine may narrow this process's CPU affinity
    keep_freed_memory(device)
    check_attn_implementation(args.attn_implementation, device)
    if args.compile and (why := compiler_missing(device)):
        die(f"--compile: {why}; run without --compile")
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    engines.check_tensor_parallel(resolve_model(args.model), args.engine_tp, world)  # before --overwrite deletes
    if args.lora_rank:  # --lora-targets against the model's layers, built on the meta device (nothing read)
        with_adapters(functools.partial(load_causal_lm, resolve_model(args.model)), args, dtype="float32")(meta=True)
    if args.batch_size % world:
        die(f"--batch-size {args.batch_size} must be divisible by the number of ranks ({world})")
    rollouts = args.batch_size * args.samples_per_prompt
    run.mini_size = args.mini_batch_size or (rollouts // 2 if rollouts % (2 * world) == 0 else rollouts)
    if run.mini_size % world or rollouts % run.mini_size:
        die(f"--mini-batch-size {run.mini_size} must divide batch-size x samples-per-prompt ({rollouts}) and be "
            f"divisible by the number of ranks ({world})")
    # One optimiser step per batch and advantages that ignore pi_old (grpo): the old log-probs are exactly the
    # ones the update's own forward computes, so that forward pass is skipped
    run.reuse_old = args.adv == "grpo" and args.ppo_epochs == 1 and run.mini_size == rollouts
    if run.master and run.reuse_old:
        print("[setup] old log-probs: taken from the update's forward (grpo, one optimiser step per batch), "
              "one forward pass per step saved", flush=True)
    if run.master:
        run.out.mkdir(parents=True, exist_ok=True)
    check_shared_out(run.out, rank, world, device)
    claim_out(args, run)
    run.run_id = uuid.uuid4().hex  # (resume: the checkpoint's run)
    args.dtype, dtype_why = choose_dtype(args.dtype, device)
    args.engine_dtype, engine_dtype_why = choose_dtype(args.engine_dtype, device, engine=args.engine)
    if run.master:
        print(f"[setup] dtype {args.dtype} ({dtype_why}); {args.engine} engine dtype {args.engine_dtype} "
              f"({engine_dtype_why})", flush=True)
    run.autocast = ((lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if args.dtype == "bfloat16"
                    else nullcontext)
    load_data(args, run)
    load_models(args, run)
    # ---- the rollout engine, colocated on this rank
    run.intervention_ids = rollout.intervention_ids(run.tokenizer, args.intervention_text)
    args.max_response_tokens = rollout.sample_kwargs(args, run.intervention_ids)["max_response_tokens"]
    longest_prompt = max(len(p) for p in run.train_prompts + run.val_prompts)
    # one seed on every rank: a tensor-parallel engine's ranks sample alike (the requests carry their own seeds)
    run.engine = engines.engine_from_flags(args, run.model_path, longest_prompt + args.max_response_tokens,
                                           distributed=world > 1)  # every rank, after the group
    torch.set_num_threads(threads)  # the engine set its own count (vLLM's GPU worker: one thread)
    run.eos_ids = end_of_turn_ids(run.model_path, run.tokenizer)
    run.flops = {"actor": model_shape(run.actor), **({"critic": model_shape(run.critic)} if run.critic else {})}
    run.peak_tflops = peak_tflops(device, args.peak_tflops)
    return run


def claim_out(args, run):
    """A fresh run never writes over, nor prunes, another run's files: an --out that holds checkpoints or a
    metrics.jsonl is refused in one line, unless --overwrite, which says what it replaces and removes just that."""
    if args.resume:
        return
    old = sorted(p.name for p in run.out.glob("step_[0-9]*"))
    mine = [p for p in ("latest", "metrics.jsonl", "curves.png") if (run.out / p).exists() or (run.out / p).is_symlink()]
    if not old and "metrics.jsonl" not in mine:
        return
    shown = ", ".join(old if len(old) <= 3 else old[:1] + ["...", old[-1]]) or "metrics.jsonl"
    if not args.overwrite:
        die(f"--out {run.out} holds an earlier run ({shown}): --resume continues it, --overwrite replaces it, "
            f"or give another --out")
    if run.master:
        print(f"[setup] --overwrite: replacing the earlier run in {run.out} ({shown})", flush=True)
        for name in old:
            shutil.rmtree(run.out / name, ignore_errors=True)
        for name in mine:
            (run.out / name).unlink(missing_ok=True)
    barrier()


def load_data(args, run):
    """Training and validation records, tokenised once up front: a prompt over --max-prompt-length fails now,
    not hours in. Every rank loads the same data and later takes its own shard of each batch."""
    try:
        run.train_records = data_lib.load_dataset(args.data, system_prompt=args.system_prompt)
        run.val_records = (data_lib.load_dataset(args.val_data, system_prompt=args.system_prompt, limit=args.val_limit)
                           if args.val_data else [])
    except data_lib.DataError as e:
        die(str(e))
    run.model_path = resolve_model(args.model)
    run.tokenizer = load_tokenizer(run.model_path)
    try:
        run.train_prompts, n_cut = rollout.tokenize_prompts(run.tokenizer, run.train_records, args.max_prompt_length,
                                                            args.truncate_prompts)
        run.val_prompts, _ = rollout.tokenize_prompts(run.tokenizer, run.val_records, args.max_prompt_length,
                                                      args.truncate_prompts)
    except rollout.PromptTooLong as e:
        die(f"--data: {e}")
    if n_cut and run.master:
        print(f"[data] left-truncated {n_cut} prompts to {args.max_prompt_length} tokens", flush=True)
    run.steps_per_epoch = len(run.train_records) // args.batch_size
    if run.steps_per_epoch == 0:
        die(f"--data {args.data}: {len(run.train_records)} prompts, fewer than --batch-size {args.batch_size}")
    run.total_steps = args.steps or run.steps_per_epoch * args.epochs


def load_models(args, run):
    """Actor, frozen reference, critic (gae only): fp32 master weights, FSDP2-sharded; optimisers, LR schedules,
    the KL controller. --lora-rank: adapters on a frozen base instead (infra/lora.py), and no reference model: the
    reference is the actor with its adapters off (run.ref is None)."""
    mp = torch.bfloat16 if (args.dtype == "bfloat16" and run.device.type == "cuda") else None
    kw = dict(mixed_precision=mp, offload=args.offload)
    attn = args.attn_implementation
    refuse_unsupported(run.model_path, attn)  # the log-prob head too: token_logprobs computes the logits itself
    causal_lm = functools.partial(load_causal_lm, run.model_path, attn_implementation=attn)  # (meta) -> model
    run.actor = load_sharded(with_adapters(causal_lm, args), run.model_path, run.device, **kw,
                             grad_checkpointing=args.grad_checkpointing, init_missing=adapter_init(args))
    run.ref = None
    if not args.lora_rank:
        run.ref = load_sharded(causal_lm, run.model_path, run.device, **kw)
        run.ref.requires_grad_(False)
    if args.compile:
        compile_model(run.actor)
        if run.ref is not None:
            compile_model(run.ref)
    run.actor_opt = make_optimizer(run.actor, args.actor_lr, args.weight_decay)
    run.schedulers = [torch.optim.lr_scheduler.LambdaLR(run.actor_opt,
                                                        lr_lambda(run.total_steps, args.actor_warmup_ratio))]
    run.critic = run.critic_opt = None
    if args.adv == "gae":
        critic_path = resolve_model(args.critic_model or args.model)
        critic = functools.partial(load_critic, critic_path, attn_implementation=attn)
        run.critic = load_sharded(with_adapters(critic, args, trainable=("value_head.",)), critic_path, run.device,
                                  **kw, grad_checkpointing=args.grad_checkpointing, init_missing=adapter_init(args))
        if args.compile:
            compile_model(run.critic)
        run.critic_opt = make_optimizer(run.critic, args.critic_lr, args.weight_decay)
        run.schedulers.append(torch.optim.lr_scheduler.LambdaLR(run.critic_opt,
                                                                lr_lambda(run.total_steps, args.critic_warmup_ratio)))
    run.lora = None  # what a checkpoint records of the adapters and of the frozen bases they were trained on
    if args.lora_rank:
        bases = [run.model_path] + ([critic_path] if run.critic is not None else [])
        run.lora = dict(run.actor.lora_config, base=str(run.model_path),
                        base_files=[base_digests(path) for path in bases])
    run.kl_ctl = (ppo.AdaptiveKLController(args.kl_coef, args.kl_target, args.kl_horizon) if args.kl_target
                  else ppo.FixedKLController(args.kl_coef))


def with_adapters(build, args, trainable=(), dtype=None):
    """build(meta=...) -> model, with LoRA adapters added when --lora-rank (lora.adapt): the base frozen in the
    trainer's compute dtype (a float32 trainer cannot multiply bf16 weights without autocast; with --dtype auto this
    is the engine's dtype too) or `dtype`, `trainable` prefixes left trained."""
    if not args.lora_rank:
        return build

    def built(meta=False):
        model = build(meta=meta)
        try:
            return lora.adapt(model, decoder_layers(model), args.lora_rank, args.lora_alpha, args.lora_targets,
                              getattr(torch, dtype or args.dtype), trainable, seed=args.seed)
        except ValueError as e:
            die(f"--lora-targets: {e}")
    return built


def adapter_init(args):
    """load_sharded's init_missing: the adapters' starting values (lora.initial_value), or None without LoRA."""
    return functools.partial(lora.initial_value, seed=args.seed) if args.lora_rank else None


def sync_engine(run):
    """The actor into the engine: every tensor the engine loads, in its dtype (sharding.full_state_dict; with LoRA the
    base with each adapted layer merged, lora.merged_weights). A sync that leaves any engine weight unloaded raises
    engines.SyncIncomplete naming the weight, --model and the flags that chose what was sent."""
    if run.lora:
        pairs = lora.merged_weights(run.actor, run.engine.dtype)
        flags = (f"--lora-rank {run.lora['r']} --lora-alpha {run.lora['alpha']:g} "
                 f"--lora-targets {','.join(run.lora['targets'])}")
    else:
        pairs, flags = full_state_dict(run.actor, run.engine.dtype), "a full fine-tune"
    try:
        run.engine.sync_weights(pairs)
    except engines.SyncIncomplete as e:
        raise engines.SyncIncomplete(f"{e} (--model {run.model_path}, {flags})") from None


def make_optimizer(model, lr, weight_decay):
    """AdamW over the FSDP2 shards of the trained parameters (with LoRA: the adapters, and a critic's value head).
    foreach: torch otherwise steps DTensor parameters one at a time, an order of magnitude slower on CPU; the result
    is the same."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay,
                             foreach=True)


def lr_lambda(total_steps, warmup_ratio):
    warmup = int(total_steps * warmup_ratio)
    return lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0


def resume(args, run):
    """Continue from the newest complete checkpoint (checkpoint.find_resumable: OUT/latest unless it is damaged) ->
    its trainer state, or None where OUT holds none (a fresh run: metrics.jsonl from an earlier one is dropped)."""
    say = print if run.master else (lambda *a, **k: None)
    ckpt = find_resumable(run.out, log=lambda line: say(line, flush=True))
    metrics_file = run.out / METRICS
    if ckpt is None:
        say(f"[resume] no checkpoint in {run.out}: starting at step 0", flush=True)  # (a mistyped --out)
        if run.master:
            metrics_file.unlink(missing_ok=True)
        return None
    saved = json.loads((ckpt / "trainer_state.json").read_text())
    if why := lora_mismatch(saved.get("lora"), run.lora):
        die(f"--resume: {ckpt} {why}")
    same_run(ckpt, saved, args, run, say)
    if saved["step"] >= run.total_steps and saved.get("export", True) and not saved.get("pending"):
        say(f"[resume] {ckpt} is step {saved['step']}, and --steps asks for {run.total_steps}: nothing to train",
            flush=True)
    state = load_checkpoint(ckpt, models_and_optimisers(run))
    for sched, sd in zip(run.schedulers, state["schedulers"]):
        sched.load_state_dict(sd)
    run.kl_ctl.load_state_dict(state["kl_ctl"])
    step = state["step"]
    run.on_disk, run.exported = step, state.get("export", True)
    run.complete, run.resumed_from = {step}, step  # (verified: --keep-last may count it as kept)
    run.run_id = state.get("run_id") or run.run_id  # a checkpoint older than run ids: this run's own from now on
    if run.master and metrics_file.exists():  # forget steps logged after this checkpoint (and a torn last line)
        write_atomic(metrics_file, "".join(json.dumps(r) + "\n" for r in read_metrics(run.out, say) if r["step"] <= step))
    try:
        sync_engine(run)
    except engines.SyncIncomplete as e:
        die(f"--resume: {e}")
    say(f"[resume] {ckpt} at step {step}" + (" (its validation was cut short: running it first)"
                                               if state.get("pending") else ""), flush=True)
    return state


# Flags that change how a run runs, not what it computes: a resume may change them (each change is printed). Any
# other flag defines the run's maths (model, data, estimator, batch shape, seeds, learning rates, LoRA, the turn rule,
# the reward...): a resume compares it with the checkpoint's and refuses a change unless --allow-changed names it.
RUN_ONLY = {"steps", "epochs", "out", "resume", "overwrite", "allow_changed", "save_freq", "save_minutes", "keep_last",
            "shutdown_grace", "dist_timeout", "rollout_timeout", "max_bad_steps", "val_data", "val_limit", "val_freq",
            "val_before_train", "wandb", "tensorboard", "verbose", "grad_checkpointing", "compile", "offload",
            "cpu_threads", "peak_tflops", "dtype", "micro_batch_size", "micro_batch_tokens", "engine", "engine_dtype",
            "engine_tp", "gpu_memory_utilization", "enforce_eager", "attn_implementation"}
PATHS = {"model", "critic_model", "data"}  # compared as the files they name (a relative path, an absolute one)


def same_run(ckpt, saved, args, run, say):
    """Refuse in one line to continue the checkpoint's run with other maths (RUN_ONLY: the flags that may change),
    naming each flag, its old and new value and --allow-changed; print each change that is allowed, once. --steps
    (or --epochs) may change unless it moves the learning rate's warm-up (a share of the run's steps)."""
    old = saved.get("args")
    if old is None:
        say(f"[resume] {ckpt} records no flags (written before checkpoints did): not compared", flush=True)
        return
    now = vars(args)

    def warmups(a):  # lr_lambda's warm-up steps of the actor and the critic
        total = a.get("steps") or run.steps_per_epoch * (a.get("epochs") or 1)
        return [int(total * (a.get(f"{m}_warmup_ratio") or 0)) for m in ("actor", "critic")]

    def shown(key, value):
        if key in PATHS and isinstance(value, str) and Path(value).exists():
            return str(Path(value).resolve())
        return ",".join(value) if isinstance(value, (list, tuple)) else value

    flag = lambda key: "--" + key.replace("_", "-")  # noqa: E731
    changed = [k for k in sorted(old.keys() | now.keys()) if shown(k, old.get(k)) != shown(k, now.get(k))]
    allowed = set(args.allow_changed)
    if unknown := sorted(allowed - now.keys()):
        die(f"--allow-changed {','.join(unknown)}: not a flag of train.py")
    refused = [k for k in changed if k not in RUN_ONLY and k not in allowed]
    if warmups(old) != warmups(now) and "steps" not in allowed:
        refused.append("steps")
    if refused:
        die(f"--resume: {ckpt} belongs to a run with other " + "; ".join(
            f"{flag(k)} {shown(k, old.get(k))} (now {shown(k, now.get(k))}" + (
                f": the warm-up, actor and critic, {warmups(old)} steps, would be {warmups(now)})" if k == "steps"
                else ")") for k in refused)
            + f": give another --out for a new run, or continue this one with them on purpose: --allow-changed "
              f"{','.join(k.replace('_', '-') for k in refused)}")
    for k in changed:
        if k not in ("out", "resume", "overwrite", "allow_changed"):
            say(f"[resume] {flag(k)} {shown(k, old.get(k))} -> {shown(k, now.get(k))}"
                + ("" if k in RUN_ONLY else " (--allow-changed)"), flush=True)
    if saved.get("world_size") not in (None, run.world):
        say(f"[resume] {saved['world_size']} ranks -> {run.world}", flush=True)


def lora_mismatch(saved, now):
    """Why a checkpoint's adapters cannot continue in this run (its trainer_state's "lora" against run.lora), or None:
    one kind of training for the other, other adapter flags, or a base whose files differ from what they were
    trained on (adapters on another base load without an error and are garbage)."""
    if saved is None and now is None:
        return None
    if saved is None:
        return "is a full fine-tune's checkpoint: resume it without --lora-rank"
    if now is None:
        return f"holds LoRA adapters: resume with --lora-rank {saved['r']}"

    def flags(c):
        return {"--lora-rank": str(c["r"]), "--lora-alpha": f"{c['alpha']:g}", "--lora-targets": ",".join(c["targets"])}
    if diff := [f"{flag} {value}" for flag, value in flags(saved).items() if flags(now)[flag] != value]:
        return f"holds adapters of {' '.join(diff)}: resume with the flags it was trained with"
    for kind, old, new in zip(("--model", "--critic-model"), saved["base_files"], now["base_files"]):
        if diff := sorted(f for f in old.keys() | new.keys() if old.get(f) != new.get(f)):
            return (f"was trained on another base than this {kind} ({', '.join(diff)} differ): resume with the "
                    f"model its adapters belong to ({saved['base']})")
    return None


def logged_validations(run):
    """[(step, metrics)] of the validations metrics.jsonl holds (rank 0): the resumed run's before/after report."""
    rows = read_metrics(run.out) if run.master else []
    return [(r["step"], r) for r in rows if r.get("val/acc") is not None]


def models_and_optimisers(run):
    """What a checkpoint holds besides the trainer state: {"actor": (model, optimiser), "critic": ...}."""
    return {"actor": (run.actor, run.actor_opt), **({"critic": (run.critic, run.critic_opt)} if run.critic is not None else {})}


def trainer_state(args, run, step, pending=None, export=True):
    """What a checkpoint holds besides models, optimisers and RNGs. pending: the step's metrics line when a SIGTERM
    stopped the run before the step's validation (the resumed run validates, then logs it); export: it has actor/
    (and critic/); run_id: the run it belongs to (--keep-last prunes that run's checkpoints only)."""
    return {"kl_ctl": run.kl_ctl.state_dict(), "data_position": step * args.batch_size, "args": vars(args),
            "schedulers": [s.state_dict() for s in run.schedulers], "world_size": run.world, "pending": pending,
            "export": export, "run_id": run.run_id, "lora": run.lora}
