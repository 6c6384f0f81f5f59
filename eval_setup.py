"""eval.py's setup: every flag and input checked before the first engine starts, the checkpoints verified and grouped
by the engine they can share, --out claimed, a journal per checkpoint; and the evaluation's state (Evaluation)."""
import hashlib
import json
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from infra.cli import die


@dataclass
class Evaluation:
    """What eval.main's steps hand on, declared once."""
    args: object              # eval.py's flags (--max-response-tokens, --budgets, --engine-dtype resolved on the way)
    records: list             # every benchmark's problems in --benchmarks order, each with its "_benchmark" name
    benches: list             # the benchmark names
    paths: dict               # checkpoint as given -> its model directory (or hub id)
    kinds: dict               # checkpoint -> model.check_model's kind: "alias", "dir", "checkpoint" or "hub"
    out: Path                 # --out: samples, summaries, plot and journal/
    rank: int                 # this process's rank (0 without torchrun)
    world: int                # the number of ranks
    say: Callable             # print a line to stderr on rank 0, nothing on the others
    t0: float                 # time.time() when the evaluation started
    prepared: dict = field(default_factory=dict)  # checkpoint -> (tokenizer, prompt ids, longest prompt, context)
    gen_tokens: int = 0       # response tokens generated per sample: the largest of the cap and the budgets
    groups: dict = field(default_factory=dict)    # engine key -> the checkpoints sharing that engine, in given order
    journals: dict = field(default_factory=dict)  # checkpoint -> its eval_journal.Journal of finished requests
    shard: list = field(default_factory=list)     # problem indices this rank's engine generates (its TP group's)
    own: set = field(default_factory=set)         # of those, the ones this rank scores
    timings: dict = field(default_factory=dict)   # seconds per phase, engine and checkpoint (summary.json)
    samples: dict = field(default_factory=dict)   # checkpoint -> its scored samples (rank 0 only)


def start(args):
    """Every benchmark and checkpoint checked (one line on bad input, nothing loaded yet), the process group under
    torchrun, each training checkpoint's actor/ verified against its manifest, --out claimed -> Evaluation."""
    import data
    from infra.hf import check_attn_implementation
    from model import check_model, resolve_model

    if args.engine == "hf":
        check_attn_implementation(args.attn_implementation)
        args.max_in_flight = args.max_in_flight or 64
    t0 = time.time()
    benches = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
    for b in benches:  # every name train.py's --data takes
        if b not in data.BUNDLED and not Path(b).exists():
            die(f"--benchmarks: unknown benchmark {b!r} (known: {', '.join(data.BUNDLED)}; or a dataset path)")
    kinds = {c: check_model(c, "checkpoint")[0] for c in args.checkpoints}  # dies in one line; downloads nothing
    paths = {c: resolve_model(c) for c in args.checkpoints}
    records = []
    for b in benches:
        try:
            records += [{**r, "_benchmark": b} for r in data.load_dataset(b, args.system_prompt, args.limit)]
        except (data.DataError, OSError) as e:
            die(f"--benchmarks {b}: {e}")
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if world > 1:  # before --out's default: rank 0's clock names it for every rank
        from infra.collectives import init_distributed

        init_distributed()
    # a training checkpoint is evaluated as its manifest says it was written, or not at all
    from infra import checkpoint
    from infra.collectives import broadcast_object

    for name, why in broadcast_object({c: checkpoint.damage(Path(p).parent, only="actor") for c, p in paths.items()
                                       if kinds[c] == "checkpoint" and (Path(p).parent / checkpoint.MANIFEST).exists()}
                                      if rank == 0 else None).items():
        if why:
            die(f"checkpoint {name}: {why}")
    out = Path(args.out or broadcast_object(f"runs/eval-{time.strftime('%Y%m%d-%H%M%S')}"))
    if args.overwrite:
        replace_out(out, rank == 0)
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if rank == 0 else (lambda line: None)
    if args.temperature == 0 and args.samples_per_prompt > 1:
        say("note: --samples-per-prompt > 1 with --temperature 0 repeats the same greedy answer")
    return Evaluation(args, records, benches, paths, kinds, out, rank, world, say, t0)


