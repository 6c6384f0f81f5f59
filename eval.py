"""Benchmark evaluation: accuracy and token efficiency of checkpoints, side by side.

    python eval.py runs/demo/step_000012 --benchmarks math500,gsm8k --limit 50 --out runs/eval
    torchrun --nproc_per_node 8 eval.py CKPT ...     # each rank a shard of the problems, its own engine
    python eval.py --score generations.parquet      # score existing generations, no model

CKPT is the `smollm2` alias, a Hugging Face directory, or a training checkpoint directory (with an `actor/`
subfolder). The default is the MuTIS authors' evaluation (their eval/eval.sh and eval/eval.py): greedy (temperature
0, top-p 1), single turn, a 32768-token response cap (clamped to the context window minus the longest prompt, with
a line saying so), the system prompt `Please reason step by step, ... \boxed{}.`, the last answer scored, and their
budget sweep (REFERENCE_BUDGETS up to the cap). `--max-turns K` evaluates with interventions; `--protocol sampled`
as the efficient-reasoning tables do (temperature 0.6, top-p 0.95, mean@16). Generation goes through rollout.py
(vLLM, or `--engine hf`), every sample in one engine call per turn; scoring through reward.py; repeated responses
are infra/repetition.py's. Writes DIR/samples.jsonl, DIR/summary.json, DIR/summary.md, DIR/budget.png and DIR/journal/
(eval_journal.py: every finished request, so that a rerun with the same arguments continues a stopped evaluation).
Checkpoints of one architecture share one engine: the next one's weights go in through engine.sync_weights.

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
--score files carry no token ids: --budgets is ignored there, and `repeated` is unknown.
"""
import argparse
import gc
import json
import sys
import time
from pathlib import Path

import eval_setup
from data import DataError, read_rows
from eval_report import summarize, versions, write_outputs
from infra import first_correct
from infra.cli import ArgumentParser, deprecated, die, positive_int, write_atomic

DEFAULT_BENCHMARKS = "math500,aime24,amc23,minerva,olympiadbench"  # the paper's five
RESPONSE_COLS = ("response", "responses", "response_text")
GOLD_COLS = ("ground_truth", "answer", "reward_model.ground_truth", "gold")


# ----------------------------------------------------------------------------- generation

def generate(engine, tokenizer, records, args, desc=None, prompts=None, journal=None, indices=None):
    """Roll out the records at `indices` (default: all; n samples each) -> unscored sample dicts, in record order.

    Every sample goes to the engine in one call per turn (journal.Journaled: requests the journal already holds are
    replayed, the others recorded as they finish; at most --max-in-flight in the engine at once); desc: label of a
    progress bar over finished requests (one per sample and turn)."""
    from tqdm import tqdm

    import rollout
    from eval_journal import Journal, Journaled
    from model import end_of_turn_ids

    eos_ids = end_of_turn_ids(tokenizer.name_or_path, tokenizer)
    gen_tokens = max([args.max_response_tokens] + args.budgets)
    if prompts is None:  # main tokenizes once, before any engine starts
        prompts = tokenize(tokenizer, records, args)
    indices = list(range(len(records))) if indices is None else list(indices)
    bar = tqdm(total=0, desc=desc, disable=desc is None, unit="sample", file=sys.stderr)

    def grow(n):  # a multi-turn call adds its requests to the bar
        bar.total += n
        bar.refresh()

    wrapped = Journaled(engine, journal or Journal(None, "", 0, {}), getattr(args, "max_in_flight", None),
                        on_request=bar.update, on_call=grow)
    # per-sample seeds derive from (seed, record index): a sample does not depend on the shard or the batch (the
    # batch's bf16 arithmetic still may: a near tie can break either way)
    trajs = rollout.sample(wrapped, [prompts[i] for i in indices], prompt_indices=indices, **rollout.sample_kwargs(
        args, rollout.intervention_ids(tokenizer, args.intervention_text), eos_ids,
        turn_tokens=args.turn_tokens if args.max_turns else gen_tokens, max_response_tokens=gen_tokens,
        cut_at_answer=cuts(args)))
    bar.close()
    samples = []
    for t in trajs:
        rec = records[t["prompt_index"]]
        samples.append({
            "benchmark": rec["_benchmark"], "data_source": rec["data_source"], "id": rec["id"],
            "sample": t["sample_index"],
            "problem": rec["problem"], "gold": rec["ground_truth"], "response_ids": list(t["response_ids"]),
            "_index": t["prompt_index"],
            "_full_text": t["policy_text"],
            "_truncated": bool(t["hit_cap"]),  # the token cap cut it before any answer (not: ended without one)
            "_action_mask": list(t["action_mask"]),
            "_turns": int(t["turns"]),
            "_spans": t["turn_spans"], "_dropped": list(t["dropped_ids"]), "_stopped": bool(t["stopped"])})
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


