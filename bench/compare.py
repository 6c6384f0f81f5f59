"""`make compare`: MuTIS against its single-turn baselines, trained and scored the same way.

Every run starts from the same model and trains on the same data with the same seed, steps and rollouts per
step (the train.py arguments after `--`; `make compare` passes the demo's); only the rollout shape and the
reward differ (RUNS below; length_penalty_C prices a full-cap response at C correct answers). Each run may
validate in its own rollout setting while it trains (train.py's --val-freq; curves.png plots the training rollouts
and those validations), then one eval.py call per protocol (greedy; sampled:
T 0.6, mean@4) scores the untrained model and every final checkpoint on the validation set, single turn, at the
token cap a MuTIS trajectory could reach (--eval-turns K: with K interventions instead).

    python bench/compare.py -- --data arith_train --val-data arith_test --steps 12 ...   # train all, summarize
    python bench/compare.py --runs mutis,single_cap --seeds 0,1 --train-only -- ...      # one machine's share
    python bench/compare.py --summarize -- ...       # eval.py + tables over every finished run in --out
    python bench/compare.py --launcher "torchrun --nproc_per_node 8" -- --model /path/to/hf_model ...

Writes OUT/<run>-s<seed>/ (train.py's --out, plus train.log and compare.json once it succeeded: a rerun keeps a
run whose compare.json holds the same train.py arguments, so a stopped compare resumes), OUT/eval/ and
OUT/eval-sampled/ (eval.py's outputs, reused by a later --summarize with the same arguments), OUT/summary.md,
OUT/summary.json, OUT/frontier.png (accuracy against mean tokens with SE bars) and OUT/curves.png.
"""
import contextlib
import io
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from eval import PROTOCOLS  # noqa: E402
from infra.cli import ArgumentParser, die, write_atomic  # noqa: E402

# eval.py's protocols, with the sampled one at k = 4 (eval.py's default is 16): a CPU comparison of many runs
SETTINGS = {**PROTOCOLS, "sampled": {**PROTOCOLS["sampled"], "samples_per_prompt": 4}}
LENGTH_COST = 0.5  # length_penalty: what a response at the full cap costs, in correct answers


def single_turn(tokens):
    return ["--max-turns", "0", "--turn-tokens", str(tokens), "--max-response-tokens", str(tokens)]


def length_penalty(cost):
    """single_cap with score = acc - C x tokens, C = cost/cap: a full-cap response costs `cost` correct answers."""
    return (f"single_cap with a per-token reward cost: a full-cap response costs {cost:g} of a correct answer "
            f"(score = acc - C x tokens, C = {cost:g}/cap)",
            lambda T, cap: single_turn(cap) + ["--length-coef", f"{cost / cap:.6g}"])


# name -> (why, extra train.py args from the per-turn budget T and the MuTIS cap), in training order
RUNS = {
    "mutis": ("MuTIS as configured: T-token turns, an intervention after each answerless turn",
              lambda T, cap: []),
    "single_cap": ("no interventions; one turn may run as long as a whole MuTIS trajectory",
                   lambda T, cap: single_turn(cap)),
    "single_hard": ("no interventions; the per-turn budget is the whole cap, no second chance",
                    lambda T, cap: single_turn(T)),
    "length_penalty": length_penalty(LENGTH_COST),
}
COSTED = re.compile(r"length_penalty_(\d+(?:\.\d+)?)")  # length_penalty_C: the penalty at another cost C


def run_spec(name):
    """A --runs name -> (why, extra): a RUNS entry, or length_penalty_C (a full-cap response costs C); else None."""
    if name in RUNS:
        return RUNS[name]
    m = COSTED.fullmatch(name)
    return length_penalty(float(m[1])) if m else None


def run_order(name):
    """Sort key: RUNS order, the penalties at any cost in length_penalty's place by cost, unknown names last."""
    if (m := COSTED.fullmatch(name)) or name == "length_penalty":
        return list(RUNS).index("length_penalty"), float(m[1]) if m else LENGTH_COST
    return (list(RUNS).index(name), 0) if name in RUNS else (len(RUNS), 0)