def plan_engines(ev):
    """Checkpoints grouped by the engine they can share, each one's weight files checked, the engine dtype chosen, a
    journal opened per checkpoint (it dies here if --out holds other settings' generations), this rank's shard."""
    import rollout
    from eval_journal import Journal
    from infra import engines
    from infra.collectives import broadcast_object
    from infra.system import choose_dtype
    from infra.weights import weight_files
    from model import end_of_turn_ids

    args, paths, world = ev.args, ev.paths, ev.world
    eos = {name: sorted(end_of_turn_ids(path, ev.prepared[name][0])) for name, path in paths.items()}
    ev.groups = defaultdict(list)
    for name, path in paths.items():
        ev.groups[engine_key(path, ev.kinds[name], ev.prepared[name][1], eos[name])].append(name)
    for names in ev.groups.values():
        for name in names:
            try:
                files = weight_files(paths[name])
            except ValueError as e:
                die(f"checkpoint {name}: {e}")
            if not files and name != names[0]:
                die(f"checkpoint {name}: no *.safetensors files in {paths[name]} to load into the running engine")
    for path in paths.values():
        engines.check_tensor_parallel(path, args.engine_tp, world)
    if world > 1 and len(ev.groups) > 1 and args.engine == "vllm":  # vLLM's shutdown ends the process group
        die(f"under torchrun every checkpoint must share one engine (one architecture and tokenizer); "
            f"{len(ev.groups)} kinds given: evaluate them in separate calls")
    args.engine_dtype, why = choose_dtype(args.engine_dtype, engine=args.engine)
    check_batch_invariance(args, world, ev.say)
    weights = broadcast_object({name: weights_fingerprint(path, ev.kinds[name]) for name, path in paths.items()}
                               if ev.rank == 0 else None)  # rank 0 reads the files once
    ev.journals = {name: Journal(ev.out / "journal", name, ev.rank, {
        "weights": weights[name], "engine": args.engine,
        "engine_dtype": args.engine_dtype, "temperature": args.temperature, "top_p": args.top_p, "stop": args.stop,
        "eos_ids": eos[name]}) for name in paths}
    ev.say(f"[setup] {args.engine} engine dtype {args.engine_dtype} ({why}); {len(ev.records)} problems x "
           f"{args.samples_per_prompt} sample(s), {ev.gen_tokens} response tokens"
           + (f", {world} ranks" if world > 1 else ""))
    ev.shard, mine = rollout.group_shard(len(ev.records), ev.rank, world, args.engine_tp)  # the engine's, this rank's
    ev.own = set(mine)
    ev.timings = {"load_s": round(time.time() - ev.t0, 2), "engines": {}, "checkpoints": {}}


def engine_key(path, kind, prompts, eos_ids):
    """Checkpoints with the same key share one engine (weights swapped by sync_weights): the same config apart from
    names and dtype (architecture, sizes, rotary settings), the same prompt ids and end-of-turn ids (tokenizer and
    chat template). A hub id has no files to load weights from: its own engine."""
    from transformers import AutoConfig

    if kind == "hub":
        return "hub:" + path
    config = AutoConfig.from_pretrained(path).to_dict()
    for key in ("_name_or_path", "_model_name_or_path", "_commit_hash", "transformers_version", "dtype", "torch_dtype"):
        config.pop(key, None)
    return hashlib.sha1(json.dumps([config, prompts, sorted(eos_ids)], sort_keys=True, default=str).encode()).hexdigest()


def replace_out(out, master):
    """--overwrite: remove what an earlier eval.py wrote in --out (its journal, samples, summaries, plot), saying so."""
    import shutil

    mine = [out / n for n in ("journal", "samples.jsonl", "summary.json", "summary.md", "budget.png") if (out / n).exists()]
    if master and mine:
        print(f"[setup] --overwrite: replacing {', '.join(p.name for p in mine)} in {out}", file=sys.stderr, flush=True)
        for p in mine:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    from infra.collectives import barrier

    barrier()


def check_batch_invariance(args, world, say):
    """--batch-invariant: vLLM's mode (VLLM_BATCH_INVARIANT, read when vLLM loads) where it has one: CUDA; elsewhere one
    line. Without it, several ranks in a reduced dtype say what they promise: a rank batches its own shard, and
    bf16 or fp16 arithmetic may break a near-tie between two tokens otherwise than one process would."""
    import torch

    if args.batch_invariant:
        if args.engine != "vllm" or not torch.cuda.is_available():
            die("--batch-invariant: vLLM has batch-invariant kernels on CUDA GPUs only (not on CPU, nor --engine hf); "
                "float32 gives the same samples on any number of ranks")
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
    elif world > 1 and args.engine_dtype != "float32":
        say(f"note: {world} ranks in {args.engine_dtype}: each rank batches its own shard, and a near-tie between two "
            f"tokens can break otherwise than in one process (--batch-invariant on CUDA, or --engine-dtype float32, "
            f"makes the samples identical)")


def weights_fingerprint(path, kind):
    """What a checkpoint's generations depend on, by content (a checkpoint retrained into the same path is another
    one): the SHA-256 of its weight files, from its training checkpoint's manifest where it has one (hashed as it was
    written), else read now; a hub id by name."""
    from infra import checkpoint

    if kind == "hub":
        return path
    files = sorted(p.name for p in Path(path).iterdir() if p.suffix in (".safetensors", ".bin"))
    manifest = Path(path).parent / checkpoint.MANIFEST
    known = json.loads(manifest.read_text()) if kind == "checkpoint" and manifest.exists() else {}
    digests = [d if (d := known.get(f"{Path(path).name}/{f}")) and d[1] else checkpoint.file_digest(Path(path) / f)
               for f in files]
    return hashlib.sha256(json.dumps(list(zip(files, digests))).encode()).hexdigest()


def checkpoint_tensors(path):
    """(name, tensor) pairs of a Hugging Face directory's safetensors files (its index's), one tensor at a time
    (sync_weights)."""
    from safetensors import safe_open

    from infra.weights import weight_files

    for f in weight_files(path):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)
