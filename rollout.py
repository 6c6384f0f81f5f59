"""Rollouts: multi-turn intervention sampling on token ids, and the shared sampling flags.

    python rollout.py --model smollm2 --data math500 --limit 8 --samples-per-prompt 2 --max-turns 2 --turn-tokens 128 \
        --temperature 1.0 --seed 0 --out out/rollout.jsonl [--engine vllm|hf]
    torchrun --nproc_per_node 2 rollout.py ... --engine-tp 2     # one engine over two ranks (tensor parallel)

A turn generates at most `turn_tokens` and is cut right after its first complete answer (`answer_prefix`).
A turn with an answer ends the trajectory; an answerless one (budget hit or EOS: the reference rule,
`wants_intervention`) gets the intervention sentence appended and the model continues, at most `max_turns`
times (Zhao et al., "MuTIS", EMNLP 2025; the authors' mutis/llm_agent/generation.py). The result
is one trajectory per sample: response_ids = policy tokens and intervention tokens interleaved,
action_mask = 1 exactly on the policy's tokens. Everything stays on token ids: the model's tokens are
never decoded and re-tokenized between turns; the intervention is tokenized once, wrapped as
"\n\n<text>\n\n" so that it reads as its own paragraph even when the budget cut a word in half.

The engines (vLLM in-process, a transformers fallback) are infra/engines.py's.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from infra.cli import ArgumentParser, die, positive_int, write_atomic
from infra.collectives import RanksDisagree, gather_to_first, init_distributed
from infra.engines import RolloutTimeout, check_tensor_parallel, engine_from_flags
from infra.hf import load_tokenizer
from infra.repetition import repeated
from infra.system import choose_dtype, exit_without_teardown, keep_freed_memory, quiet_logs
from model import end_of_turn_ids, resolve_model
from reward import find_answer  # one answer detector for the turn rule and the reward

INTERVENTIONS = {
    "paper": "Warning! Your previous action is invalid. Please try again:",
    "reference": "My previous action is invalid. If I want to give the final answer, I should put the answer "
                 "between <answer> and </answer>. Let me try again:",
}
TURN_RULES = ("reference", "paper")  # see wants_intervention


class PromptTooLong(ValueError):
    """A prompt is longer than --max-prompt-length (and --truncate-prompts is off)."""


# ----------------------------------------------------------------------------- multi-turn sampling

def intervention_ids(tokenizer, text):
    """Token ids of the intervention: a INTERVENTIONS key or literal text, wrapped as its own paragraph."""
    text = INTERVENTIONS.get(text, text)
    return tokenizer.encode(f"\n\n{text}\n\n", add_special_tokens=False)


def prepare_prompts(prompt_ids, max_prompt_length=None, truncate=False):
    """Reject (PromptTooLong) or left-truncate prompts longer than max_prompt_length -> (prompts, n_truncated).
    Left truncation keeps the end of the prompt: the chat template's assistant header."""
    if not max_prompt_length:
        return [list(p) for p in prompt_ids], 0
    out, cut = [], 0
    for i, p in enumerate(prompt_ids):
        if len(p) > max_prompt_length:
            if not truncate:
                raise PromptTooLong(f"prompt {i} has {len(p)} tokens > --max-prompt-length {max_prompt_length} "
                                    f"(pass --truncate-prompts to left-truncate)")
            p, cut = p[-max_prompt_length:], cut + 1
        out.append(list(p))
    return out, cut


def tokenize_prompts(tokenizer, records, max_prompt_length=None, truncate=False):
    """data records -> (chat-templated prompt ids, how many were truncated), checked by prepare_prompts."""
    import data

    return prepare_prompts([data.prompt_ids(tokenizer, r["messages"]) for r in records], max_prompt_length, truncate)


def sample_seed(seed, prompt_index, sample_index, turn):
    """One seed per (prompt, sample, turn): reproducible for a fixed --seed, independent of batch and shard."""
    return int(np.random.SeedSequence([seed, prompt_index, sample_index, turn]).generate_state(1)[0] >> 1)