def binomial_se(p, n):
    return math.sqrt(p * (1 - p) / n) if n else float("nan")


def aggregate(per_seed):
    """[{metric: value}] over seeds -> mean of each metric (None where no seed has it), acc range, seeds, and the
    standard errors: acc_se = sqrt(s_seeds^2 / S + p(1-p) / n), the spread of the S seeds' accuracies (training
    noise) plus the binomial error of n problems (which problems were drawn, shared by every seed); tok_se over
    seeds (None for one seed)."""
    keys = dict.fromkeys(k for m in per_seed for k in m if k != "seed")
    out = {k: (statistics.fmean(v) if (v := [m[k] for m in per_seed if m.get(k) is not None]) else None)
           for k in keys}
    accs, toks, S = [m["acc"] for m in per_seed], [m["decoded_tokens"] for m in per_seed], len(per_seed)
    seed_var = statistics.variance(accs) / S if S > 1 else 0.0
    out.update(acc_min=min(accs), acc_max=max(accs), seeds=S,
               acc_se=math.sqrt(seed_var + binomial_se(out["acc"], out["n"]) ** 2),
               tok_se=statistics.stdev(toks) / math.sqrt(S) if S > 1 else None)
    return out


def table(rows, turn_tokens):
    """rows: [(name, aggregate)] -> markdown; accuracy in % with its SE over seeds and problems (aggregate)."""
    def f(v, fmt, scale=1):
        return "–" if v is None else format(v * scale, fmt)
    head = ["run", "seeds", "acc %", "± SE", "seed range", f"acc % at {turn_tokens} tok", "mean tok", "median tok",
            "tok to 1st right", "at cap %", "unfinished %", "repeated % (after answer)", "val acc % (own)",
            "val tok (own)",
            "val turns (own)", "train min"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, m in rows:
        spread = f"{100 * m['acc_min']:.1f}–{100 * m['acc_max']:.1f}" if m["seeds"] > 1 else "–"
        cells = [name, str(m["seeds"]), f(m["acc"], ".1f", 100), f(m["acc_se"], ".1f", 100), spread,
                 f(m.get("acc_at_T"), ".1f", 100), f(m["decoded_tokens"], ".0f"), f(m["median_decoded_tokens"], ".0f"),
                 f(m.get("first_correct_tokens"), ".0f"),
                 f(m.get("at_cap"), ".0f", 100), f(m.get("unfinished"), ".0f", 100),
                 f"{f(m.get('repeated'), '.0f', 100)} ({f(m.get('repeated_after_answer'), '.0f', 100)})",
                 f(m.get("val_acc"), ".1f", 100),
                 f(m.get("val_tokens"), ".0f"), f(m.get("val_turns"), ".2f"), f(m.get("wall_s"), ".1f", 1 / 60)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def eval_argv(ta, checkpoints, cap, turn_tokens, eval_turns, limit, out, protocol="greedy"):
    """eval.py's arguments: every checkpoint on the validation set under one setting and protocol (eval.py's
    --protocol: greedy, or sampled mean@4 at T = 0.6: SETTINGS)."""
    argv = [*checkpoints, "--benchmarks", ta.val_data, "--max-response-tokens", str(cap), "--protocol", protocol,
            "--samples-per-prompt", str(SETTINGS[protocol]["samples_per_prompt"]),
            "--budgets", ",".join(str(b) for b in sorted({turn_tokens, 2 * turn_tokens, cap}) if b <= cap),
            "--max-turns", str(eval_turns), "--engine", ta.engine, "--engine-dtype", ta.engine_dtype, "--out", str(out)]
    if eval_turns:
        argv += ["--turn-tokens", str(turn_tokens), "--turn-rule", ta.turn_rule, "--intervention-text",
                 ta.intervention_text] + ([] if ta.cut_at_answer else ["--no-cut-at-answer"])
    for s in ta.stop or []:
        argv += ["--stop", s]
    if ta.system_prompt is not None:
        argv += ["--system-prompt", ta.system_prompt]
    if limit:
        argv += ["--limit", str(limit)]
    return argv + (["--enforce-eager"] if ta.enforce_eager else [])


def at_cap(samples_path, benchmark, cap):
    """{checkpoint: share of its eval.py responses on benchmark that used the whole cap} from samples.jsonl."""
    hits = {}
    for line in open(samples_path):
        s = json.loads(line)
        if s["benchmark"] == benchmark:
            hits.setdefault(s["checkpoint"], []).append(s["decoded_tokens"] >= cap)
    return {c: statistics.fmean(v) for c, v in hits.items()}


def val_rows(run_dir):
    """A run's validation rows (its own rollout setting) from its metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    return [r for r in map(json.loads, open(path)) if r.get("val/acc") is not None] if path.exists() else []


def train_rows(run_dir):
    """A run's training-step rows (its rollouts of every step) from its metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    return [r for r in map(json.loads, open(path)) if r.get("acc/mean") is not None] if path.exists() else []


def last_val(rows):
    """The last validation of a run as table metrics, or {}."""
    return {"val_acc": rows[-1]["val/acc"], "val_tokens": rows[-1]["val/decoded_tokens"],
            "val_turns": rows[-1].get("val/turns"), "val_step": rows[-1]["step"]} if rows else {}


def finished_runs(out):
    """[(name, seed, dir, record)] of every run directory in out whose train.py succeeded, in RUNS order."""
    found = []
    for d in sorted(out.glob("*-s*")):
        if (d / "compare.json").exists() and (d / "latest").exists():
            rec = json.loads((d / "compare.json").read_text())
            found.append((rec["run"], rec["seed"], d, rec))
    return sorted(found, key=lambda x: (run_order(x[0]), x[0], x[1]))


def parse_train(argv):
    """train.py's own parser on argv -> (namespace, None), or (None, its error line)."""
    import train
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return train.parse_args(argv), None
    except SystemExit:
        return None, err.getvalue().strip().removeprefix("error: ")


STEP_LINE = re.compile(r"step \d+/\d+ |\[val\] ")  # train.py's step and validation lines, not its progress bars


def stream(cmd, log, label, show=STEP_LINE):
    """Run cmd with its output in log; echo the lines that match `show` (None: none), prefixed by label -> exit code."""
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
        for line in p.stdout:
            f.write(line)
            if show and show.match(line):
                print(f"[{label}] {line.rstrip()}", flush=True)
        return p.wait()


def last_line(log):
    """The last non-empty line of a log, shortened: a failed run's own error or exception."""
    lines = [x.strip() for x in open(log) if x.strip()]
    return (lines[-1].removeprefix("error: ")[:200]) if lines else "no output"


def failure(code, log):
    """Why a child failed: the signal that killed it (its log then ends mid-line), else its log's last line."""
    if code < 0:
        name = signal.Signals(-code).name
        return f"killed by {name}" + (", as the out-of-memory killer does" if name == "SIGKILL" else "")
    return last_line(log)


def without_out(argv):
    """argv less its --out DIR (or --out=DIR): what the summary shows, since each run writes to OUT/<name>-s<seed>
    (train_run's --out comes last and wins); the stored arguments keep it, so kept runs still match."""
    shown, rest = [], iter(argv)
    for a in rest:
        if a == "--out":
            next(rest, None)  # its value, whatever it looks like
        elif not a.startswith("--out="):
            shown.append(a)
    return shown


def train_run(name, seed, args, out, launcher):
    """train.py with args (base + the run's extra) at this seed into OUT/<name>-s<seed>; compare.json on success."""
    d = out / f"{name}-s{seed}"
    done = d / "compare.json"
    if done.exists() and (d / "latest").exists() and json.loads(done.read_text()).get("args") == args:
        print(f"[{name} s{seed}] already trained with these arguments ({done}): kept", flush=True)
        return
    shutil.rmtree(d, ignore_errors=True)  # train.py appends to metrics.jsonl: start clean
    d.mkdir(parents=True)
    cmd = [*(shlex.split(launcher) or [sys.executable]), str(ROOT / "train.py"), *args,
           "--seed", str(seed), "--out", str(d)]
    print(f"[{name} s{seed}] {run_spec(name)[0]}; log {d / 'train.log'}", flush=True)
    t0 = time.time()
    if code := stream(cmd, d / "train.log", f"{name} s{seed}"):
        sys.exit(f"error: run {name} (seed {seed}) failed ({failure(code, d / 'train.log')}); log: {d / 'train.log'}")
    write_atomic(d / "compare.json", json.dumps({"run": name, "seed": seed, "wall_s": round(time.time() - t0, 1),
                                                 "args": args, "command": cmd}, indent=2) + "\n")


def plot(found, path):
    """Per step, one line per run and seed: the training rollouts' accuracy and mean tokens (sampled, own rollout
    setting; every step has them) with the validations (greedy, own setting) as larger markers where a run has any."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    colors, seeds = {}, sorted({seed for _, seed, _, _ in found})
    for name, seed, d, _ in found:
        rows, val = train_rows(d), val_rows(d)
        color = colors.setdefault(name, f"C{len(colors)}")
        style = ("-", "--", ":", "-.")[seeds.index(seed) % 4]  # one dash per seed
        for ax, key, vkey, scale in ((axes[0], "acc/mean", "val/acc", 100),
                                     (axes[1], "decoded_tokens/mean", "val/decoded_tokens", 1)):
            ax.plot([r["step"] for r in rows], [scale * r[key] for r in rows], color=color, linestyle=style,
                    label=f"{name} s{seed}")
            ax.plot([r["step"] for r in val], [scale * r[vkey] for r in val], marker="o", markersize=7,
                    color=color, linestyle="none")
    axes[0].set(title="accuracy % (line: training rollouts; o: validation)", xlabel="step")
    axes[1].set(title="mean decoded tokens (line: training rollouts; o: validation)", xlabel="step")
    for ax in axes:
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    write_atomic(path, png.getvalue())


def frontier(tables, path):
    """Accuracy against mean tokens, one panel per protocol: every run a point with its SE bars, untrained too."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(tables), figsize=(5.5 * len(tables), 4.2), squeeze=False)
    for ax, (protocol, rows) in zip(axes[0], tables.items()):
        for i, (name, m) in enumerate(rows):
            ax.errorbar(m["decoded_tokens"], 100 * m["acc"], yerr=100 * m["acc_se"], xerr=m["tok_se"] or 0, fmt="o",
                        color="black" if name == "untrained" else f"C{i}", capsize=3, label=name)
        ax.set(title=f"{protocol}: accuracy % against mean decoded tokens", xlabel="mean decoded tokens",
               ylabel="accuracy % (± SE over seeds and problems)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    write_atomic(path, png.getvalue())


def evaluate(out, ta, found, cap, T, opts, protocol):
    """One eval.py call: the untrained model and every final checkpoint under `protocol` -> (scored(ckpt), argv, s).
    An eval directory written by the same arguments is reused (--summarize after adding a protocol). cap: eval.py's
    token cap (--eval-tokens, else the MuTIS cap)."""
    sub = out / ("eval" if protocol == "greedy" else f"eval-{protocol}")
    ckpts = [ta.model] + [str(d / "latest") for _, _, d, _ in found]
    limit = opts.sampled_limit if protocol == "sampled" and opts.sampled_limit else opts.eval_limit
    argv = eval_argv(ta, ckpts, cap, T, opts.eval_turns, limit, sub, protocol)
    t0, done = time.time(), sub / "compare_argv.json"  # the eval.py arguments that wrote sub/, once it succeeded
    if done.exists() and json.loads(done.read_text()) == argv and (sub / "summary.json").exists():
        print(f"[eval] {protocol}: {sub} already holds these checkpoints under the same arguments", flush=True)
    else:
        print(f"[eval] {protocol}: the untrained model and {len(found)} checkpoints on {ta.val_data}; "
              f"log {sub}.log", flush=True)
        done.unlink(missing_ok=True)
        if code := stream([sys.executable, str(ROOT / "eval.py"), *argv], Path(f"{sub}.log"), "eval", show=None):
            sys.exit(f"error: eval.py failed ({failure(code, Path(f'{sub}.log'))}); log: {sub}.log")
        write_atomic(done, json.dumps(argv) + "\n")
    results = json.loads((sub / "summary.json").read_text())["results"]
    capped = at_cap(sub / "samples.jsonl", ta.val_data, cap)

    def scored(ckpt):
        r = results[ckpt][ta.val_data]
        return {"acc": r["accuracy"], "n": r["n"], "acc_at_T": r.get("budget_accuracy", {}).get(str(T)),
                "decoded_tokens": r["decoded_tokens"], "median_decoded_tokens": r["median_decoded_tokens"],
                "at_cap": capped[ckpt], "unfinished": r.get("truncated"), "repeated": r.get("repeated"),
                "repeated_after_answer": r.get("repeated_after_answer"),
                "first_correct_tokens": r.get("first_correct_tokens"), "reaches_correct": r.get("reaches_correct")}
    return scored, argv, time.time() - t0


def summarize(out, ta, base, cap, T, opts, notes):
    found = finished_runs(out)
    if not found:
        die(f"no finished run in {out} (a run directory holds compare.json once its train.py succeeded)")
    for name, seed, d, rec in found:
        spec = run_spec(name)
        if spec is None or rec["args"] != base + spec[1](T, cap):
            notes.append(f"{d.name} was trained with other train.py arguments than these (see its compare.json)")
            print(f"note: {notes[-1]}", flush=True)
    tables, per_protocol, evals, eval_s = {}, {}, {}, 0.0
    eval_cap = opts.eval_tokens or cap
    for protocol in opts.protocols:
        scored, evals[protocol], secs = evaluate(out, ta, found, eval_cap, T, opts, protocol)
        eval_s += secs
        per_run = {}
        for name, seed, d, rec in found:
            per_run.setdefault(name, []).append({**scored(str(d / "latest")), **last_val(val_rows(d)),
                                                 "wall_s": rec["wall_s"], "seed": seed})
        tables[protocol] = [("untrained", aggregate([scored(ta.model)]))] + [(k, aggregate(v))
                                                                             for k, v in per_run.items()]
        per_protocol[protocol] = {"untrained": tables[protocol][0][1], "runs": per_run}
    plot(found, out / "curves.png")
    frontier(tables, out / "frontier.png")
    train_s = sum(rec["wall_s"] for *_, rec in found)
    setting = (f"single turn at {eval_cap} tokens" if not opts.eval_turns else
               f"{opts.eval_turns} interventions, {T}-token turns, {eval_cap} tokens in all")
    steps = f"{ta.steps} steps" if ta.steps else f"{ta.epochs} epochs"
    val_steps = sorted({r["step"] for *_, d, _ in found for r in val_rows(d)})
    every = f"at step {', '.join(map(str, val_steps))}" if val_steps else "never"
    names = list(dict.fromkeys(name for name, *_ in found))
    results = []
    for protocol, rows in tables.items():
        how = ", ".join(f"{k.replace('_', ' ')} {v:g}" for k, v in SETTINGS[protocol].items())
        results += [f"### {protocol} ({how}; {int(rows[0][1]['n'])} problems)", "", table(rows, T)]
    text = "\n".join([
        "# make compare: MuTIS against its baselines", "",
        f"Command: `{' '.join(sys.argv)}`  ", f"Finished {time.strftime('%Y-%m-%d %H:%M')} on {machine()}.", "",
        "## Settings", "",
        f"- Every run: model `{ta.model}`, data `{ta.data}`, {steps} of {ta.batch_size} prompts x "
        f"{ta.samples_per_prompt} samples (the same rollouts per step), seeds {sorted({s for _, s, _, _ in found})}; "
        f"train.py arguments `{' '.join(without_out(base))}`, each run's `--out` {out}/<run>-s<seed>.",
        f"- MuTIS budget: {T}-token turns, up to {ta.max_turns} interventions of {opts.intervention_tokens} tokens: "
        f"a trajectory reaches at most {cap} tokens (the single-turn cap below).",
        *([f"- eval.py's cap: {eval_cap} tokens (--eval-tokens), above the MuTIS cap: every model is measured whole."]
          if eval_cap != cap else []),
        f"- Validation while training (val columns, the markers in curves.png): greedy, each run in its own rollout "
        f"setting, on {'the first ' + str(ta.val_limit) if ta.val_limit else 'all'} problems of `{ta.val_data}`, "
        f"{every}; the columns show the last one. curves.png's lines: the training rollouts of every step.",
        f"- Final evaluation (acc, tokens, at cap, unfinished, repeated): one eval.py call per protocol, {setting}, on the "
        f"problems of `{ta.val_data}` (n below); acc at {T} tok re-scores the same generations cut at {T} tokens; "
        f"tok to 1st right: eval.py's `first_correct_tokens`, the mean tokens up to where a response first states "
        f"the right result, over the responses that do (the rest decoded after it bought nothing); at cap: "
        f"responses that used all {eval_cap} tokens; unfinished: eval.py's `truncated`, a token limit cut the response "
        f"before any answer; repeated: responses that ran into the cap in a loop, before or after an answer (in "
        f"brackets: after one); tokens are those the engine decoded (val tok too: every turn, what a turn's cut "
        f"dropped included); SE = sqrt(s_seeds^2/S + p(1-p)/n) (the seeds' spread and the problems' binomial "
        f"error); frontier.png plots accuracy against mean tokens with these bars.",
        "", "| run | why | extra train.py arguments |", "|---|---|---|",
        *[f"| {k} | {run_spec(k)[0]} | `{' '.join(run_spec(k)[1](T, cap)) or '(none)'}` |"
          for k in names if run_spec(k)],
        "", "## Results", "", *results,
        f"Wall time: training {train_s / 60:.1f} min over {len(found)} runs, eval.py {eval_s / 60:.1f} min. "
        f"Outputs: eval/ and eval-sampled/ (eval.py: summary.md, samples.jsonl, budget.png), frontier.png, "
        f"curves.png, <run>-s<seed>/.",
        *[f"\nNote: {x}" for x in notes], ""])
    write_atomic(out / "summary.md", text)
    write_atomic(out / "summary.json", json.dumps({"settings": {"cap": cap, "eval_cap": eval_cap, "turn_tokens": T,
                                                                "train_args": base,
                                                                "eval_args": evals, "eval_s": round(eval_s, 1)},
                                                   **per_protocol[opts.protocols[0]], "protocols": per_protocol,
                                                   "notes": notes}, indent=2) + "\n")
    print(f"\nwrote {out / 'summary.md'}, summary.json, frontier.png, curves.png; eval.py outputs in {out}/eval*\n")
    print("\n".join(results), end="")


def machine():
    """CPU model, cores, bf16 flags and GPU: what the wall times depend on."""
    import torch
    info = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    cpu = re.search(r"model name\s*:\s*(.*)", info)
    bf16 = " ".join(sorted(set(re.findall(r"\b(?:avx512_bf16|amx_bf16)\b", info)))) or "none"
    gpu = f", GPU {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}" if torch.cuda.is_available() else ""
    return f"{cpu.group(1) if cpu else '?'}, {os.cpu_count()} cores (bf16 flags: {bf16}){gpu}"


def parse_args(argv):
    """compare.py's own flags before `--`, train.py's after it."""
    cut = argv.index("--") if "--" in argv else len(argv)
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=" ".join(RUNS), help=f"runs to train, space/comma-separated: {', '.join(RUNS)}, "
                                                         "or length_penalty_C (a full-cap response costs C)")
    p.add_argument("--seeds", default="0", help="seeds, space- or comma-separated: every run once per seed")
    p.add_argument("--out", default="runs/compare", help="output directory")
    p.add_argument("--launcher", default="", help="what runs train.py, e.g. 'torchrun --nproc_per_node 8' "
                                                  "(default: this python)")
    p.add_argument("--eval-turns", type=int, default=0, help="eval.py --max-turns (0: single turn, the paper's eval)")
    p.add_argument("--eval-limit", type=int, default=None, help="eval.py --limit: first N validation problems")
    p.add_argument("--eval-tokens", type=int, default=None,
                   help="eval.py --max-response-tokens (default: the MuTIS cap); above the longest response a model "
                        "writes, the untrained model is measured whole")
    p.add_argument("--sampled-limit", type=int, default=None,
                   help="eval.py --limit for the sampled protocol only (it generates "
                        f"{SETTINGS['sampled']['samples_per_prompt']} samples per problem)")
    p.add_argument("--protocols", default="greedy,sampled",
                   help=f"eval.py --protocol of the final evaluations, comma-separated: {', '.join(PROTOCOLS)}")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--train-only", action="store_true", help="train the runs, no eval.py and no summary")
    mode.add_argument("--summarize", action="store_true", help="no training: eval.py and the summary over OUT")
    opts = p.parse_args(argv[:cut])
    opts.runs, opts.seeds = opts.runs.replace(",", " ").split(), opts.seeds.replace(",", " ").split()
    if unknown := [r for r in opts.runs if run_spec(r) is None]:
        die(f"--runs: unknown {', '.join(unknown)} (known: {', '.join(RUNS)}, length_penalty_C)")
    opts.protocols = list(dict.fromkeys(x for x in opts.protocols.replace(",", " ").split()))
    if not opts.protocols or (bad := [x for x in opts.protocols if x not in PROTOCOLS]):
        die(f"--protocols: expected {' and/or '.join(PROTOCOLS)}, got {bad[0] if opts.protocols else 'none'}")
    if opts.eval_tokens is not None and opts.eval_tokens < 1:
        die(f"--eval-tokens {opts.eval_tokens}: must be >= 1")
    if not all(s.isdigit() for s in opts.seeds) or not opts.seeds:
        die(f"--seeds: expected non-negative integers, got {' '.join(opts.seeds) or 'none'}")
    return opts, argv[cut + 1:]


def main(argv=None):
    opts, base = parse_args(sys.argv[1:] if argv is None else argv)
    ta, err = parse_train(base)
    if err:
        die(f"train.py arguments: {err}")
    if not ta.val_data or ta.max_turns < 1:
        die("train.py arguments need --val-data (every run validates on it) and --max-turns >= 1 (the MuTIS run)")
    import rollout
    from infra.hf import load_tokenizer
    from model import resolve_model
    ids = rollout.intervention_ids(load_tokenizer(resolve_model(ta.model)), ta.intervention_text)
    opts.intervention_tokens, T = len(ids), ta.turn_tokens
    cap = rollout.sample_kwargs(ta, ids)["max_response_tokens"]  # the longest MuTIS response
    out, notes, plan = Path(opts.out), [], []
    for name in opts.runs:
        extra = run_spec(name)[1](T, cap)
        _, err = parse_train(base + extra)
        if err:
            die(f"run {name}: train.py arguments: {err}")
        else:
            plan += [(name, int(s), base + extra) for s in opts.seeds]
    if not opts.summarize:
        for name, seed, args in plan:
            train_run(name, seed, args, out, opts.launcher)
    if not opts.train_only:
        summarize(out, ta, base, cap, T, opts, notes)


if __name__ == "__main__":
    main()
