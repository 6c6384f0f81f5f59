"""Run by tests/test_model.py under torchrun: one rank's peak memory while loading MODEL for training, either the
way train.py does (weights.load_sharded: meta device, each rank reads its rows) or whole-then-shard.

    _load_worker.py MODEL OUT sharded|whole [CRITIC]

On CPU the peak is the kernel's own (VmHWM, reset through /proc/self/clear_refs just before loading) less the
resident memory at that moment; on a GPU, torch's peak allocation. Rank 0 checks that the gathered weights equal
the file's, and with CRITIC (a save_critic directory) that a critic loaded shard by shard, from CRITIC and from
MODEL (head at zero), equals model.load_critic's. Writes [bytes per rank] to OUT."""
import functools
import json
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import model as M  # noqa: E402
from infra import collectives, hf, sharding, weights  # noqa: E402


def status_kib(field):
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)[1])


def main():
    path, out, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    rank, world, _, device = collectives.init_distributed()
    build = functools.partial(hf.load_causal_lm, path)  # as train.py passes it: build(meta=...)
    build(meta=True)  # imports transformers' modelling code (~200 MB) before the baseline: only weights count
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        base = status_kib("VmRSS") * 1024
    if mode == "sharded":
        model = weights.load_sharded(build, path, device)
    else:
        model = sharding.shard(build(meta=False).to(device))
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda" else status_kib("VmHWM") * 1024) - base
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    full = dict(sharding.full_state_dict(model))  # a collective
    critics = {}
    for source in sys.argv[4:5] + sys.argv[1:2] if len(sys.argv) > 4 else ():
        critic = weights.load_sharded(functools.partial(M.load_critic, source), source, device)
        critics[source] = dict(sharding.full_state_dict(critic))
    if rank == 0:
        ref = hf.load_causal_lm(path).state_dict()
        assert all(torch.equal(full[k].cpu(), ref[k]) for k in full) and len(full) == len(ref) - 1  # lm_head tied
        for source, got in critics.items():
            want = M.load_critic(source).state_dict()
            assert got.keys() == want.keys() and all(torch.equal(got[k].cpu(), want[k]) for k in got), source
        assert len(critics) != 2 or critics[sys.argv[1]]["value_head.weight"].abs().sum() == 0  # a new head: 0
        assert len(critics) != 2 or critics[sys.argv[4]]["value_head.weight"].abs().sum() > 0
        out.write_text(json.dumps(peaks))
    collectives.close_distributed()


if __name__ == "__main__":
    main()
    from infra.system import exit_without_teardown

    exit_without_teardown()  # as the CLIs end
