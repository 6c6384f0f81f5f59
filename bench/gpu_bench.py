"""The trainer on one GPU: model TFLOP/s, share of the bf16 peak, memory per token, padding -- before and after.

    python bench/gpu_bench.py                       # this checkout's variants (< 5 min on an H200)
    python bench/gpu_bench.py --before .before      # + the same phases through an earlier commit's code
    python bench/gpu_bench.py --smoke               # a tiny model on the CPU: checks the script, measures nothing

One variant per subprocess (clean allocator and peak counters), each on the same 32 MuTIS-shaped trajectories
(prompt 100-300 tokens, response 256-4096 with a 40-token intervention after every 1000-token turn) through a
model of the shape of --config (default: DeepSeek-R1-Distill-Qwen-1.5B, random weights built on the GPU, no hub):

  logprobs    the no-grad log-prob pass (packing.forward_pass + model.token_logprobs, as train.py's reference pass)
  update      train.ppo_update over two mini-batches (FSDP2 bf16 mixed precision, one rank), then again with
              activation checkpointing (--grad-checkpointing)
  compiled    the variant with train.py's --compile (torch.compile of the decoder layers and the log-prob head); its
              warm-up repetition includes compiling
  bare        the same tokens through the bare bf16 transformers model, one unpadded sequence at a time (forward,
              log-prob + entropy, backward), with and without checkpointing: what a hand-written loop would get

Model FLOPs: perf.py's formula (train.py's perf/ metrics): per token 2 x the decoder layers' parameters, the LM head
on response tokens, causal attention 2 L d s^2 per sequence; x3 with the backward.
Memory: `state` is what is allocated before a phase (fp32 weights, Adam moments, the reference), `grads` the
actor's fp32 gradients, `act MiB/tok` the rest of the phase's peak (activations and temporaries) divided by the
largest micro-batch's tokens (padded code: rows x width). With checkpointing the peak can be the optimiser step's
(its foreach temporaries, about one fp32 copy of the parameters) rather than the activations': then `act MiB/tok`
is an upper bound.
"""
import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from infra import perf  # noqa: E402  (this checkout's formula, whichever code version runs)
from trainer_phases import Phases, load_code, plain_pass, rollout_like  # noqa: E402

# DeepSeek-R1-Distill-Qwen-1.5B's config.json (the fields that shape the compute)
R1_DISTILL_1_5B = dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=False,
                       max_position_embeddings=131072, rope_theta=10000.0, rms_norm_eps=1e-6, use_sliding_window=False)
TINY = dict(R1_DISTILL_1_5B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000)

# name -> (code: "after" | "before", attention, micro-batch: rows or None, tokens or None, run the bare model,
#          torch.compile the layers and the log-prob head (--compile), run by default)
VARIANTS = {
    "before (padded, sdpa, 4 rows)": ("before", "sdpa", 4, None, False, False, True),
    "packed varlen, 4 rows": ("after", "varlen", 4, None, True, False, True),
    "packed varlen, 16k tokens": ("after", "varlen", None, 16384, False, False, True),
    "packed varlen, 16k tokens, compiled": ("after", "varlen", None, 16384, False, True, True),
    "packed sdpa, 4 rows": ("after", "sdpa", 4, None, False, False, False),  # measured 2x slower than varlen
}


def build(code, cfg, attn, device, dtype=torch.float32):
    from transformers import AutoConfig, AutoModelForCausalLM

    if attn == "varlen":
        code.packing.register_varlen_attention()
    config = AutoConfig.for_model(**cfg)
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)


def gib(n):
    return n / 2**30


