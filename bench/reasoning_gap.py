"""Does working pay on a task? The untrained model's accuracy when it writes its working before the answer line
against when it must answer at once, same prompt, same problems, greedy:

  worked:  the chat prompt as training sees it; up to --tokens response tokens.
  at once: the same prompt with the assistant's reply started as 'Answer:' (prefilled); 8 more tokens.

Scored twice with reward.py: explicit answers only (the training reward) and as eval.py scores (the last number
counts when no answer is marked). Per number of events too, for the story task. Plain transformers generate in
float32 (a measurement, not a rollout path).

    python bench/reasoning_gap.py --data story_test --system-prompt worked-steps
    python bench/reasoning_gap.py --data arith_test --system-prompt answer-line
"""
import argparse
import collections
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import data  # noqa: E402
import reward  # noqa: E402
from infra.hf import load_tokenizer  # noqa: E402
from model import resolve_model

PREFILL = "Answer:"


def generate(model, tok, prompts, max_new, batch=50):
    """Greedy continuations of token-id prompts (left-padded batches) -> decoded texts."""
    outs = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in chunk])  # [b, width]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])      # [b, width]
        with torch.no_grad():
            g = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                               pad_token_id=tok.pad_token_id)
        outs += tok.batch_decode(g[:, width:], skip_special_tokens=True)
    return outs


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--data", default="story_test")
    p.add_argument("--system-prompt", default="worked-steps")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--tokens", type=int, default=128, help="response tokens when working is allowed")
    args = p.parse_args()
    torch.manual_seed(0)
    path = resolve_model(args.model)
    tok = load_tokenizer(path)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    recs = data.load_dataset(args.data, args.system_prompt, args.limit)
    prompts = [data.prompt_ids(tok, r["messages"]) for r in recs]
    prefill = tok.encode(PREFILL, add_special_tokens=False)
    texts = {"worked": generate(model, tok, prompts, args.tokens),
             "at once": [PREFILL + t for t in generate(model, tok, [q + prefill for q in prompts], 8)]}
    events = [r["problem"].count(".") - 1 for r in recs]  # story: one sentence per event after the first
    print(f"{args.data}, {len(recs)} problems, system prompt {args.system_prompt!r}, {args.model}, greedy")
    print("| mode | scoring | accuracy % | " + " | ".join(f"{e} event(s) %" for e in sorted(set(events))) + " |")
    for mode, outs in texts.items():
        for scoring, last_number in (("explicit answer (training reward)", False), ("eval.py", True)):
            res = reward.score_batch([r["data_source"] for r in recs], outs, [r["ground_truth"] for r in recs],
                                     last_number=last_number)
            by = collections.defaultdict(list)
            for e, x in zip(events, res):
                by[e].append(x["acc"])
            acc = 100 * sum(x["acc"] for x in res) / len(res)
            cells = " | ".join(f"{100 * sum(v) / len(v):.0f} (n={len(v)})" for _, v in sorted(by.items()))
            print(f"| {mode} | {scoring} | {acc:.1f} | {cells} |")
    for mode, outs in texts.items():
        print(f"first {mode} response: {outs[0][:160]!r}")


if __name__ == "__main__":
    main()
