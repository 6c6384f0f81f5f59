"""One rank of the colocated-vLLM tests: `torchrun --nproc_per_node 2 _rollout_worker.py MODEL SPEC OUT_DIR`.

Each rank owns an engine (external_launcher), samples its strided shard of the prompts greedily and writes
its trajectories to OUT_DIR/rank{R}.json; a gloo all_reduce afterwards checks the trainer's group still works.
SPEC with "timeouts" (one per rank): both ranks share one engine (--engine-tp 2) and make one long call, each with its
own deadline, then a short greedy one; OUT_DIR/rank{R}.json says whether the long call timed out and what the short
one decoded."""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rollout  # noqa: E402
from infra import engines  # noqa: E402


def main():
    model_dir, spec_path, out_dir = sys.argv[1:4]
    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tp = 2 if "timeouts" in spec else 1
    engine = engines.make_engine(model_dir, dtype="float32", seed=0, max_model_len=spec["max_model_len"],
                                 distributed=True, enforce_eager=True, tp=tp)
    if tp > 1:
        try:
            engine.generate(spec["prompts"] * 4, 400, temperature=1.0, seed=1, timeout=spec["timeouts"][rank])
            timed_out = False
        except engines.RolloutTimeout:
            timed_out = True
        after = engine.generate(spec["prompts"], 3, temperature=0)  # the engine's ranks still step together
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"timed_out": timed_out,
                                                                 "after": [c.token_ids for c in after]}))
        engine.close()
        return
    idx = rollout.shard_indices(len(spec["prompts"]), rank, world)
    ro = rollout.sample(engine, [spec["prompts"][i] for i in idx], prompt_indices=idx, **spec["kwargs"])
    count = torch.tensor([len(ro)])
    dist.all_reduce(count)  # the default group is still the trainer's after the engine exists
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"total": int(count), "rollout": list(ro)}))
    engine.close()  # also tears down the default group (vLLM's shutdown does)


if __name__ == "__main__":
    main()
    from infra.system import exit_without_teardown

    exit_without_teardown()  # as the CLIs end
