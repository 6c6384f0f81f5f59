"""One engine per rank against one engine over K ranks (--engine-tp), on the same ranks, one run each:

    torchrun --nproc_per_node 2 bench/tp_bench.py --engine-tp 1
    torchrun --nproc_per_node 2 bench/tp_bench.py --engine-tp 2

Each engine group samples its share of the same requests (the trainer's sharding: rollout.group_shard), every
request decoding --tokens tokens (EOS ignored, so both settings decode the same count). Reported by rank 0 as one
JSON line: engine start, decoded tokens/s over the whole world (each token counted once, not once per rank of its
engine), one full weight sync (the trainer's full_state_dict path: every rank gathers each tensor, the engine keeps
its share) and each rank's peak resident memory. The model: a random Llama of SmolLM2-135M's size whose heads split
in two (8 heads, 4 KV heads; SmolLM2's 9 and 3 do not), written once to --model-dir.

    torchrun --nproc_per_node 2 bench/tp_bench.py --lora-rank 16

--lora-rank R: the trainer holds LoRA adapters (non-zero B) and the sync sends their merged layers only
(lora.merged_weights, train.py's path); the decode is timed again after the sync (tokens_per_s_synced), where the
engine runs the merged weights: its plain kernels either way.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import model  # noqa: E402
import rollout  # noqa: E402
from infra import engines  # noqa: E402
from infra import lora  # noqa: E402
from infra import hf
from infra.collectives import init_distributed  # noqa: E402
from infra.sharding import full_state_dict, shard
from infra.system import peak_rss_gb  # noqa: E402


def decode(engine, prompts, seeds, tokens, leader):
    """One timed generate of every engine's share -> decode_s, tokens (over the world), tokens_per_s."""
    t0 = time.perf_counter()
    out = engine.generate(prompts, tokens, temperature=1.0, seed=seeds, eos_ids=[])
    dist.barrier()  # the slowest engine's time
    seconds = time.perf_counter() - t0
    count = torch.tensor([float(sum(len(c.token_ids) for c in out)) if leader else 0.0])  # one rank per engine
    dist.all_reduce(count)
    return dict(decode_s=round(seconds, 2), tokens=int(count.item()), tokens_per_s=round(count.item() / seconds, 1))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-tp", type=int, default=1)
    p.add_argument("--model-dir", default="runs/tp-bench-model")
    p.add_argument("--requests", type=int, default=32, help="requests in all, over every engine")
    p.add_argument("--tokens", type=int, default=128, help="tokens decoded per request")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--lora-rank", type=int, default=0, help="sync merged LoRA adapters instead of the whole model")
    args = p.parse_args()
    rank, world, _, device = init_distributed()
    path = Path(args.model_dir)
    if rank == 0 and not (path / "config.json").exists():
        model.make_tiny(path, hidden=512, layers=30, heads=8, kv_heads=4, intermediate=1536)
    dist.barrier()
    engines.check_tensor_parallel(str(path), args.engine_tp, world)
    res = {"engine_tp": args.engine_tp, "ranks": world}
    t0 = time.perf_counter()
    engine = engines.make_engine(str(path), dtype="float32", seed=0, max_model_len=args.prompt_tokens + args.tokens,
                                 enforce_eager=True, distributed=True, tp=args.engine_tp)
    res["start_s"] = round(time.perf_counter() - t0, 2)

    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 40000, (args.requests, args.prompt_tokens), generator=gen).tolist()
    group, _ = rollout.group_shard(len(prompts), rank, world, args.engine_tp)
    engine.generate([prompts[i] for i in group[:2]], 4, temperature=1.0, seed=0, eos_ids=[])  # warm-up
    dist.barrier()
    res.update(decode(engine, [prompts[i] for i in group], group, args.tokens, rank % args.engine_tp == 0))

    trainer = hf.load_causal_lm(str(path))  # the trainer's copy, FSDP2-sharded as train.py shards it
    if args.lora_rank:
        lora.adapt(trainer, hf.decoder_layers(trainer), args.lora_rank, 32, lora.TARGETS, torch.float32)
        for _, layer in lora.adapted_layers(trainer):
            torch.nn.init.normal_(layer.lora_B.weight, std=1e-3)
    shard(trainer)
    dist.barrier()
    t0 = time.perf_counter()
    engine.sync_weights(lora.merged_weights(trainer, engine.dtype) if args.lora_rank
                        else full_state_dict(trainer, engine.dtype))
    dist.barrier()
    res["sync_s"] = round(time.perf_counter() - t0, 3)
    res["tokens_per_s_synced"] = decode(engine, [prompts[i] for i in group], group, args.tokens,
                                        rank % args.engine_tp == 0)["tokens_per_s"]
    rss = [None] * world
    dist.all_gather_object(rss, round(peak_rss_gb(), 2))
    res["peak_rss_gb_per_rank"] = rss
    if rank == 0:
        print(json.dumps(res), flush=True)
    engine.close()


if __name__ == "__main__":
    main()
