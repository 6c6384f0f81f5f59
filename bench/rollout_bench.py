"""Rollout throughput, one run, ratios:

  1. multi-turn sampling (rollout.sample) vs one plain LLM.generate call producing the same number of tokens
     (same prompts x n, ignore_eos): the cost of the turn machinery (target: ratio >= 0.9). The plain call
     is timed twice: bare, and with the sampler's per-request features (per-sample seeds, log-probs).
  2. vLLM vs the transformers backend on the same multi-turn sampling;
  3. seconds for one sync_weights of the model (full weights into the running engine);
  plus engine start-up seconds (run once with and once without --enforce-eager to compare).

    python bench/rollout_bench.py --model smollm2 --data math500 --limit 8 --samples-per-prompt 2 [--enforce-eager]

Partial results go to stderr as they come; the last stdout line is the whole result as JSON.
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data  # noqa: E402
import rollout  # noqa: E402
from infra import engines  # noqa: E402
from infra.hf import load_causal_lm  # noqa: E402
from infra.system import choose_dtype, keep_freed_memory  # noqa: E402
from model import resolve_model


def log(res):
    print("[bench]", json.dumps(res), file=sys.stderr, flush=True)


def plain_generate(engine, rows, max_tokens, temperature, features):
    """One LLM.generate call; features=True adds what the sampler asks of every request: a seed, log-probs and
    the `</answer>` stop string (which needs detokenizing)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                             seed=1000 + i if features else None, logprobs=0 if features else None,
                             stop=["</answer>"] if features else None, include_stop_str_in_output=True,
                             detokenize=features) for i in range(len(rows))]
    t0 = time.perf_counter()
    outs = engine.llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="alias or HF model directory")
    p.add_argument("--data", default="math500", help="dataset name or path (prompts)")
    p.add_argument("--limit", type=int, default=8, help="prompts")
    p.add_argument("--samples-per-prompt", type=int, default=2, help="samples per prompt")
    p.add_argument("--turn-tokens", type=int, default=48, help="per-turn budget")
    p.add_argument("--max-turns", type=int, default=2, help="interventions")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--engine-dtype", default="auto", help="engine dtype (both backends): auto (system.choose_dtype) | bfloat16 | float32")
    p.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile")
    p.add_argument("--threads", type=int, default=None, help="torch threads (1 beats 2 on a busy 2-core box)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved timing repeats (median reported)")
    p.add_argument("--hf-limit", type=int, default=4, help="prompts for vLLM vs transformers (0 = skip; hf is slow)")
    p.add_argument("--glibc-default", action="store_true",
                   help="leave glibc's malloc as it is (no system.keep_freed_memory), for a before/after")
    args = p.parse_args()

    kept = not args.glibc_default and keep_freed_memory()
    path = resolve_model(args.model)
    args.engine_dtype = choose_dtype(args.engine_dtype)[0]  # both backends in the same dtype
    t0 = time.perf_counter()
    engine = engines.make_engine(path, dtype=args.engine_dtype, seed=0, enforce_eager=args.enforce_eager)
    init_s = time.perf_counter() - t0
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = engine.tokenizer
    prompts = [data.prompt_ids(tok, r["messages"]) for r in data.load_dataset(args.data, limit=args.limit)]
    kw = dict(n=args.samples_per_prompt, turn_tokens=args.turn_tokens, max_turns=args.max_turns, temperature=args.temperature,
              intervention_ids=rollout.intervention_ids(tok, "paper"), eos_ids=[tok.eos_token_id])
    rollout.sample(engine, prompts[:2], **{**kw, "turn_tokens": 8})  # warm-up: first calls are slow

    rows = [p for p in prompts for _ in range(args.samples_per_prompt)]
    full = (args.max_turns + 1) * args.turn_tokens  # tokens per row when nobody stops
    runs = {k: [] for k in ("mt_forced", "mt_natural", "plain", "plain_feat", "plain_natural")}
    for r in range(args.repeats):  # interleaved so that background load hits every variant alike
        # forced: no EOS, every sample runs all turns -> same batch shape as one plain call of `full` tokens;
        # the ratio is the cost of the turn machinery alone (3 calls, intervention prefill, bookkeeping)
        ro = rollout.sample(engine, prompts, seed=r, **{**kw, "eos_ids": []})
        runs["mt_forced"].append(ro.stats["decoded_tokens"] / ro.stats["seconds"])
        n_tok, s = plain_generate(engine, rows, full, args.temperature, features=False)
        runs["plain"].append(n_tok / s)
        n_tok, s = plain_generate(engine, rows, full, args.temperature, features=True)
        runs["plain_feat"].append(n_tok / s)
        # natural: EOS ends samples, later turns run smaller batches; plain call of the same token count
        ro = rollout.sample(engine, prompts, seed=r, **kw)
        runs["mt_natural"].append(ro.stats["decoded_tokens"] / ro.stats["seconds"])
        n_tok, s = plain_generate(engine, rows, max(1, round(ro.stats["decoded_tokens"] / len(rows))),
                                  args.temperature, features=True)
        runs["plain_natural"].append(n_tok / s)
    med = {k: statistics.median(v) for k, v in runs.items()}
    summary = rollout.rollout_summary(ro, ro.stats["seconds"])
    res = dict(model=Path(path).name, dtype=args.engine_dtype, enforce_eager=args.enforce_eager, freed_memory_kept=kept,
               threads=torch.get_num_threads(), block_size=engine.llm.llm_engine.vllm_config.cache_config.block_size,
               prompts=len(prompts), n=args.samples_per_prompt, turn_tokens=args.turn_tokens, max_turns=args.max_turns,
               engine_init_s=round(init_s, 1), **{f"{k}_tok_s": round(v, 1) for k, v in med.items()},
               ratio_machinery=round(statistics.median(m / f for m, f in zip(runs["mt_forced"], runs["plain_feat"])), 3),
               ratio_machinery_vs_bare=round(statistics.median(m / b for m, b in zip(runs["mt_forced"], runs["plain"])), 3),
               ratio_natural=round(statistics.median(m / p for m, p in zip(runs["mt_natural"], runs["plain_natural"])), 3),
               natural_mean_turns=summary["mean_turns"], natural_intervened=summary["intervened"],
               natural_finished=summary["finished"])
    log(res)

    # sync_weights: the model's full weights, as the trainer would send them after a step
    hf_model = load_causal_lm(path, dtype=getattr(torch, args.engine_dtype))
    named = [(k, v.detach()) for k, v in hf_model.named_parameters()]
    before = engine.generate(prompts[:4], 16, temperature=0)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        engine.sync_weights(named)
        times.append(time.perf_counter() - t0)
    after = engine.generate(prompts[:4], 16, temperature=0)
    res.update(sync_weights_s=round(statistics.median(times), 3),
               sync_same_weights_same_greedy=[o.token_ids for o in before] == [o.token_ids for o in after])
    log(res)
    del hf_model, named

    if args.hf_limit:  # the same multi-turn sampling on a few prompts, vLLM then transformers
        speed = {}
        for name, eng in (("vllm", engine), ("hf", engines.make_engine(path, kind="hf", dtype=args.engine_dtype, seed=0))):
            ro = rollout.sample(eng, prompts[:args.hf_limit], seed=0, **kw)
            speed[name] = ro.stats["decoded_tokens"] / ro.stats["seconds"]
        res.update(hf_prompts=args.hf_limit, vllm_small_tok_s=round(speed["vllm"], 1),
                   hf_small_tok_s=round(speed["hf"], 1), vllm_over_hf=round(speed["vllm"] / speed["hf"], 2))
    res["load_avg_1m"] = round(os.getloadavg()[0], 1)
    res["cpus"] = os.cpu_count()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
