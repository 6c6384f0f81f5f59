"""The process group and its collectives: one group over every rank under torchrun (a 1-rank group without it),
a fresh rendezvous per restart, the engine's tensor-parallel groups, and the small gathers and reductions the
trainer and the evaluation share. Every function that gathers or reduces is a collective: every rank calls it."""
import json
import os
import random
import time

import torch
import torch.distributed as dist

from infra.cli import die, no_link


def init_distributed(timeout=None):
    """(rank, world_size, local_rank, device). Under torchrun: one process group over all ranks
    (gloo for CPU tensors, nccl for CUDA). Without torchrun: a 1-rank group in an in-process
    store, so shard()/full_state_dict() work the same way in a plain `python train.py`.
    timeout: seconds any collective may wait (NCCL's watchdog and gloo's); ranks wait for the slowest
    rank's rollout at the first collective after it, so it must outlast that (None: torch's default)."""
    import datetime

    import torch.distributed as dist

    timeout = None if timeout is None else datetime.timedelta(seconds=timeout)
    rank, world, local = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"  # gloo also serves offloaded params
        if "RANK" in os.environ:
            dist.init_process_group(backend, store=attempt_store(world, timeout), rank=rank, world_size=world,
                                    device_id=device if device.type == "cuda" else None, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return rank, world, local, device


def attempt_store(world, timeout=None):
    """The rendezvous store of this attempt of the group, or None (init_process_group's env:// store). torchrun's
    agent hosts one TCPStore for all restarts of a group (TORCHELASTIC_USE_AGENT_STORE) and hands it to the workers
    without a per-attempt prefix, so a restarted group's ranks could read the dead attempt's keys (gloo's peer
    addresses, NCCL's unique id) and connect to dead peers: each attempt's keys go under their own prefix, the
    attempt's number agreed through the store itself (agree_on_attempt). TORCHELASTIC_RESTART_COUNT cannot be it:
    each node's agent counts its own restarts, and an agent whose workers hung rather than failed (NCCL peers of a
    dead rank usually do) restarts them through its membership-change path, which does not count."""
    import torch.distributed as dist
    from torch.distributed.constants import default_pg_timeout

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None  # rank 0 hosts a fresh store (env://), or another launcher's own
    timeout = timeout or default_pg_timeout
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    attempt = agree_on_attempt(store, int(os.environ["RANK"]), world, timeout.total_seconds())
    return dist.PrefixStore(f"attempt_{attempt}", store)


def agree_on_attempt(store, rank, world, timeout):
    """A number that every worker of this attempt of the group gets, and no worker of an earlier attempt got; `store`
    outlives attempts, and every worker of an earlier attempt is dead when this one's start (torchrun stops them all
    before the next rendezvous). Rank 0 draws the next number from a counter and posts it; every other rank answers
    the number it read with a nonce of its own, and takes it once rank 0 has listed that nonce: a number left over
    from an earlier attempt is never confirmed with this attempt's nonces, so that rank reads again."""
    deadline = time.monotonic() + timeout
    if rank == 0:
        attempt = store.add("mutis/attempts", 1)
        store.set("mutis/attempt", str(attempt))
        acks = [f"mutis/attempt_{attempt}/ack/{r}" for r in range(1, world)]
        if missing := wait_for_keys(store, acks, deadline):
            raise TimeoutError(f"rank(s) {[r for r, k in enumerate(acks, 1) if k in missing]} did not join attempt "
                               f"{attempt} of the group")
        store.set(f"mutis/attempt_{attempt}/go", json.dumps(sorted(store.get(k).decode() for k in acks)))
        return attempt
    nonce, answered = f"{rank}-{os.getpid()}-{random.getrandbits(64):016x}", None
    while time.monotonic() < deadline:
        if store.check(["mutis/attempt"]):
            attempt = int(store.get("mutis/attempt"))
            if attempt != answered:
                store.set(f"mutis/attempt_{attempt}/ack/{rank}", nonce)
                answered = attempt
            go = f"mutis/attempt_{attempt}/go"
            if store.check([go]) and nonce in json.loads(store.get(go)):
                return attempt
        time.sleep(0.01)
    raise TimeoutError("rank 0 did not start this attempt of the group")


def wait_for_keys(store, keys, deadline):
    """Wait until every key is set in the store -> [], or the keys still missing once time.monotonic() passes
    deadline. Polled, not store.wait: the calling thread stays in Python between checks (a signal handler runs), and
    the store logs no warning per timed-out wait."""
    pause = 0.01
    while not store.check(keys):
        if time.monotonic() > deadline:
            return [k for k in keys if not store.check([k])]
        time.sleep(pause)
        pause = min(2 * pause, 0.25)
    return []


def close_distributed():
    """End the process group while the interpreter is whole. FSDP's modules hold the group in reference cycles that
    only the garbage collector frees; left to interpreter shutdown, the group's gloo worker threads touch Python
    after it is finalising and the process aborts ("terminate called without an active exception")."""
    import gc

    if dist.is_initialized():
        dist.barrier()  # no rank tears the group down while another still uses it
        gc.collect()
        dist.destroy_process_group()
    gc.collect()


def current_rank():
    return dist.get_rank() if dist.is_initialized() else 0


def current_world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def broadcast_object(obj, src=0):
    """Rank src's obj on every rank (small JSON-like values: a decision, a list of names)."""
    if current_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj):
    """[every rank's obj] on every rank, in rank order (small JSON-like values)."""
    if current_world_size() == 1:
        return [obj]
    out = [None] * current_world_size()
    dist.all_gather_object(out, obj)
    return out


