"""One rank of the uneven-calls probe: `torchrun --nproc_per_node 2 _uneven_worker.py MODEL MODES OUT_DIR`.

Rank r makes r + 1 `generate` calls on its own colocated engine, then both ranks meet at a barrier (what
MuTIS does when one rank's trajectories all answer in turn 1 and another's need every turn). MODE:
  ours        engines.make_engine(distributed=True) built after init_process_group (the trainer's order)
  dp          the same, but vLLM built with data_parallel_size=WORLD_SIZE: the engines form one vLLM DP group
              (the old colocation; expected to hang on rank 1's second call)
  before-pg   distributed=True, but the engine is built before the trainer's process group exists
MODES: one of them, or several separated by commas, probed in turn in one process (before-pg,ours: the failed
engine leaves nothing behind, and the same ranks then build theirs in the trainer's order). Each rank writes
OUT_DIR/MODE.rank{R}.json with the seconds each call and the barrier took, or the error."""
import json
import sys
import time
import traceback
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from infra import engines  # noqa: E402


def main():
    model_dir, modes, out_dir = sys.argv[1:4]
    for mode in modes.split(","):
        probe(model_dir, mode, out_dir)


def probe(model_dir, mode, out_dir):
    import os
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if mode == "dp":
        import vllm

        class DPLLM(vllm.LLM):  # the old VLLMEngine(distributed=True): one DP group over all ranks
            def __init__(self, *a, **k):
                super().__init__(*a, data_parallel_size=world, **k)
        vllm.LLM = DPLLM
    res = {"rank": rank, "mode": mode}
    t0 = time.time()
    try:
        if mode != "before-pg" and not dist.is_initialized():
            dist.init_process_group("gloo")
        engine = engines.make_engine(model_dir, dtype="float32", seed=0, max_model_len=256, distributed=True,
                                     enforce_eager=True, gpu_memory_utilization=0.2)
        if mode == "before-pg":
            dist.init_process_group("gloo")
        res["engine_s"] = round(time.time() - t0, 1)
        tok = engine.tokenizer
        res["calls_s"] = []
        for call in range(rank + 1):
            t = time.time()
            out = engine.generate([tok.encode(f"Question {rank}-{call}: count to ten.")], 8, temperature=0.0)
            assert len(out[0].token_ids) == 8
            res["calls_s"].append(round(time.time() - t, 2))
            Path(out_dir, f"{mode}.rank{rank}.json").write_text(json.dumps(res))  # progress, in case the next call hangs
        t = time.time()
        dist.barrier()
        res["barrier_s"] = round(time.time() - t, 2)
        Path(out_dir, f"{mode}.rank{rank}.json").write_text(json.dumps(res))
        engine.close()
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
        Path(out_dir, f"{mode}.rank{rank}.json").write_text(json.dumps(res))
        traceback.print_exc()
        if mode != "before-pg":  # there the error is the expected result: exiting 0 keeps torchrun from killing
            raise SystemExit(1)  # the other rank before it has written its own (a race under load)


if __name__ == "__main__":
    main()
    from infra.system import exit_without_teardown

    exit_without_teardown()  # as the CLIs end
