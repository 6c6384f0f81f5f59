"""train.py's bookkeeping: phase timers, one step's metrics, the console line, OUT/metrics.jsonl (and wandb /
tensorboard), the before/after validation summary and OUT/curves.png."""
import io
import json
import math
import os
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from infra.checkpoint import fsync_path
from infra.cli import die, no_link, write_atomic
from infra.collectives import all_reduce_dict
from infra.packing import padding_counts
from infra.perf import forward_flops, training_flops
from infra.system import peak_rss_gb
from rollout import trajectory_sums


@contextmanager
def timed(timer, name):
    t0 = time.time()
    yield
    timer[name] = time.time() - t0


def format_tokens(m, prefix=""):
    """'tokens D' for a metrics dict's decoded tokens, with the kept count and the interventions' only where they
    differ from it / are there."""
    d, k, i = (m[f"{prefix}{key}"] for key in ("decoded_tokens", "kept_tokens", "intervention_tokens"))
    extra = ([f"kept {k:.1f}"] if abs(k - d) >= 0.05 else []) + ([f"interventions {i:.1f}"] if i >= 0.05 else [])
    rep = m.get(f"{prefix}repeated") or 0.0
    return (f"tokens {d:.1f}" + (f" ({', '.join(extra)})" if extra else "")
            + (f"  repeated {rep:.0%} (after an answer {m[f'{prefix}repeated_after_answer']:.0%})" if rep else ""))


def step_metrics(run, args, step, trajs, batch, results, kl, old_logprobs, stats, skipped, update_groups, timer):
    """One step's metrics: rollout shape, rewards, KL, padding (sums over every rank), the update's
    statistics averaged over its mini-batches, timings."""
    act = batch["action_mask"].bool()                                                           # [B, R]
    pad_lp = padding_counts(batch, [torch.arange(len(trajs))])  # what packing computes does not depend on the cut
    pad_up = padding_counts(batch, update_groups)
    gap = 0.0 if old_logprobs is None else float((batch["rollout_logprobs"] - old_logprobs).abs()[act].sum())
    t = all_reduce_dict({
        **phase_flops(run, args, batch),
        "pad_lp": pad_lp["padding"], "computed_lp": pad_lp["computed"],
        "pad_up": pad_up["padding"], "computed_up": pad_up["computed"],
        "score": sum(r["score"] for r in results), "acc": sum(r["acc"] for r in results), "count": len(trajs),
        **trajectory_sums(trajs), "interventions": sum(x["interventions"] for x in trajs),
        "truncated": sum(x["truncated"] for x in trajs), "cut_turns": sum(x["cut_turns"] for x in trajs),
        "kl": float(kl[act].sum()), "actions": float(act.sum()), "logprob_gap": gap}, run.device)
    n, actions = t["count"], max(t["actions"], 1.0)
    metrics = {"step": step, "reward/mean": t["score"] / n, "acc/mean": t["acc"] / n,
               "decoded_tokens/mean": t["decoded_tokens"] / n, "kept_tokens/mean": t["kept_tokens"] / n,
               "intervention_tokens/mean": t["intervention_tokens"] / n, "turns/mean": t["turns"] / n,
               "interventions/mean": t["interventions"] / n, "truncated/share": t["truncated"] / n,
               "answered/share": t["answered"] / n, "repeated/share": t["repeated"] / n,
               "repeated/after_answer_share": t["repeated_after_answer"] / n,
               "turns/cut_at_answer_share": t["cut_turns"] / max(t["turns"], 1),
               "kl/mean": t["kl"] / actions, "kl/coef": run.kl_ctl.value,  # this step's coefficient
               "rollout/logprob_gap": t["logprob_gap"] / actions,
               "padding/logprobs": t["pad_lp"] / max(t["computed_lp"], 1),
               "padding/update": t["pad_up"] / max(t["computed_up"], 1),
               "actor/lr": run.schedulers[0].get_last_lr()[0], "update/skipped": skipped,
               "throughput/tokens_per_s": t["decoded_tokens"] / timer["step"], "system/peak_rss_gb": peak_rss_gb()}
    if run.critic is not None:
        metrics["critic/lr"] = run.schedulers[1].get_last_lr()[0]
    for phase in ("logprobs", "update"):  # model TFLOP/s per rank: every rank's FLOPs over its share of the time
        tflops = t[f"flops_{phase}"] / run.world / max(timer[phase], 1e-9) / 1e12
        metrics[f"perf/tflops/{phase}"] = tflops
        if run.peak_tflops:
            metrics[f"perf/mfu/{phase}"] = tflops / run.peak_tflops
    for key in sorted({k for s in stats for k in s}):  # a skipped update leaves its statistics out
        kept = [s[key] for s in stats if key in s and math.isfinite(s[key])]
        metrics[key] = float(np.mean(kept)) if kept else float("nan")
    metrics.update({f"time/{k}": v for k, v in timer.items()})
    return metrics