def wants_intervention(answered, hit_budget, rule="reference"):
    """The MuTIS turn rule: does a finished turn get the intervention (while turns remain)?

    A turn holding an explicit final answer ends the trajectory under every rule. An answerless turn:
      reference (default): is an invalid action whether it hit the per-turn budget or ended on EOS,
        and gets the intervention -- the authors' code (Zhao et al., EMNLP 2025; mutis/llm_agent/
        generation.py, execute_predictions_with_agent: every non-answer action is invalid);
      paper: gets it only when the per-turn budget cut it; an answerless EOS ends the trajectory
        (the paper's prose, which speaks of the budget case only).
    """
    if rule not in TURN_RULES:
        raise ValueError(f"turn rule must be one of {TURN_RULES}, got {rule!r}")
    return not answered and (hit_budget or rule == "reference")


def tokens_through(token_ids, decode, n_chars):
    """The shortest prefix of token_ids whose decoded text is at least n_chars long (its length in tokens)."""
    lo, hi = 0, len(token_ids)  # decoded length grows with the prefix: bisect for the first one reaching n_chars
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(token_ids[:mid])) >= n_chars:
            hi = mid
        else:
            lo = mid + 1
    return lo


def answer_prefix(token_ids, decode, cut_at_answer=True, eos=()):
    """(n_keep, answer): the turn's explicit answer (reward.find_answer, so the turn rule and the reward
    read answers alike) and how many of its tokens to keep. With cut_at_answer, as the reference cuts
    turns (mutis/llm_agent/generation.py, _postprocess_responses), n_keep is the shortest token prefix
    whose text holds the complete first answer: what follows (more reasoning, a second answer) never
    enters training. An end-of-turn id (`eos`) right after that prefix stays: the model stopped on its
    answer, and a policy never trained on that stop would run on to the budget when nothing cuts it
    (eval.py). Works on ids: the kept tokens are the model's own, never re-tokenized."""
    found = find_answer(decode(token_ids), first=cut_at_answer)
    if found is None or not cut_at_answer:
        return len(token_ids), found
    lo = max(1, tokens_through(token_ids, decode, found.end))
    while lo < len(token_ids) and find_answer(decode(token_ids[:lo]), first=True) != found:
        lo += 1  # a token boundary that decodes differently (merged spaces, split characters)
    if lo < len(token_ids) and token_ids[lo] in eos:
        lo += 1
    return lo, found


def loop_of(decoded_ids, last_turn_start, capped, decode):
    """repetition.repeated for a response: decoded_ids, every token the engine decoded into it (interventions in
    place, the cut tail of its last turn included); the first answer is looked for in the last turn only (earlier
    turns held none: they got interventions), so no intervention text is read as one."""
    last = decoded_ids[last_turn_start:]
    found = find_answer(decode(last), first=True) if capped else None
    at = None if found is None else last_turn_start + tokens_through(last, decode, found.close)
    return repeated(decoded_ids, capped, at)


def policy_text(response_ids, action_mask, decode):
    """The policy's own tokens, turn by turn, joined by a blank line: what is scored, so that no
    intervention text (whatever --intervention-text says) is ever read as the model's answer."""
    turns, run = [], []
    for token, is_action in zip(response_ids, action_mask):
        if is_action:
            run.append(token)
        elif run:
            turns.append(run)
            run = []
    return "\n\n".join(decode(ids) for ids in turns + [run] if ids)


class Rollout(list):
    """Trajectory dicts, prompt-major (prompt_index, then sample_index); .stats holds timing and counts."""
    stats = {}