class RanksDisagree(RuntimeError):
    """Ranks that must hold the same result do not (the ranks of one tensor-parallel engine, their tokens)."""


def engine_group(tp):
    """The ranks that share this rank's engine (--engine-tp): groups of tp contiguous ranks, as vLLM's
    external_launcher forms them -> (members, a gloo group over them; None when tp == 1). A collective over the
    whole world (new_group): every rank calls it, at once. gloo: the group's few small collectives (a stop flag
    before each engine step, a hash after each call) stay off the GPU and its streams."""
    rank, world = current_rank(), current_world_size()
    if tp == 1:
        return [rank], None
    mine = None
    for first in range(0, world, tp):
        members = list(range(first, first + tp))
        group = dist.new_group(members, backend="gloo")
        if rank in members:
            mine = members, group
    return mine


def group_any(flag, group):
    """Whether any rank of `group` passed a true flag (a collective over the group)."""
    t = torch.tensor([int(bool(flag))])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def group_gather_int(value, group):
    """[every member's int64 value] on every member of `group`, in rank order."""
    mine = torch.tensor([value], dtype=torch.int64)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [int(t.item()) for t in out]


def gather_to_first(items, key):
    """Every rank's list of items on rank 0, merged and sorted by key (None on the other ranks): what one process
    would have produced."""
    if current_world_size() == 1:
        parts = [items]
    else:
        parts = [None] * current_world_size() if current_rank() == 0 else None
        dist.gather_object(items, parts, dst=0)
        if parts is None:
            return None
    return sorted((x for part in parts for x in part), key=key)


def all_reduce_sum(values_list, device):
    t = torch.tensor(values_list, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def all_reduce_dict(d, device):
    """{name: local sum} -> {name: sum over ranks}; every rank passes the same keys."""
    keys = sorted(d)
    return dict(zip(keys, all_reduce_sum([float(d[k]) for k in keys], device)))


def barrier():
    if dist.is_initialized():
        dist.barrier()


def check_shared_out(out, rank, world, device):
    """--out must be one directory for every rank (a filesystem shared by all nodes): rank 0 writes a token
    file there, every rank must read it back; otherwise every rank stops with one line."""
    if world == 1:
        return
    token = all_reduce_sum([float(random.SystemRandom().getrandbits(48)) if rank == 0 else 0.0], device)[0]
    path = out / f".shared-check-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}"
    if rank == 0:
        with os.fdopen(no_link(path), "w") as f:
            f.write(str(int(token)))
    barrier()
    try:
        seen = path.read_text() == str(int(token))
    except OSError:
        seen = False
    missing = all_reduce_sum([0.0 if seen else 1.0], device)[0]
    if rank == 0:
        path.unlink(missing_ok=True)
    if missing:
        die(f"--out {out}: {int(missing)} of {world} ranks do not see the file rank 0 wrote there; --out must be "
            f"on a filesystem shared by every node (checkpoints and metrics are written by rank 0 and read by all)")