def phase_flops(run, args, batch):
    """This rank's model FLOPs (infra/perf.py) of the step's no-grad passes (reference, old log-probs unless the update
    supplies them, values) and of its update (actor and critic, forward + backward, every PPO epoch)."""
    seq = batch["prompt_mask"].sum(1) + batch["response_mask"].sum(1)                        # [B]
    resp = batch["response_mask"].sum(1)                                                    # [B]
    actor = forward_flops(run.flops["actor"], seq, resp)
    critic = forward_flops(run.flops["critic"], seq, resp) if "critic" in run.flops else 0.0
    update = training_flops(run.flops["actor"], seq, resp) + (
        training_flops(run.flops["critic"], seq, resp) if "critic" in run.flops else 0.0)
    return {"flops_logprobs": actor * (1 if run.reuse_old else 2) + critic, "flops_update": update * args.ppo_epochs}


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
        with os.fdopen(no_link(out / METRICS, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "a") as f:
            f.write(json.dumps(metrics) + "\n")  # strict JSON: NaN (explained_var of constant returns) -> null
        for sink in sinks:
            sink(metrics)
    return log


METRICS = "metrics.jsonl"


def read_metrics(out, say=print):
    """OUT/metrics.jsonl's rows ([] without one). A last line that a crash left torn (half written, or zeroed by the
    filesystem) is dropped with a line saying so: that step is logged again when the resumed run redoes it. A bad
    line before the last is damage, not a crash: one line naming it, exit 2."""
    path = Path(out) / METRICS
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")
    if lines[-1] == b"":
        lines.pop()  # (after the newline that ends the last line)
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except ValueError:
            if i < len(lines) - 1:
                die(f"{path}: line {i + 1} is not JSON, and it is not the last (a crash tears only the last line)")
            say(f"[metrics] {path}: its last line ({len(line)} bytes) is torn (a crash while it was written): dropped")
    return rows


def sync_metrics(out):
    """fsync OUT/metrics.jsonl (with each checkpoint: the steps it holds survive a crash of the node)."""
    if (Path(out) / METRICS).exists():
        fsync_path(Path(out) / METRICS)


def format_line(m, total_steps):
    t = " ".join(f"{k[5:]} {v:.1f}s" for k, v in m.items() if k.startswith("time/") and k not in ("time/step",
                                                                                                    "time/validate"))
    line = (f"step {m['step']}/{total_steps} | reward {m['reward/mean']:.3f} acc {m['acc/mean']:.3f} "
            f"tok {m['decoded_tokens/mean']:.0f} (kept {m['kept_tokens/mean']:.0f}) rep {m['repeated/share']:.2f} "
            f"turns {m['turns/mean']:.2f} int {m['interventions/mean']:.2f} ans {m['answered/share']:.2f} "
            f"| kl {m['kl/mean']:.4f} pg {m.get('loss/pg', 0):.4f} vf {m.get('loss/vf', 0):.4f} "
            f"clip {m.get('actor/clipfrac', 0):.3f} ent {m.get('actor/entropy', 0):.3f} gn {m['actor/grad_norm']:.2f} "
            f"| {t} step {m['time/step']:.1f}s {m['throughput/tokens_per_s']:.0f} tok/s "
            + (f"mfu {m['perf/mfu/update']:.0%} " if "perf/mfu/update" in m else "") +
            f"pad {m['padding/logprobs']:.0%}/{m['padding/update']:.0%}")
    if "val/acc" in m:
        line += f" | val acc {m['val/acc']:.3f} tok {m['val/decoded_tokens']:.0f} ({m['time/validate']:.0f}s)"
    return line


def report(val_history, out):
    """Before/after validation summary and OUT/curves.png (rows logged before decoded tokens were counted: left out)."""
    val_history = [(step, m) for step, m in val_history if "val/decoded_tokens" in m]
    if len(val_history) >= 2:
        (s0, a), (s1, b) = val_history[0], val_history[-1]
        da, db = a["val/decoded_tokens"], b["val/decoded_tokens"]
        print(f"[val] step {s0} -> {s1}: acc {a['val/acc']:.3f} -> {b['val/acc']:.3f} "
              f"({100 * (b['val/acc'] - a['val/acc']):+.1f} pts), decoded tokens {da:.1f} -> {db:.1f} "
              f"({100 * (db / max(da, 1e-9) - 1):+.0f}%), turns {a['val/turns']:.2f} -> {b['val/turns']:.2f}, "
              f"repeated {a['val/repeated']:.0%} -> {b['val/repeated']:.0%} "
              f"(after an answer {a['val/repeated_after_answer']:.0%} -> {b['val/repeated_after_answer']:.0%})", flush=True)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    logged = read_metrics(out)
    rows = [r for r in logged if "decoded_tokens/mean" in r]
    val_rows = [r for r in logged if r.get("val/decoded_tokens") is not None]
    if not rows:
        return
    # training rollouts (sampled) and, where it ran, validation (greedy) on the same axes
    keys = [("reward/mean", None), ("acc/mean", "val/acc"), ("decoded_tokens/mean", "val/decoded_tokens"),
            ("turns/mean", "val/turns")]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.5))
    for ax, (key, val_key) in zip(axes, keys):
        ax.plot([r["step"] for r in rows], [r[key] for r in rows], marker="o", label="train")
        if val_key and val_rows:
            ax.plot([r["step"] for r in val_rows], [r[val_key] for r in val_rows], marker="s", label="validation")
            ax.legend()
        ax.set_title(key), ax.set_xlabel("step")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    write_atomic(out / "curves.png", png.getvalue())
