"""eval.py's generation time against one plain vLLM `LLM.generate` over the same prompts on the same engine.

    python bench/eval_bench.py --model smollm2 --data gsm8k --limit 128 --max-response-tokens 256 --repeats 2

Three ways to generate the same greedy responses, each timed on one engine after an untimed plain run (kernels for
every batch shape made), its prefix cache reset before each run, the runs interleaved (ABC, CBA, ...); reported: the
median seconds over --repeats and the median of each round's ratio (robust to a machine whose load changes):
  plain   one LLM.generate call with every prompt: temperature 0, max_tokens the cap, stop at the end-of-turn ids,
          no log-probs, no detokenizing (the least any script could ask of vLLM)
  eval    eval.generate, what eval.py runs: every sample in one engine call, each finished one appended and fsync'ed
          to the journal (eval_journal.py) and counted by the progress bar
  before  eval.py until 2026-12-05: rollout.sample over 64 problems per engine call (--engine-batch), log-probs on:
          each call waits for its longest response while the rest of the batch slot stays empty
Target: plain / eval >= 0.95. Also checks that eval's tokens are plain's, and reports each way's process CPU seconds.
The last stdout line is the result as JSON.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data  # noqa: E402
import eval as ev  # noqa: E402
import rollout  # noqa: E402
from eval_journal import Journal  # noqa: E402
from infra import engines  # noqa: E402
from infra.hf import load_tokenizer  # noqa: E402
from infra.system import keep_freed_memory, quiet_logs  # noqa: E402
from model import end_of_turn_ids, resolve_model

OLD_BATCH = 64  # the old --engine-batch default


def plain(engine, prompts, cap, eos):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=cap, stop_token_ids=eos, detokenize=False)
    outs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def via_eval(engine, tokenizer, records, prompts, args):
    with tempfile.TemporaryDirectory() as d:
        journal = Journal(Path(d), "bench", 0, {})
        samples = ev.generate(engine, tokenizer, records, args, prompts=prompts, journal=journal)
        journal.close()
    return [s["response_ids"] for s in samples]


def before(engine, tokenizer, prompts, args, eos):
    """The old eval.generate's engine calls: one rollout.sample per 64 problems."""
    out = []
    kwargs = rollout.sample_kwargs(args, rollout.intervention_ids(tokenizer, args.intervention_text), eos,
                                   turn_tokens=args.max_response_tokens, cut_at_answer=False)
    for start in range(0, len(prompts), OLD_BATCH):
        chunk = prompts[start:start + OLD_BATCH]
        out += [t["response_ids"] for t in rollout.sample(engine, chunk, prompt_indices=range(start, start + len(chunk)),
                                                          **kwargs)]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="alias or HF model directory")
    p.add_argument("--data", default="gsm8k", help="benchmark (prompts)")
    p.add_argument("--limit", type=int, default=128, help="problems")
    p.add_argument("--max-response-tokens", type=int, default=256, help="response cap")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each way")
    p.add_argument("--engine-dtype", default="auto")
    p.add_argument("--skip-before", action="store_true", help="time plain and eval only")
    opts = p.parse_args()
    quiet_logs()
    keep_freed_memory()
    path = resolve_model(opts.model)
    tokenizer = load_tokenizer(path)
    eos = end_of_turn_ids(path, tokenizer)
    records = [{**r, "_benchmark": opts.data} for r in data.load_dataset(opts.data, "eval", opts.limit)]
    prompts = [data.prompt_ids(tokenizer, r["messages"]) for r in records]
    args = ev.parse_args([opts.model, "--max-response-tokens", str(opts.max_response_tokens), "--budgets", "none"])
    t = time.perf_counter()
    engine = engines.make_engine(path, dtype=opts.engine_dtype, max_model_len=max(map(len, prompts)) +
                                 opts.max_response_tokens, enforce_eager=True)
    print(f"[bench] engine start {time.perf_counter() - t:.1f}s, dtype {engine.dtype}", file=sys.stderr, flush=True)
    ways = {"plain": lambda: plain(engine, prompts, opts.max_response_tokens, eos),
            "eval": lambda: via_eval(engine, tokenizer, records, prompts, args)}
    if not opts.skip_before:
        ways["before"] = lambda: before(engine, tokenizer, prompts, args, eos)
    plain(engine, prompts, opts.max_response_tokens, eos)  # warm-up, untimed
    seconds, cpu, tokens = {k: [] for k in ways}, {k: [] for k in ways}, {}
    for r in range(opts.repeats):
        for name, fn in (ways.items() if r % 2 == 0 else reversed(ways.items())):
            engine.llm.reset_prefix_cache()
            t, c = time.perf_counter(), time.process_time()
            tokens[name] = fn()
            seconds[name].append(round(time.perf_counter() - t, 2))
            cpu[name].append(round(time.process_time() - c, 2))
            print(f"[bench] {name}: {seconds[name][-1]:.1f}s ({cpu[name][-1]:.1f} CPU s)", file=sys.stderr, flush=True)
    engine.close()
    med = {k: statistics.median(v) for k, v in seconds.items()}
    same = sum(a == b for a, b in zip(tokens["eval"], tokens["plain"]))
    result = {"problems": len(prompts), "max_response_tokens": opts.max_response_tokens,
              "response_tokens": sum(map(len, tokens["plain"])), "seconds": seconds, "cpu_seconds": cpu,
              "median_s": med, "eval_equals_plain": f"{same}/{len(prompts)}"}
    for name in [k for k in ways if k != "plain"]:
        result[f"plain_over_{name}"] = round(med["plain"] / med[name], 3)
        result[f"plain_over_{name}_per_round"] = round(statistics.median(
            a / b for a, b in zip(seconds["plain"], seconds[name])), 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
