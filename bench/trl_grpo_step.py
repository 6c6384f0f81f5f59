"""TRL's GRPOTrainer on trl_compare.py's configuration; runs inside the scratch TRL venv, never the project's.

    /tmp/trl-venv/bin/python bench/trl_grpo_step.py --model models/smollm2-135m-instruct --steps 6 --out trl.json

One optimiser step = 4 prompts x 6 completions (generation_batch_size 24) in 3 micro-batches of 8, fp32 on CPU,
transformers generation, the project's reward (reward.score_batch) on the prompts train.py samples for the same
seed. Step times come from a TrainerCallback (on_step_begin -> on_step_end); they and the installed versions
go to --out as JSON. One line per step on stdout.
"""
import argparse
import json
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import data  # noqa: E402  (stdlib only at import: works in the scratch venv)
import reward  # noqa: E402

# the configuration, shared with trl_compare.py (which maps it to train.py's flags)
PROMPTS, SAMPLES, MICRO, TOKENS, KL, ENTROPY, LR, WEIGHT_DECAY = 4, 6, 8, 64, 0.001, 0.001, 1e-6, 0.01
SYSTEM_PROMPT = "answer-line"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--data", default="arith_train", help="bundled dataset name or path (data.load_dataset)")
    p.add_argument("--steps", type=int, default=6, help="optimiser steps")
    p.add_argument("--seed", type=int, default=0, help="seed (train.py --seed)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--out", required=True, help="JSON file for step times and versions")
    p.add_argument("--work-dir", default=None, help="TRL's output_dir (nothing is saved there; default: next to --out)")
    return p.parse_args(argv)


def config(args, work_dir):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(work_dir), max_steps=args.steps, seed=args.seed,
        # one optimiser step per generation batch: 24 completions = 3 micro-batches of 8
        per_device_train_batch_size=MICRO, gradient_accumulation_steps=PROMPTS * SAMPLES // MICRO,
        num_generations=SAMPLES, generation_batch_size=PROMPTS * SAMPLES, num_iterations=1,
        max_completion_length=TOKENS, temperature=args.temperature, top_p=1.0, use_vllm=False,
        beta=KL, epsilon=0.2, loss_type="dapo", scale_rewards="group", entropy_coef=ENTROPY,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=WEIGHT_DECAY,
        max_grad_norm=1.0, optim="adamw_torch",  # train.py: torch.optim.AdamW, clip 1.0, constant LR
        model_init_kwargs={"dtype": "float32", "attn_implementation": "sdpa"},
        bf16=False, fp16=False, use_cpu=True, gradient_checkpointing=False, dataloader_num_workers=0,
        shuffle_dataset=False,  # the dataset is already in train.py's order
        logging_strategy="no", save_strategy="no", report_to="none", log_completions=False, disable_tqdm=True,
    )


def main(argv=None):
    args = parse_args(argv)
    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOTrainer

    records = data.load_dataset(args.data, system_prompt=SYSTEM_PROMPT)
    # train.py's epoch-0 order (np.random.default_rng(seed + epoch).permutation), so step k sees its prompts
    order = np.random.default_rng(args.seed).permutation(len(records))[:args.steps * PROMPTS]
    rows = [records[int(i)] for i in order]
    dataset = Dataset.from_list([{"prompt": r["messages"], "prompt_id": r["id"], "data_source": r["data_source"],
                                  "ground_truth": json.dumps(r["ground_truth"])} for r in rows])
    lengths, batches = [], []  # per generation batch: mean completion tokens, prompt ids

    def score(prompts, completions, completion_ids, data_source, ground_truth, prompt_id, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        lengths.append(statistics.mean(len(ids) for ids in completion_ids))
        batches.append(prompt_id)
        results = reward.score_batch(data_source, texts, [json.loads(g) for g in ground_truth], first=False)
        return [float(s["score"]) for s in results]

    steps = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, a, state, control, **_):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **_):
            steps.append({"step": state.global_step, "begin_end": time.perf_counter() - self.t0,
                          "end_time": time.perf_counter(), "completion_tokens": lengths[-1] if lengths else None})
            print(f"[trl] step {state.global_step}/{args.steps}  {steps[-1]['begin_end']:.1f}s  "
                  f"completion {steps[-1]['completion_tokens'] or 0:.0f} tokens", flush=True)

    work_dir = Path(args.work_dir or Path(args.out).with_suffix(".work"))
    trainer = GRPOTrainer(model=args.model, reward_funcs=score, args=config(args, work_dir), train_dataset=dataset,
                          callbacks=[StepTimer()])
    trainer.remove_callback(PrinterCallback)  # with tqdm off it prints the final metrics dict; StepTimer says enough
    trainer.train()
    # end to end: on_step_end to the next on_step_end, to catch work outside the begin/end window
    for prev, cur in zip(steps, steps[1:]):
        cur["end_to_end"] = cur["end_time"] - prev["end_time"]
    # train.py's batches: step k samples each of its prompts SAMPLES times, in one generation batch
    expected = [sorted(r["id"] for r in rows[k * PROMPTS:(k + 1) * PROMPTS] for _ in range(SAMPLES))
                for k in range(args.steps)]
    same_prompts = [sorted(b) for b in batches] == expected
    if not same_prompts:
        print("[trl] warning: TRL's generation batches are not train.py's prompts x samples", file=sys.stderr)
    cfg = trainer.args
    result = {"versions": {k: version(k) for k in ("trl", "transformers", "torch", "accelerate")},
              "threads": torch.get_num_threads(), "steps": steps,
              "config": {k: getattr(cfg, k) for k in (
                  "per_device_train_batch_size", "gradient_accumulation_steps", "num_generations",
                  "generation_batch_size", "steps_per_generation", "num_iterations", "max_completion_length",
                  "beta", "epsilon", "loss_type", "scale_rewards", "entropy_coef", "temperature", "top_p",
                  "learning_rate", "lr_scheduler_type", "weight_decay", "max_grad_norm", "optim", "bf16",
                  "use_cpu", "use_vllm", "gradient_checkpointing", "seed")},
              "model_dtype": str(trainer.model.dtype), "ref_model": trainer.ref_model is not None,
              "same_prompts": same_prompts}
    result["config"]["optim"] = str(result["config"]["optim"])
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
