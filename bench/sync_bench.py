"""The weight sync's cost per training step, one run: the engine sleeps as after a rollout, the trainer's weights go
in, the engine samples; for a full fine-tune and for LoRA on several sets of targets.

For each case, `--repeats` times: sleep (a GPU frees weights and KV cache; a CPU destroys what a GPU would discard),
sync (train.py's engine weights: sharding.full_state_dict, or lora.merged_weights), then sample the prompts at
temperature 1 and compare the engine's log-probs with the trainer's (fp32 trainer; the same numbers as train.py's
rollout/logprob_gap). Prints one line per case (median seconds, bytes sent, the gap) and each case's sync time as a
ratio of the full fine-tune's; the last stdout line is the whole result as JSON.

    python bench/sync_bench.py [--model smollm2] [--engine-dtype auto] [--repeats 3]
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_smoke import gap, moved, trainer_logprobs  # noqa: E402

import data  # noqa: E402
import rollout  # noqa: E402
from infra import engines  # noqa: E402
from infra import lora  # noqa: E402
from infra.hf import load_causal_lm, load_tokenizer  # noqa: E402
from infra.sharding import full_state_dict  # noqa: E402
from infra.system import default_device, quiet_logs  # noqa: E402
from model import end_of_turn_ids, resolve_model

CASES = {"full": None, "lora all-linear": lora.TARGETS, "lora q_proj,v_proj": ("q_proj", "v_proj"),
         "lora gate_proj": ("gate_proj",)}


def counted(pairs, sent):
    for name, t in pairs:
        sent.append(t.numel() * t.element_size())
        yield name, t


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--engine-dtype", default="auto")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()
    quiet_logs()
    device = default_device()
    path = resolve_model(args.model)
    tok = load_tokenizer(path)
    records = data.load_dataset("arith_test", system_prompt="answer-line", limit=args.prompts)
    prompts, _ = rollout.tokenize_prompts(tok, records)
    kw = dict(n=2, turn_tokens=args.tokens, max_turns=0, intervention_ids=[], eos_ids=end_of_turn_ids(path, tok))
    engine = engines.make_engine(path, kind="vllm", dtype=args.engine_dtype, seed=0, max_model_len=1024,
                                 enforce_eager=True, gpu_memory_utilization=0.3)
    res = {"model": str(path), "engine_dtype": str(engine.dtype), "device": device.type}
    for case, targets in CASES.items():
        trainer = moved(load_causal_lm(path).to(device).eval(), targets)
        sleeps, syncs, gaps, sent = [], [], [], []
        for r in range(args.repeats):
            t0 = time.perf_counter()
            engine.sleep()
            sleeps.append(time.perf_counter() - t0)
            pairs = (full_state_dict(trainer, engine.dtype) if targets is None
                     else lora.merged_weights(trainer, engine.dtype))
            sent.clear()
            t0 = time.perf_counter()
            engine.sync_weights(counted(pairs, sent))
            syncs.append(time.perf_counter() - t0)
            ro = rollout.sample(engine, prompts, temperature=1.0, seed=r, **kw)
            gaps.append(gap(*trainer_logprobs(trainer, ro, 1.0, device)))
        res[case] = dict(sleep_s=round(statistics.median(sleeps), 4), sync_s=round(statistics.median(syncs), 4),
                         sent_mb=round(sum(sent) / 2**20, 1), tensors=len(sent), gap=round(max(gaps), 6))
        print(f"[sync] {case:20s} sleep {res[case]['sleep_s']:.3f}s  sync {res[case]['sync_s']:.3f}s  "
              f"{res[case]['sent_mb']:7.1f} MB in {len(sent):3d} tensors  log-prob gap {res[case]['gap']:.2e}",
              file=sys.stderr, flush=True)
        del trainer
    full = res["full"]["sync_s"] + res["full"]["sleep_s"]
    for case in CASES:
        res[case]["step_ratio_to_full"] = round((res[case]["sync_s"] + res[case]["sleep_s"]) / full, 3)
    engine.close()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
