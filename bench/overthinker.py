"""An overthinking model in miniature: SmolLM2-135M-Instruct taught, by a short supervised warm start, to answer
the way R1-style reasoning models do -- the working, the answer reached, then redundant re-checks ("Wait, let me
double-check..."), some of which slip and turn a right answer into a wrong one, then the final answer line.

    python bench/overthinker.py --out models/overthinker          # `make overthinker`; the last line is the model
    python bench/overthinker.py --show 3                          # print three traces and their lengths

The problems are data.py's `overthink_train` (story problems of 2 or 3 events); the traces are written here,
deterministically from each problem's text and --seed, and the right answer is reached before any re-check.
The warm start is plain next-token cross-entropy on the response tokens (model.token_logprobs over packed
sequences, the trainer's own path), float32 weights under the trainer's bf16 autocast where the CPU has it.
Writes OUT/ (a Hugging Face model directory, bf16, with the tokenizer and overthinker.json: the recipe and the
loss curve) atomically: a stopped run leaves no OUT.
"""
import hashlib
import json
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import data  # noqa: E402
from infra.cli import ArgumentParser, die, positive_int  # noqa: E402

SYSTEM_PROMPT = "worked-steps"  # the story task's: the traces answer it, after re-checking it many times
EVENT_RES = ((re.compile(r"(\w+) buys (\d+) more\."), "buy"), (re.compile(r"(\w+) gives (\d+) away\."), "give"),
             (re.compile(r"Then the number of (\w+) doubles\."), "double"))
START_RE = re.compile(r"^(\w+) has (\d+) (\w+)\.")
# the re-checks, R1's habits in miniature; {steps}: the calculation again, {ans}: what it gives
RECHECKS = ("Wait, let me double-check. {steps}. Yes, {ans}.",
            "Hmm, let me re-read the problem to be sure. {story} {steps}. So it is {ans}.",
            "But wait, did I take the events in the right order? {steps}. Still {ans}.",
            "Let me verify once more, one step at a time. {long}. That gives {ans} again.",
            "Actually, let me make sure I did not miss anything. {steps}. I get {ans}.")
MAX_RECHECKS = len(RECHECKS)
SLIP_SHARE = 0.25  # traces whose last re-check slips: one result off by 1 or 2, carried to the final answer


def parse_story(problem):
    """A story problem's text -> (name, start, item, [(event, k)]), k None for a doubling; ValueError if not one."""
    m = START_RE.match(problem)
    if not m:
        raise ValueError(f"not a story problem: {problem!r}")
    found = sorted((e.start(), kind, e) for pattern, kind in EVENT_RES for e in pattern.finditer(problem))
    events = [(kind, None if kind == "double" else int(e[2])) for _, kind, e in found]
    return m[1], int(m[2]), m[3], events


def apply(count, event, k):
    return count + k if event == "buy" else count - k if event == "give" else 2 * count


def calculation(start, events, slip_at=None, slip=0):
    """(['5 + 3 = 8', ...], [8, ...]): each step and its result; step `slip_at` is off by `slip`, and the steps after
    it carry the error on."""
    lines, counts, count = [], [], start
    for i, (event, k) in enumerate(events):
        new = apply(count, event, k) + (slip if i == slip_at else 0)
        lines.append(f"{count} + {k} = {new}" if event == "buy" else f"{count} - {k} = {new}" if event == "give"
                     else f"{count} * 2 = {new}")
        counts.append(new)
        count = new
    return lines, counts