def sample(engine, prompt_ids, *, n=1, turn_tokens, max_turns=0, max_response_tokens=None, temperature=1.0,
           top_p=1.0, seed=0, stop=(), turn_rule="reference", cut_at_answer=True, intervention_ids, eos_ids=None,
           timeout=None, prompt_indices=None, desc=None, poll=None):
    """Multi-turn intervention sampling. prompt_ids: list of id lists; prompt_indices: their global indices
    (for shards; default 0..len-1) -- seeds and `prompt_index` use them, so a shard reproduces its part of
    a single-engine run. Each turn sends every still-active sample in one engine call (prompt + response so
    far; the prefix cache spares recomputing earlier turns); `wants_intervention` decides what follows a
    turn, `answer_prefix` where it is cut. eos_ids: every end-of-turn id (all of them end a turn).
    desc: label of a transient progress bar over finished trajectories (None: no bar). poll: the engine calls it
    before every step, and whatever it raises stops the rollout there (train.py: a SIGTERM, faults.Guard.poll).

    Each trajectory: response_ids (kept policy tokens and interventions interleaved), action_mask (1 on the
    policy's tokens), rollout_logprobs, turns, interventions, answered (ended on an explicit answer),
    cut_turns (turns cut after their answer), finished (answered, or ended by the model under the paper
    rule), truncated (ran out of turns or room without an answer), hit_cap (a token limit cut its last turn before
    any answer: the turn budget, --max-response-tokens or the context), response_text (everything, for people)
    and policy_text (the policy's kept tokens only: what is scored, so no intervention is read as an answer).
    What the engine paid: decoded_tokens (every token it decoded, every turn, what a cut dropped included: the
    figure a user pays), turn_spans ([start in response_ids, tokens decoded] per turn), dropped_ids (the last
    turn's tokens after its cut), stopped (the model ended the last turn, not a token limit), repeated and
    repeated_after_answer (the engine ran into the limit in a loop: repetition.repeated, on the decoded tokens).
    """
    if turn_rule not in TURN_RULES:
        raise ValueError(f"turn_rule must be one of {TURN_RULES}, got {turn_rule!r}")
    if turn_tokens < 1 or max_turns < 0 or n < 1:
        raise ValueError("need turn_tokens >= 1, max_turns >= 0, n >= 1")
    iv = list(intervention_ids)
    eos = {engine.tokenizer.eos_token_id} if eos_ids is None else set(eos_ids)
    stop = list(stop) + (["</answer>"] if cut_at_answer and "</answer>" not in stop else [])  # ends a turn early
    decode = lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    indices = list(range(len(prompt_ids))) if prompt_indices is None else list(prompt_indices)
    max_resp = max_response_tokens or 2**62
    ctx = engine.max_model_len
    trajs = []
    for p, pi in zip(prompt_ids, indices):
        if len(p) >= ctx:
            raise PromptTooLong(f"prompt {pi} has {len(p)} tokens, no room left in max_model_len {ctx}")
        for j in range(n):
            trajs.append(dict(prompt_ids=list(p), response_ids=[], action_mask=[], rollout_logprobs=[], turns=0,
                              interventions=0, answered=False, cut_turns=0, finished=False, truncated=False, hit_cap=False,
                              turn_spans=[], dropped_ids=[], stopped=False, prompt_index=pi, sample_index=j))

    def room(t):  # tokens this trajectory may still add, under both caps
        return min(max_resp - len(t["response_ids"]), ctx - len(t["prompt_ids"]) - len(t["response_ids"]))

    def append(t, ids, logprobs, is_action):
        t["response_ids"] += ids
        t["action_mask"] += [int(is_action)] * len(ids)
        t["rollout_logprobs"] += logprobs if is_action else [0.0] * len(ids)

    active, t0, calls = list(trajs), time.perf_counter(), 0
    bar = tqdm(total=len(trajs), desc=desc, disable=desc is None, leave=False, unit="traj")
    for turn in range(max_turns + 1):
        if not active:
            break
        bar.set_postfix(turn=turn + 1)
        budgets = [min(turn_tokens, room(t)) for t in active]
        seeds = [sample_seed(seed, t["prompt_index"], t["sample_index"], turn) for t in active]
        outs = engine.generate([t["prompt_ids"] + t["response_ids"] for t in active], budgets,
                               temperature=temperature, top_p=top_p, seed=seeds, stop=stop,
                               eos_ids=sorted(eos), timeout=timeout, poll=poll)
        calls += 1
        still = []
        for t, c, budget in zip(active, outs, budgets):
            assert len(c.token_ids) <= budget, "engine exceeded max_tokens"
            keep, found = answer_prefix(c.token_ids, decode, cut_at_answer, eos)
            hit_budget = not c.stopped and budget == turn_tokens  # a smaller budget is a cap: no room to go on
            intervene = wants_intervention(found is not None, hit_budget, turn_rule)
            if intervene and c.stopped and c.token_ids and c.token_ids[-1] in eos:
                keep -= 1  # the EOS of an answerless turn is no action when the trajectory goes on
            t["turns"] += 1
            t["turn_spans"].append([len(t["response_ids"]), len(c.token_ids)])
            t["cut_turns"] += keep < len(c.token_ids) and found is not None
            t["answered"] = found is not None
            kept_room = room(t) - keep
            if intervene and t["interventions"] < max_turns and kept_room > len(iv):  # a token fits after it
                append(t, c.token_ids[:keep], c.logprobs[:keep], True)
                append(t, iv, None, False)
                t["interventions"] += 1
                still.append(t)
                continue
            if intervene:  # out of interventions or room: the turn keeps its EOS, as a last turn does
                keep = len(c.token_ids)
            append(t, c.token_ids[:keep], c.logprobs[:keep], True)
            t["dropped_ids"], t["stopped"] = list(c.token_ids[keep:]), bool(c.stopped)
            # answered, or stopped by the model without an answer under the paper rule; else cut by a cap
            t["finished"] = found is not None or (c.stopped and not intervene)
            t["truncated"] = not t["finished"]
            t["hit_cap"] = not c.stopped and found is None
        bar.update(len(active) - len(still))
        active = still
    bar.close()
    for t in trajs:
        t["response_text"] = decode(t["response_ids"])
        t["policy_text"] = policy_text(t["response_ids"], t["action_mask"], decode)
        t["decoded_tokens"] = sum(n for _, n in t["turn_spans"])
        loop = loop_of(t["response_ids"] + t["dropped_ids"], t["turn_spans"][-1][0], not t["stopped"], decode)
        t["repeated"], t["repeated_after_answer"] = loop is not None, loop == "after answer"
    rollout = Rollout(trajs)
    rollout.stats = dict(seconds=time.perf_counter() - t0, engine_calls=calls,
                         action_tokens=sum(sum(t["action_mask"]) for t in trajs),
                         decoded_tokens=sum(t["decoded_tokens"] for t in trajs))
    return rollout


