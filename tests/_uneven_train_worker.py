"""train.py with scripted completions, so that ranks make different numbers of engine calls:
`torchrun --nproc_per_node 2 _uneven_train_worker.py TRAIN_ARGS...` (or plain `python`, one rank).

engines.make_engine is wrapped: every generate call still goes to the real engine (vLLM), then each
completion is replaced by a script keyed on the rank its prompt has in a 2-rank run:
  rank 0: "\\boxed{<ground truth>}" + EOS, stopped -- the turn holds an answer, the trajectory ends after one call;
  rank 1: `budget` filler tokens, not stopped, no answer -- every turn is cut and intervened on, up to --max-turns.
In a 2-rank run the key is the rank itself. In a 1-rank run it is the prompt's position in the sample() call
modulo 2: train.py shards a step's batch and the validation set strided (`[rank::world]`, `range(rank, n, world)`),
so position % 2 is the rank the prompt would have had. Both runs then produce the same trajectories, and their
logged rollout and validation metrics must be equal (were the sharding different, they would not be).
SCRIPT_TP=K (with --engine-tp K in the multi-rank run, and SCRIPT_WORLD=N there and in the 1-rank run): the key is
the engine, rank // K, in the N-rank run, and (position % N) // K in the 1-rank run.
Each rank writes OUT/calls_rank{R}.json: how many real generate calls it made."""
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data as data_lib  # noqa: E402
import rollout  # noqa: E402
import train  # noqa: E402
from infra import engines  # noqa: E402
from infra.engines import Completion  # noqa: E402
from infra.hf import load_tokenizer  # noqa: E402
from model import resolve_model


class ScriptedEngine:
    def __init__(self, engine, gold):
        self.engine, self.gold = engine, gold
        self.keys = {}  # prompt tuple -> scripted rank, set by the sample() wrapper for each call
        self.calls = 0

    def __getattr__(self, name):  # tokenizer, max_model_len, sleep, sync_weights, close ...
        return getattr(self.engine, name)

    def _prompt(self, row):
        """The prompt this row (prompt + response so far) continues."""
        hits = [k for k in self.keys if tuple(row[:len(k)]) == k]
        assert len(hits) == 1, f"row matches {len(hits)} prompts of this sample() call"
        return hits[0]

    def generate(self, prompt_token_ids, max_tokens, *a, eos_ids=None, **k):
        real = self.engine.generate(prompt_token_ids, max_tokens, *a, eos_ids=eos_ids, **k)  # the real call
        self.calls += 1
        tok = self.engine.tokenizer
        eos = tok.eos_token_id if eos_ids is None else list(eos_ids)[0]
        budgets = engines._per_prompt(max_tokens, len(prompt_token_ids))
        filler = tok.encode(" so", add_special_tokens=False)[0]
        out = []
        for row, budget in zip(prompt_token_ids, budgets):
            prompt = self._prompt(row)
            if self.keys[prompt] == 0:
                ids = tok.encode(f"\\boxed{{{self.gold.get(prompt, '1')}}}", add_special_tokens=False) + [eos]
                assert len(ids) <= budget, (len(ids), budget)
                out.append(Completion(ids, [-1.0] * len(ids), True))
            else:
                out.append(Completion([filler] * budget, [-1.0] * budget, False))
        assert len(real) == len(out)
        return out


def main():
    argv = sys.argv[1:]
    args = train.parse_args(argv)
    real_make_engine, real_sample = engines.make_engine, rollout.sample
    tok = load_tokenizer(resolve_model(args.model))
    gold = {}  # prompt tuple -> ground truth, for the answering script (the reward then sees a correct answer)
    for name in (args.data, args.val_data):
        for r in data_lib.load_dataset(name, system_prompt=args.system_prompt):
            gold[tuple(data_lib.prompt_ids(tok, r["messages"]))] = r["ground_truth"]
    box = {}

    def make_engine(*a, **k):
        box["engine"] = ScriptedEngine(real_make_engine(*a, **k), gold)
        return box["engine"]

    tp, ranks = int(os.environ.get("SCRIPT_TP", 1)), int(os.environ.get("SCRIPT_WORLD", 2))

    def sample(engine, prompt_ids, *a, **k):
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        engine.keys = {tuple(p): rank // tp if world > 1 else pos % ranks // tp for pos, p in enumerate(prompt_ids)}
        return real_sample(engine, prompt_ids, *a, **k)

    engines.make_engine, rollout.sample = make_engine, sample
    rank = int(os.environ.get("RANK", 0))
    train.main(argv)
    Path(args.out, f"calls_rank{rank}.json").write_text(json.dumps({"calls": box["engine"].calls}))


if __name__ == "__main__":
    main()
    from infra.system import exit_without_teardown

    exit_without_teardown()  # as the CLIs end