def at_limit(s, limit, tokenizer, first):
    """The sample as a `limit`-token generation would have left it: dict(text: the policy text scored, end: how many
    of response_ids it keeps, decoded: tokens the engine decoded, truncated, turns, loop: repetition.repeated).
    The engine's timeline is response_ids then the tail its last turn's cut dropped; `first`: turns are cut at
    their first answer (cuts)."""
    import rollout

    ids, mask, spans = s["response_ids"], s["_action_mask"], s["_spans"]
    timeline = ids + s["_dropped"]
    decode = lambda x: tokenizer.decode(x, skip_special_tokens=True)  # noqa: E731
    decoded = sum(min(n, max(0, limit - start)) for start, n in spans)  # each turn as far as the limit let it go
    if len(timeline) <= limit:  # ended before the limit: identical to the full generation
        return dict(text=s["_full_text"], end=len(ids), decoded=decoded, truncated=s["_truncated"], turns=s["_turns"],
                    loop=rollout.loop_of(timeline, spans[-1][0], not s["_stopped"], decode))
    if limit >= len(ids):  # the limit falls in the dropped tail: that run answered alike and decoded on to the limit
        return dict(text=s["_full_text"], end=len(ids), decoded=decoded, truncated=False, turns=s["_turns"],
                    loop=rollout.loop_of(timeline[:limit], spans[-1][0], True, decode))
    # rollout.py appends an intervention only if a policy token still fits after it: a cut inside
    # (or right after) an intervention means that run stopped before it
    end = limit
    while end > 0 and not mask[end - 1]:
        end -= 1
    turns = 1 + sum(1 for j in range(1, end) if not mask[j] and mask[j - 1])  # interventions opened so far
    text = rollout.policy_text(ids[:end], mask[:end], decode)
    last = max(start for start, _ in spans if start <= max(end - 1, 0))
    return dict(text=text, end=end, decoded=decoded, turns=turns,
                truncated=rollout.find_answer(decode(ids[last:end]), first=first) is None,
                loop=rollout.loop_of(ids[:end], last, True, decode))