def to_batch(rollout, pad_id):
    """Trainer tensors: prompts left-padded [B, P], responses right-padded [B, R] (R >= 1)."""
    B = len(rollout)
    P = max(len(t["prompt_ids"]) for t in rollout)
    R = max(1, max(len(t["response_ids"]) for t in rollout))
    batch = dict(prompt_ids=torch.full((B, P), pad_id, dtype=torch.long),
                 prompt_mask=torch.zeros(B, P, dtype=torch.long),
                 response_ids=torch.full((B, R), pad_id, dtype=torch.long),
                 response_mask=torch.zeros(B, R, dtype=torch.long),
                 action_mask=torch.zeros(B, R, dtype=torch.long),
                 rollout_logprobs=torch.zeros(B, R, dtype=torch.float32))
    for i, t in enumerate(rollout):
        p, r = len(t["prompt_ids"]), len(t["response_ids"])
        batch["prompt_ids"][i, P - p:] = torch.tensor(t["prompt_ids"], dtype=torch.long)
        batch["prompt_mask"][i, P - p:] = 1
        if r:
            batch["response_ids"][i, :r] = torch.tensor(t["response_ids"], dtype=torch.long)
            batch["response_mask"][i, :r] = 1
            batch["action_mask"][i, :r] = torch.tensor(t["action_mask"], dtype=torch.long)
            batch["rollout_logprobs"][i, :r] = torch.tensor(t["rollout_logprobs"], dtype=torch.float32)
    return batch