def local(t):
    """This rank's part of a (possibly FSDP2-sharded) tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def run_variant(name, args):
    """One variant in this process -> dict of measurements."""
    which, attn, rows, tokens, bare_too, compiled, _ = VARIANTS[name]
    code = load_code(args.before if which == "before" else None)
    parallel, train = code.parallel, code.train
    code.system.quiet_logs()
    _, _, _, device = parallel.init_distributed()
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = TINY if args.smoke else R1_DISTILL_1_5B
    n, prompt, response, turn = (6, (10, 30), (20, 200), 64) if args.smoke else (32, (100, 300), (256, 4096), 1000)
    trajs = rollout_like(n, cfg["vocab_size"], args.seed, prompt, response, turn=turn, intervention=40, every=1)
    batch = importlib.import_module("rollout").to_batch(trajs, 0)  # the code version's own
    flags = ["--data", "x", "--adv", "grpo", "--samples-per-prompt", "8", "--temperature", "1.0",
             "--micro-batch-size", str(rows or 4), "--actor-warmup-ratio", "0", "--dtype", "bfloat16"]
    if code.packing:
        flags += ["--attn-implementation", attn] + (["--micro-batch-tokens", str(tokens)] if tokens else [])
    if "rollout-is-cap" in Path(train.__file__).read_text():
        flags += ["--rollout-is-cap", "0"]  # the same work as the code before it (no rollout log-probs here)
    targs = train.parse_args(flags)
    mp = torch.bfloat16 if cuda else None
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731
    phases = Phases(code, targs, autocast, device)
    actor = parallel.shard(build(code, cfg, attn, device), mixed_precision=mp)
    ref = parallel.shard(build(code, cfg, attn, device), mixed_precision=mp)
    ref.requires_grad_(False)
    if compiled:
        code.model.compile_model(actor)
        code.model.compile_model(ref)
    opt = code.setup.make_optimizer(actor, 1e-6, 0.0)
    B = len(trajs)
    mask = batch["action_mask"].float()
    adv = torch.randn(B, generator=torch.Generator().manual_seed(1))[:, None] * mask
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(2))
    minis = [perm[:B // 2], perm[B // 2:]]
    groups = phases.micro(batch, torch.arange(B))
    biggest = max(phases.counts(batch, [g])["computed"] for g in groups)  # padded code: rows x width
    res = dict(variant=name, attention=attn, micro=f"{tokens} tokens" if tokens else f"{rows} rows", compiled=compiled,
               tokens=sum(len(t["prompt_ids"]) + len(t["response_ids"]) for t in trajs),
               padding=round(phases.padding(batch, groups), 4), micro_batches=len(groups), micro_tokens_max=biggest)
    fl_fwd = perf.forward_flops(perf.model_shape(actor), [len(t["prompt_ids"]) + len(t["response_ids"]) for t in trajs],
                                [len(t["response_ids"]) for t in trajs])
    fl_upd = 3 * fl_fwd

    def timed(fn, reps=2):
        """Run fn reps times (the first warms up: kernels, FSDP's lazy init, Adam state, torch.compile); the last
        one's seconds."""
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
        return time.perf_counter() - t0

    def memory_around(fn, grads=0):
        """fn's peak over what was allocated before it, less the fp32 gradients it adds (grads bytes, minus any
        an earlier update left allocated: the code before this one kept them between steps) -> per token."""
        if not cuda:
            fn()
            return {}
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        at_rest = torch.cuda.memory_allocated()
        held = sum(local(q.grad).numel() * 4 for q in actor.parameters() if q.grad is not None)
        fn()
        peak = torch.cuda.max_memory_allocated()
        return dict(state_gib=gib(at_rest), grads_gib=gib(grads), peak_gib=gib(peak),
                    act_per_token_mib=(peak - at_rest - max(grads - held, 0)) / biggest / 2**20)

    # ---- the log-prob pass
    s = timed(lambda: phases.logprobs(ref, batch))
    res["logprobs"] = dict(seconds=s, tflops=fl_fwd / s / 1e12, **memory_around(lambda: phases.logprobs(ref, batch)))
    batch.update(old_logprobs=phases.logprobs(actor, batch), ref_logprobs=phases.logprobs(ref, batch),
                 advantages=adv, action_mask=mask)

    # ---- the update, without and with activation checkpointing
    grad_bytes = sum(local(q).numel() for q in actor.parameters()) * 4

    def update():
        for mini in minis:
            phases.update(actor, opt, batch, mini)
    for ckpt in (False, True):
        if ckpt:
            actor.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        s = timed(update)
        res[f"update{'_ckpt' if ckpt else ''}"] = dict(seconds=s, tflops=fl_upd / s / 1e12,
                                                      **memory_around(update, grad_bytes))

    # ---- the bare bf16 model, one unpadded sequence at a time
    if bare_too:
        del actor, ref, opt
        bare = build(code, cfg, "sdpa", device, torch.bfloat16)
        for ckpt in (False, True):
            if ckpt:
                bare.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            bare.train()

            def plain():
                plain_pass(bare, trajs, nullcontext, True, 1.0, device)
                bare.zero_grad(set_to_none=True)
            s = timed(plain)
            res[f"bare{'_ckpt' if ckpt else ''}"] = dict(seconds=s, tflops=fl_upd / s / 1e12)
    peak = perf.peak_tflops(device)
    for phase in ("logprobs", "update", "update_ckpt", "bare", "bare_ckpt"):
        if phase in res:
            res[phase]["tokens_per_s"] = res["tokens"] / res[phase]["seconds"]
            res[phase]["peak_share"] = res[phase]["tflops"] / peak if peak else None
    res["device"] = torch.cuda.get_device_name(device) if cuda else "cpu"
    return res


def table(results):
    lines = [f"{'variant':36} {'pad':>5} {'phase':12} {'s':>6} {'tok/s':>8} {'TFLOP/s':>8} {'peak%':>6} "
             f"{'peak GiB':>8} {'state':>6} {'grads':>6} {'act MiB/tok':>11}"]
    for r in results:
        for phase in ("logprobs", "update", "update_ckpt", "bare", "bare_ckpt"):
            if phase not in r:
                continue
            p = r[phase]
            share = f"{100 * p['peak_share']:5.1f}%" if p.get("peak_share") else "    -"
            mem = (f"{p['peak_gib']:8.1f} {p['state_gib']:6.1f} {p['grads_gib']:6.1f} {p['act_per_token_mib']:11.3f}"
                   if "peak_gib" in p else "")
            lines.append(f"{r['variant']:36} {100 * r['padding']:4.1f}% {phase:12} {p['seconds']:6.2f} "
                         f"{p['tokens_per_s']:8.0f} {p['tflops']:8.1f} {share} {mem}")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", default=None, help="an earlier commit's files (git archive C | tar -x -C DIR): "
                                                  "adds its padded trainer as the 'before' variant")
    p.add_argument("--variants", default=None, help="separated by ';' (default: all but the last): "
                                                    + "; ".join(VARIANTS))
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (checks the script)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=150, help="seconds per variant (twice that for a compiled one)")
    p.add_argument("--out", default=None, help="write every measurement as JSON here")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run this variant in this process
    args = p.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_variant(args.one, args)), flush=True)
        return
    names = [v.strip() for v in args.variants.split(";")] if args.variants else [v for v in VARIANTS if VARIANTS[v][6]]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    names = [v for v in names if VARIANTS[v][0] == "after" or args.before]
    results, t0 = [], time.time()
    for name in names:
        cmd = [sys.executable, __file__, "--one", name, "--seed", str(args.seed)] + (["--smoke"] if args.smoke else [])
        cmd += ["--before", args.before] if args.before else []
        timeout = args.timeout * (2 if VARIANTS[name][5] else 1)  # a compiled variant compiles first
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        except subprocess.TimeoutExpired:
            print(f"[gpu_bench] {name}: over {timeout:.0f}s, skipped", file=sys.stderr, flush=True)
            continue
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"[gpu_bench] {name}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}", file=sys.stderr,
                  flush=True)
            continue
        results.append(json.loads(line[7:]))
        print(f"[gpu_bench] {name}: done ({time.time() - t0:.0f}s)\n{table(results[-1:])}", file=sys.stderr,
              flush=True)
        if args.out:  # after every variant: a run cut short keeps what it measured
            Path(args.out).write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