def score_generated(samples, args, tokenizer):
    """Fill pred/correct/... at --max-response-tokens and budget_correct at each budget, in one score_batch call."""
    import rollout
    from reward import score_batch

    decode = lambda x: tokenizer.decode(x, skip_special_tokens=True)  # noqa: E731
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
            texts.append(at_limit(s, lim, tokenizer, cuts(args))["text"])
            owner.append(i)
    results = score_batch([samples[i]["data_source"] for i in owner], texts, [samples[i]["gold"] for i in owner],
                          first=cuts(args))
    for i, s in enumerate(samples):
        at = at_limit(s, args.max_response_tokens, tokenizer, cuts(args))
        r = results[job[i, args.max_response_tokens]]
        timeline = (s["response_ids"] + s["_dropped"])[:args.max_response_tokens]
        shown = decode(timeline)  # with interventions and what a cut dropped
        kept = sum(s["_action_mask"][:at["end"]])
        reached = first_correct.first_correct_end(shown, s["gold"])  # a character offset into shown, or None
        s.update(response_text=shown, pred=r["pred"], correct=bool(r["acc"]), has_answer=bool(r["has_answer"]),
                 decoded_tokens=at["decoded"], kept_tokens=kept, intervention_tokens=at["end"] - kept,
                 truncated=at["truncated"],
                 first_correct_tokens=None if reached is None else rollout.tokens_through(timeline, decode, reached),
                 repeated=at["loop"] is not None, repeated_after_answer=at["loop"] == "after answer", turns=at["turns"],
                 budget_correct={str(b): bool(results[job[i, b]]["acc"]) for b in args.budgets})
        for key in [k for k in s if k.startswith("_") and k != "_index"]:  # _index: main's sort, then dropped
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
                    from infra.hf import load_tokenizer
                    from model import resolve_model
                    tokenizer = load_tokenizer(resolve_model(tokenizer_spec))
                counts[j] = len(tokenizer.encode(text, add_special_tokens=False))
            samples.append({
                "checkpoint": str(row.get("checkpoint") or Path(path).stem), "benchmark": str(row.get("benchmark") or source),
                "id": str(row.get("id", i)), "sample": j, "problem": row.get("problem", row.get("prompt")),
                "response_text": text, "gold": gold, "decoded_tokens": int(counts[j]),
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


# ----------------------------------------------------------------------------- main

# The two protocols efficient-reasoning papers report: greedy (MuTIS: the authors' eval/eval.sh and eval/eval.py) and
# sampled mean@k (DeepSeek-R1's eval setting, used by AdaptThink, DLER, LC-R1, ThinkPrune; DLER and DOT report k of
# 16 to 32: 16 here, the cheaper end, whose mean@16 already has a quarter of one sample's variance per problem).
PROTOCOLS = {"greedy": {"temperature": 0.0, "top_p": 1.0, "samples_per_prompt": 1},
             "sampled": {"temperature": 0.6, "top_p": 0.95, "samples_per_prompt": 16}}
# The reference's response cap (eval/eval.sh: max_tokens 32768) and the budgets it sweeps, the cap last
REFERENCE_CAP = 32768
REFERENCE_BUDGETS = (200, 400, 600, 800, 1000, 1200, 1600, 2000, 2400, 2800, 3200, 3600, 4000, 4500, 32768)


def given(argv, flag):
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def parse_args(argv=None):
    import rollout  # the sampling flags are rollout.py's, shared with train.py

    # the reference's evaluation unless asked: greedy, single turn, 32768 response tokens, the budget sweep
    shared = rollout.sampling_flags(temperature=0.0, max_turns=0, max_response_tokens=REFERENCE_CAP,
                                    system_prompt="eval")
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, parents=[shared])
    p.add_argument("checkpoints", nargs="*", metavar="CKPT",
                   help="'smollm2', a HF directory or hub id, or a training checkpoint")
    p.add_argument("--score", metavar="FILE", help="score existing generations (.parquet/.jsonl) instead of generating")
    p.add_argument("--benchmarks", default=DEFAULT_BENCHMARKS, help="comma-separated benchmark names or dataset paths")
    p.add_argument("--budgets", default="reference",
                   help="token limits of the budget sweep: reference (the reference's list up to the response cap, "
                        "which ends it), none, or comma-separated integers (default: %(default)s)")
    p.add_argument("--limit", type=positive_int, default=None, help="first N problems of each benchmark")
    p.add_argument("--max-in-flight", type=positive_int, default=None,
                   help="requests in the engine at once, the next sent as one finishes (default: all for vllm, whose "
                        "scheduler runs what fits and queues the rest; 64 for hf, which pads them into one batch)")
    for old in ("--engine-batch", "--batch-size"):
        p.add_argument(old, dest="max_in_flight", type=positive_int, help=argparse.SUPPRESS,
                       action=deprecated(old, "--max-in-flight"))
    p.add_argument("--tokenizer", default="smollm2", help="--score: counts tokens when the file has no num_tokens")
    p.add_argument("--out", default=None, help="output directory (default runs/eval-TIMESTAMP); a rerun with the same "
                                               "arguments and --out continues a stopped evaluation")
    p.add_argument("--overwrite", action="store_true", help="replace what --out holds (its journal and outputs) "
                                                            "instead of continuing from it")
    p.add_argument("--batch-invariant", action="store_true",
                   help="vLLM's batch-invariant kernels (CUDA; slower): a sample does not depend on which requests share "
                        "its batch, so N ranks write what one process writes in any dtype")
    p.add_argument("--protocol", choices=PROTOCOLS, default="greedy",
                   help="greedy: one greedy sample per problem (the paper's); sampled: temperature 0.6, top-p 0.95, "
                        "mean accuracy over 16 samples per problem (the efficient-reasoning tables); --temperature, "
                        "--top-p and --samples-per-prompt given explicitly win")
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = p.parse_args(argv)
    for key, value in PROTOCOLS[args.protocol].items():
        if not given(argv, "--" + key.replace("_", "-")):
            setattr(args, key, value)
    rollout.check_sampling_args(args)
    args.cap_given = given(argv, "--max-response-tokens")  # an explicit cap is never clamped
    if args.budgets in ("reference", "none"):
        args.sweep, args.budgets = args.budgets, []  # reference: filled in once the cap is known
    else:
        args.sweep = "list"
        try:
            args.budgets = sorted({int(b) for b in args.budgets.split(",") if b.strip()})
        except ValueError:
            die(f"--budgets {args.budgets!r}: expected reference, none or comma-separated integers")
        if args.budgets and args.budgets[0] < 1:
            die(f"--budgets: token budgets must be >= 1, got {args.budgets[0]}")
    return args


def context_cap(args, prepared, say):
    """The response cap: --max-response-tokens, the default clamped to the smallest context window minus the longest
    prompt (one line says so); an explicit cap or budget that does not fit dies. Fills the reference budgets."""
    room = {name: (limit - longest, limit, longest) for name, (_, _, longest, limit) in prepared.items() if limit}
    name, (fits, limit, longest) = min(room.items(), key=lambda kv: kv[1][0]) if room else (None, (None, 0, 0))
    if fits is not None and fits < 1:
        die(f"--benchmarks: the longest prompt ({longest} tokens) fills the context of {name} ({limit})")
    if fits is not None and args.max_response_tokens > fits and not args.cap_given:
        say(f"note: response cap {args.max_response_tokens} clamped to {fits} tokens: the context of {name} ({limit}) "
            f"minus the longest prompt ({longest})")
        args.max_response_tokens = fits
    if args.sweep == "reference":
        args.budgets = sorted({b for b in REFERENCE_BUDGETS if b < args.max_response_tokens} | {args.max_response_tokens})
    gen_tokens = max([args.max_response_tokens] + args.budgets)
    if fits is not None and gen_tokens > fits:
        die(f"--max-response-tokens/--budgets: longest prompt ({longest}) + response ({gen_tokens}) tokens exceed "
            f"the context of {name} ({limit})")
    return gen_tokens



def prompts_of(path, records, args):
    """(tokenizer, prompt ids, longest prompt, context window) of one checkpoint, before any engine starts."""
    from infra import engines
    from infra.hf import load_tokenizer

    tokenizer = load_tokenizer(path)
    prompts = tokenize(tokenizer, records, args)
    return tokenizer, prompts, max(len(p) for p in prompts), engines.context_length(path)


def run_engine(ev, names):
    """One engine for checkpoints of one architecture: the first one's weights load with it, each next one's go in
    through the weight sync the trainer uses; each checkpoint's samples are generated, then scored."""
    from infra import engines

    t = time.time()
    engine = engines.engine_from_flags(ev.args, ev.paths[names[0]],
                                       max(ev.prepared[n][2] for n in names) + ev.gen_tokens, distributed=ev.world > 1)
    ev.timings["engines"][names[0]] = {"checkpoints": names, "start_s": round(time.time() - t, 2)}
    try:
        for name in names:
            tm = ev.timings["checkpoints"][name] = {}
            t = time.time()
            if name != names[0]:
                try:
                    engine.sync_weights(eval_setup.checkpoint_tensors(ev.paths[name]))
                except engines.SyncIncomplete as e:  # (one checkpoint's tensors never stand in for another's)
                    die(f"checkpoint {name}: {e}")
                tm["load_weights_s"] = round(time.time() - t, 2)
            evaluate(ev, engine, name)
    finally:
        engine.close()  # frees its memory before the next engine (under torchrun: ends the process group too)
    gc.collect()


def evaluate(ev, engine, name):
    """One checkpoint on this rank's shard: generated (journaled), each rank scoring its own problems, the scored
    samples gathered on rank 0 in problem order."""
    from infra.collectives import RanksDisagree, gather_to_first

    tokenizer, prompts = ev.prepared[name][:2]
    t = time.time()
    try:
        done = generate(engine, tokenizer, ev.records, ev.args, desc=f"generate {name}" if ev.rank == 0 else None,
                        prompts=prompts, journal=ev.journals[name], indices=ev.shard)
    except RanksDisagree as e:
        die(f"checkpoint {name}: {e}")
    finally:
        ev.journals[name].close()
    done = [s for s in done if s["_index"] in ev.own]
    scored = gather_to_first(score_generated(done, ev.args, tokenizer), key=lambda s: (s["_index"], s["sample"]))
    gen_s = time.time() - t
    if ev.rank == 0:
        ev.samples[name] = [{"checkpoint": name, **s} for s in scored]
        tokens = sum(s["decoded_tokens"] for s in scored)
        ev.timings["checkpoints"][name].update(
            generate_and_score_s=round(gen_s, 2), tokens=tokens, problems_per_min=round(len(ev.records) / (gen_s / 60), 2),
            tokens_per_s=round(tokens / gen_s, 1))


def main(argv=None):
    args = parse_args(argv)
    from infra.system import freeze_imports, keep_freed_memory, quiet_logs

    quiet_logs(args.verbose)
    if args.score:
        return score_file(args)
    keep_freed_memory()
    if not args.checkpoints:
        die("give at least one checkpoint (or --score FILE)")
    if len(set(args.checkpoints)) < len(args.checkpoints):
        die("a checkpoint is given twice")
    ev = eval_setup.start(args)  # every flag and input checked, checkpoints verified, --out claimed; no model yet
    freeze_imports()
    ev.prepared = {name: prompts_of(path, ev.records, args) for name, path in ev.paths.items()}
    ev.gen_tokens = context_cap(args, ev.prepared, ev.say)  # the response cap and the budgets, within every context
    eval_setup.plan_engines(ev)  # checkpoints sharing an engine, a journal each, this rank's shard of the problems
    for names in ev.groups.values():
        run_engine(ev, names)
    if ev.world > 1:
        from infra.collectives import close_distributed

        close_distributed()  # (the hf engine's group; vLLM's shutdown already ended it)
    if ev.rank == 0:
        report(ev)


def report(ev):
    """samples.jsonl, summary.json, summary.md and budget.png in --out, then the timings."""
    args = ev.args
    samples = [s for name in ev.paths for s in ev.samples[name]]
    for s in samples:
        del s["_index"]
    timings = ev.timings
    summary = {"models": ev.paths, "benchmarks": ev.benches, "args": vars(args), "versions": versions(),
               "seed": args.seed, "generated_tokens": ev.gen_tokens, "ranks": ev.world,
               "results": summarize(samples, args.budgets, args.max_turns > 0), "timings": timings}
    t = time.time()
    write_outputs(ev.out, ("samples.jsonl", "summary.json", "summary.md"), samples, summary, args.budgets)
    timings.update(write_s=round(time.time() - t, 2), total_s=round(time.time() - ev.t0, 2))
    write_atomic(ev.out / "summary.json", json.dumps(summary, indent=2, ensure_ascii=False) + "\n")  # with write_s
    print(f"timings: load {timings['load_s']}s, write {timings['write_s']}s, total {timings['total_s']}s")
    for first, e in timings["engines"].items():
        print(f"  engine start {e['start_s']}s for {', '.join(e['checkpoints'])}")
    for name, tm in timings["checkpoints"].items():
        swap = f"weights loaded {tm['load_weights_s']}s, " if "load_weights_s" in tm else ""
        print(f"  {name}: {swap}generate and score {tm['generate_and_score_s']}s "
              f"({tm['problems_per_min']} problems/min, {tm['tokens_per_s']} tokens/s)")


if __name__ == "__main__":
    main()
    from infra.system import exit_without_teardown

    exit_without_teardown()  # the outputs are written: skip the interpreter's 2-second teardown