def shard_indices(num_prompts, rank, world_size):
    """Strided shard of prompt indices for this rank: disjoint, covering, balanced to within one."""
    return list(range(rank, num_prompts, world_size))


def group_shard(num_prompts, rank, world_size, tp=1):
    """(the prompts this rank's engine samples, the ones this rank keeps), as positions. The tp contiguous ranks of
    a tensor-parallel engine (--engine-tp) sample their shards together, then each keeps its own: a rank's
    trajectories do not depend on tp."""
    first = rank - rank % tp
    group = [i for r in range(first, first + tp) for i in shard_indices(num_prompts, r, world_size)]
    return group, shard_indices(num_prompts, rank, world_size)


def own_share(rollout, prompt_indices):
    """The trajectories of these prompt indices, in order: a tensor-parallel group's rollout -> this rank's share
    (.stats: the whole call's)."""
    wanted = set(prompt_indices)
    mine = Rollout(t for t in rollout if t["prompt_index"] in wanted)
    mine.stats = rollout.stats
    return mine


# ----------------------------------------------------------------------------- CLI

# per trajectory, summed by trajectory_sums (train.py's metrics average them): tokens decoded by the engine (every turn, a cut's dropped tail included:
# what a user pays), kept (the policy's tokens up to each cut: what is trained on), the interventions' tokens (the
# environment's, never decoded); turns; ended on an answer; ran into a token limit in a loop (infra/repetition.py)
TRAJECTORY_KEYS = ("decoded_tokens", "kept_tokens", "intervention_tokens", "turns", "answered", "repeated",
                   "repeated_after_answer")


def trajectory_sums(trajs):
    """TRAJECTORY_KEYS summed over rollout.sample's trajectories."""
    kept = [sum(t["action_mask"]) for t in trajs]
    return {"decoded_tokens": float(sum(t["decoded_tokens"] for t in trajs)), "kept_tokens": float(sum(kept)),
            "intervention_tokens": float(sum(len(t["response_ids"]) for t in trajs) - sum(kept)),
            **{k: float(sum(t[k] for t in trajs)) for k in ("turns", "answered", "repeated", "repeated_after_answer")}}


def rollout_summary(rollout, seconds):
    """The CLI's summary line: totals of TRAJECTORY_KEYS' tokens, per-trajectory means of the rest, decoded tokens/s."""
    sums, B = trajectory_sums(rollout), max(1, len(rollout))
    return dict(trajectories=len(rollout), seconds=round(seconds, 3),
                tokens_per_s=round(sums["decoded_tokens"] / max(seconds, 1e-9), 1),
                **{k: int(sums[k]) for k in ("decoded_tokens", "kept_tokens", "intervention_tokens")},
                mean_turns=round(sums["turns"] / B, 3), repeated=round(sums["repeated"] / B, 3),
                repeated_after_answer=round(sums["repeated_after_answer"] / B, 3),
                intervened=round(sum(t["interventions"] > 0 for t in rollout) / B, 3),
                finished=round(sum(t["finished"] for t in rollout) / B, 3))