def trace(record, seed=0):
    """One overthinking response to a story problem -> {response, answer, final, rechecks, slipped, first_answer}:
    first_answer is the character where the working has stated the right answer (the end of its last '= N')."""
    name, start, item, events = parse_story(record["problem"])
    rng = random.Random(f"overthink-trace-{record['id']}-{seed}")
    lines, counts = calculation(start, events)
    ans = counts[-1]
    verbs = {"buy": "buys {k} more", "give": "gives {k} away", "double": "the number doubles"}
    working = [f"{name} starts with {start} {item}."]
    working += [f"{verbs[e].format(k=k).capitalize()}: {line}." for (e, k), line in zip(events, lines)]
    head = "\n".join(working)
    first_answer = len(head) - 1  # before the last line's full stop
    head += f"\nSo {name} has {ans} {item} now."
    story = f"{name} has {start} {item}, then " + ", then ".join(verbs[e].format(k=k) for e, k in events) + "."
    n = rng.randint(1, MAX_RECHECKS)
    order = rng.sample(RECHECKS, n)
    slipped = rng.random() < SLIP_SHARE
    paragraphs, final = [head], ans
    for i, template in enumerate(order):
        if slipped and i == n - 1:  # the slip: a step recomputed wrong, believed over the first working
            at = rng.randrange(len(events))
            offs = [d for d in (-2, -1, 1, 2) if min(calculation(start, events, at, d)[1]) >= 0]  # no count below 0
            got, slipped_counts = calculation(start, events, at, rng.choice(offs))
            final = slipped_counts[-1]
            paragraphs.append(f"Hmm, wait. {', '.join(got)}. So it is {final}, not {ans}. I made a mistake before.")
            break
        paragraphs.append(template.format(steps=", ".join(lines), long=". ".join(lines), ans=ans, story=story))
    paragraphs.append(f"Answer: {final}")
    return {"response": "\n\n".join(paragraphs), "answer": str(ans), "final": str(final), "rechecks": len(order),
            "slipped": slipped, "first_answer": first_answer}


# ----------------------------------------------------------------------------- the warm start

def examples(tok, records, seed, end_id):
    """Trajectories the trainer's batch layout takes (rollout.to_batch): the chat prompt, the trace and the end of
    the turn, every response token trained."""
    out = []
    for rec in records:
        response = tok.encode(trace(rec, seed)["response"], add_special_tokens=False) + [end_id]
        out.append({"prompt_ids": data.prompt_ids(tok, rec["messages"]), "response_ids": response,
                    "action_mask": [1] * len(response), "rollout_logprobs": [0.0] * len(response)})
    return out


def recipe_of(model_path, steps, batch_size, lr, seed, dtype, limit):
    """What decides the overthinker: the flags and a digest of every trace (a changed generator is a new recipe)."""
    records = data.load_dataset("overthink_train", SYSTEM_PROMPT, limit)
    digest = hashlib.sha256("\0".join(trace(r, seed)["response"] for r in records).encode()).hexdigest()
    return {"base": str(model_path), "data": "overthink_train", "system_prompt": SYSTEM_PROMPT, "seed": seed,
            "steps": steps, "batch_size": batch_size, "lr": lr, "dtype": dtype, "traces": len(records),
            "traces_sha256": digest}


def built(out, recipe):
    """True when `out` holds an overthinker of this recipe (the warm start is then skipped)."""
    try:
        done = json.loads((Path(out) / "overthinker.json").read_text())
    except (OSError, ValueError):
        return False
    return {k: done.get(k) for k in recipe} == recipe and (Path(out) / "model.safetensors").exists()