def sampling_flags(**defaults):
    """The sampling and intervention flags of train.py, rollout.py and eval.py, defined once (an argparse
    parent): one name, one meaning and one check (check_sampling_args) in every CLI. defaults: the CLI's own
    where its job differs (eval.py samples greedily, single turn); each --help shows its CLI's values."""
    p = argparse.ArgumentParser(add_help=False)
    a = p.add_argument_group("sampling and interventions (shared by train.py, rollout.py, eval.py)").add_argument
    a("--system-prompt", default=None, help="eval | train | answer-line | none | literal text (default: %(default)s; "
                                            "None: the eval prompt for raw problems, parquet prompts as stored)")
    a("--samples-per-prompt", type=positive_int, default=1, help="samples per prompt (default: %(default)s)")
    a("--max-turns", type=int, default=3, help="interventions per response at most, 0 = single turn (default: %(default)s)")
    a("--turn-tokens", type=positive_int, default=1000, help="token budget of one turn (default: %(default)s)")
    a("--max-response-tokens", type=positive_int, default=None,
      help="cap on a whole response, all turns and interventions (default: %(default)s; None: every turn at full "
           "budget plus every intervention)")
    a("--turn-rule", choices=TURN_RULES, default="reference",
      help="reference: intervene on every answerless turn (the authors' code); paper: on budget cuts only")
    a("--no-cut-at-answer", dest="cut_at_answer", action="store_false",
      help="keep a turn's tokens after its first answer (scored on the last answer)")
    a("--intervention-text", default="reference", help="reference (the authors' code) | paper | literal text")
    a("--stop", action="append", default=[], help="stop string that ends a turn (repeatable), kept in the output")
    a("--temperature", type=float, default=1.0, help="sampling temperature, 0 = greedy (default: %(default)s)")
    a("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    a("--seed", type=int, default=0, help="base seed; per-sample seeds derive from it and the prompt index")
    a("--max-prompt-length", type=positive_int, default=None, help="longest prompt in tokens (default: %(default)s)")
    a("--truncate-prompts", action="store_true", help="left-truncate longer prompts instead of failing")
    a("--engine", choices=("vllm", "hf"), default="vllm", help="vllm, or transformers (hf) for debugging")
    a("--engine-dtype", default="auto", help="auto (bf16 on CUDA and on CPUs with avx512_bf16/amx_bf16, else "
                                             "float32; float32 for --engine hf) | bfloat16 | float32 | float16")
    a("--engine-tp", type=positive_int, default=1,
      help="ranks per vLLM engine (tensor parallel): K contiguous ranks share one engine and sample together; K "
           "must divide the number of ranks and the model's attention and KV heads (default: %(default)s)")
    a("--gpu-memory-utilization", type=float, default=0.5, help="vLLM share of GPU memory (default: %(default)s)")
    a("--enforce-eager", action="store_true", help="vLLM without compilation (faster start-up)")
    a("--attn-implementation", default="varlen", choices=["varlen", "sdpa", "flash_attention_2", "eager"],
      help="transformers attention of the trainer's packed micro-batches (varlen: torch's varlen flash kernel on CUDA, "
           "one causal SDPA per sequence elsewhere) and of --engine hf (varlen there means sdpa); flash_attention_2 "
           "needs flash-attn and CUDA")
    a("--rollout-timeout", type=float, default=None, help="seconds per engine call before failing")
    a("--verbose", action="store_true", help="show vLLM's and transformers' info logs")
    p.set_defaults(**defaults)
    return p


def sample_kwargs(args, intervention_ids, eos_ids=None, **overrides):
    """rollout.sample's keyword arguments from the shared flags (sampling_flags), for every caller; overrides: what
    a caller's job changes (validation is greedy, eval.py's budgets). With no --max-response-tokens the cap is the
    longest possible response: every turn at full budget plus every intervention."""
    cap = args.max_response_tokens or (args.max_turns + 1) * args.turn_tokens + args.max_turns * len(intervention_ids)
    return dict(dict(n=args.samples_per_prompt, turn_tokens=args.turn_tokens, max_turns=args.max_turns,
                     max_response_tokens=cap, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                     stop=args.stop, turn_rule=args.turn_rule, cut_at_answer=args.cut_at_answer,
                     intervention_ids=intervention_ids, eos_ids=eos_ids, timeout=args.rollout_timeout), **overrides)


def check_sampling_args(args):
    """The shared flags' one-line errors (cli.die), before any model loads (counts: cli.positive_int)."""
    if args.max_turns < 0:
        die(f"--max-turns must be >= 0, got {args.max_turns}")
    if args.temperature < 0:
        die(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        die(f"--top-p must be in (0, 1], got {args.top_p}")
    if not 0 < args.gpu_memory_utilization <= 1:
        die(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.rollout_timeout is not None and args.rollout_timeout <= 0:
        die(f"--rollout-timeout must be > 0, got {args.rollout_timeout}")
    if not args.intervention_text.strip():
        die("--intervention-text is empty")
    if args.engine_dtype not in ("auto", "bfloat16", "float32", "float16"):
        die(f"--engine-dtype must be auto, bfloat16, float32 or float16, got {args.engine_dtype!r}")
    if args.engine_tp > 1 and args.engine != "vllm":
        die(f"--engine-tp {args.engine_tp} needs --engine vllm (the transformers engine runs on one rank)")


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       parents=[sampling_flags()])
    p.add_argument("--model", default="smollm2", help="alias (smollm2), HF model directory or hub id")
    p.add_argument("--data", required=True, help="bundled dataset name or .jsonl/.json/.parquet path")
    p.add_argument("--limit", type=positive_int, default=None, help="use the first N records")
    p.add_argument("--max-model-len", type=positive_int, default=None, help="engine context length (default: model's)")
    p.add_argument("--out", required=True, help="output .jsonl, one trajectory per line")
    args = p.parse_args(argv)
    check_sampling_args(args)
    return args


def main(argv=None):
    args = parse_args(argv)
    quiet_logs(args.verbose)
    keep_freed_memory()
    import data

    model_path = resolve_model(args.model)
    try:
        records = data.load_dataset(args.data, system_prompt=args.system_prompt, limit=args.limit)
    except (data.DataError, OSError) as e:
        die(f"--data {args.data}: {e}")
    tokenizer = load_tokenizer(model_path)
    try:
        prompts, n_cut = tokenize_prompts(tokenizer, records, args.max_prompt_length, args.truncate_prompts)
    except PromptTooLong as e:
        die(f"--data {args.data}: {e}")
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    check_tensor_parallel(model_path, args.engine_tp, world)
    if world > 1:  # torchrun: each engine samples a shard, rank 0 writes them all
        init_distributed()
    args.engine_dtype, why = choose_dtype(args.engine_dtype, engine=args.engine)
    if rank == 0:
        print(f"[setup] {args.engine} engine dtype {args.engine_dtype} ({why})", file=sys.stderr, flush=True)
    engine = engine_from_flags(args, model_path, args.max_model_len, distributed=world > 1)
    group, mine = group_shard(len(prompts), rank, world, args.engine_tp)
    t0 = time.perf_counter()
    try:
        rollout = sample(engine, [prompts[i] for i in group], prompt_indices=group,
                         **sample_kwargs(args, intervention_ids(tokenizer, args.intervention_text),
                                         end_of_turn_ids(model_path, tokenizer)))
        seconds = time.perf_counter() - t0
        rollout = gather_to_first(own_share(rollout, mine), key=lambda t: (t["prompt_index"], t["sample_index"]))
    except (RolloutTimeout, PromptTooLong, RanksDisagree) as e:
        die(str(e))
    finally:
        engine.close()  # (under torchrun, vLLM's teardown also ends the process group)
    if rollout is None:  # not rank 0
        return
    rollout = Rollout(rollout)
    for t in rollout:
        t["id"] = records[t["prompt_index"]]["id"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, "".join(json.dumps(t) + "\n" for t in rollout))
    summary = dict(rollout_summary(rollout, seconds), prompts_truncated=n_cut, out=args.out)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
    exit_without_teardown()  # the outputs are written: skip the interpreter's 2-second teardown