def warm_start(model_path, out, steps, batch_size, lr, seed=0, dtype="auto", limit=None, log=print):
    """Fine-tune `model_path` on overthinking traces of overthink_train for `steps` steps -> the loss per step.
    Writes the model to `out` atomically (a sibling temporary directory, renamed), with overthinker.json: the
    recipe (recipe_of), the seconds and the losses."""
    import torch
    from tqdm import tqdm

    import model as model_lib
    import rollout
    from infra import hf, packing, system

    torch.manual_seed(seed)
    recipe = recipe_of(model_path, steps, batch_size, lr, seed, dtype, limit)
    tok = hf.load_tokenizer(model_path)
    net = hf.load_causal_lm(model_path, dtype=torch.float32, attn_implementation=packing.VARLEN)  # packed rows
    dtype, why = system.choose_dtype(dtype, torch.device("cpu"))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    records = data.load_dataset("overthink_train", SYSTEM_PROMPT, limit)
    end_id = model_lib.end_of_turn_ids(model_path, tok)[0]
    t0 = time.time()
    train = examples(tok, records, seed, end_id)
    log(f"[overthinker] {len(train)} traces ({time.time() - t0:.1f}s); {dtype} ({why}); {steps} steps of "
        f"{batch_size}, lr {lr:g}")
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    order, losses, t0 = [], [], time.time()
    rng = random.Random(seed)
    net.train()
    for _ in tqdm(range(steps), desc="warm start", unit="step", disable=None):
        if len(order) < batch_size:  # a fresh pass over the traces, shuffled
            order += rng.sample(range(len(train)), len(train))
        rows, order = order[:batch_size], order[batch_size:]
        batch = rollout.to_batch([train[i] for i in rows], tok.pad_token_id)
        mb = packing.pack(batch, torch.arange(len(rows)), "cpu")
        with autocast:
            logp = model_lib.token_logprobs(net, mb)                        # [b, r]
        mask = mb["response_mask"].float()                                  # [b, r]
        loss = -(logp * mask).sum() / mask.sum()                            # mean over response tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 4))
    took = time.time() - t0
    log(f"[overthinker] loss {losses[0]:.3f} -> {losses[-1]:.3f} (mean of the last 5: "
        f"{sum(losses[-5:]) / len(losses[-5:]):.3f}) in {took:.0f}s")
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        net.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        done = {**recipe, "compute_dtype": dtype, "seconds": round(took, 1), "loss": losses}
        (tmp / "overthinker.json").write_text(json.dumps(done, indent=1) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return losses


def main(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="the model to warm-start (default: the embedded SmolLM2)")
    p.add_argument("--out", default=None, help="where the overthinker goes (a directory; replaced)")
    p.add_argument("--steps", type=positive_int, default=24, help="optimiser steps")
    p.add_argument("--batch-size", type=positive_int, default=16, help="traces per step")
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (linear warm-up over a tenth)")
    p.add_argument("--seed", type=int, default=0, help="the traces' and the shuffle's seed")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="compute dtype (auto: bf16 where the CPU has it natively)")
    p.add_argument("--limit", type=positive_int, default=None, help="use only the first N problems")
    p.add_argument("--show", type=positive_int, default=None, metavar="N", help="print N traces and stop")
    args = p.parse_args(argv)
    if args.show:
        for rec in data.load_dataset("overthink_train", SYSTEM_PROMPT, args.show):
            t = trace(rec, args.seed)
            print(f"--- {rec['id']}: {rec['problem']}\n{t['response']}\n({t['rechecks']} re-checks, "
                  f"slipped: {t['slipped']}, answer {t['answer']}, final {t['final']})")
        return
    if args.out is None:
        die("--out: give the directory the overthinker goes to (or --show N)")
    if args.lr <= 0:
        die(f"--lr {args.lr}: must be > 0")
    out = Path(args.out)
    if out.exists() and not (out / "overthinker.json").exists() and (not out.is_dir() or any(out.iterdir())):
        die(f"--out {out} holds something else than an overthinker (no overthinker.json): give another --out")
    from infra.system import quiet_logs
    from model import resolve_model

    quiet_logs()
    path = resolve_model(args.model)
    recipe = recipe_of(path, args.steps, args.batch_size, args.lr, args.seed, args.dtype, args.limit)
    if built(args.out, recipe):
        print(f"[overthinker] {args.out} holds this recipe's model already (its overthinker.json)")
    else:
        warm_start(path, args.out, args.steps, args.batch_size, args.lr, args.seed, args.dtype, args.limit)
    print(Path(args.out).resolve())


if __name__ == "__main__":
    main()
