"""Rollouts: a colocated generation engine and multi-turn intervention sampling on token ids.

    python rollout.py --model smollm2 --data math500 --limit 8 --n 2 --max-turns 2 --turn-tokens 128 \
        --temperature 1.0 --seed 0 --out out/rollout.jsonl [--engine vllm|hf]

A turn generates at most `turn_tokens`. A turn that ends with EOS or a stop string is finished; one that
hits the budget (and, with --intervene-on no-answer|both, one that ends with EOS but without an answer)
gets the intervention sentence appended and the model continues, at most `max_turns` times. The result
is one trajectory per sample: response_ids = policy tokens and intervention tokens interleaved,
action_mask = 1 exactly on the policy's tokens. Everything stays on token ids: the model's tokens are
never decoded and re-tokenized between turns; the intervention is tokenized once, wrapped as
"\n\n<text>\n\n" so that it reads as its own paragraph even when the budget cut a word in half.

Engines share one interface (`generate`, `sleep`, `wake_up`, `sync_weights`): vLLM in-process (colocated
with the trainer; under torchrun each rank owns an engine and samples its shard) and a batched
transformers backend with KV cache for debugging and cross-checks.
"""
import argparse
import json
import os
import time
from collections import namedtuple
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from model import die, load_causal_lm, load_tokenizer, resolve_model
from reward import extract_answer  # reward.py depends on nothing: "no answer" means the same to both

INTERVENTIONS = {
    "paper": "Warning! Your previous action is invalid. Please try again:",
    "reference": "My previous action is invalid. If I want to give the final answer, I should put the answer "
                 "between <answer> and </answer>. Let me try again:",
}
INTERVENE_ON = ("budget", "no-answer", "both")

# token_ids/logprobs: lists for one completion; stopped: ended on EOS or a stop string (else: length cap)
Completion = namedtuple("Completion", "token_ids logprobs stopped")


class RolloutTimeout(RuntimeError):
    """An engine call ran past --rollout-timeout; nothing from the call is returned."""


class PromptTooLong(ValueError):
    """A prompt is longer than --max-prompt-length (and --truncate-prompts is off)."""


def _per_prompt(value, m):
    return list(value) if isinstance(value, (list, tuple)) else [value] * m


def _deadline(timeout):
    return None if not timeout else time.monotonic() + timeout


def _check_deadline(deadline, timeout, done, total):
    if deadline is not None and time.monotonic() > deadline:
        raise RolloutTimeout(f"engine call exceeded --rollout-timeout {timeout:g}s "
                             f"({done}/{total} requests done); no partial batch is returned")


# ----------------------------------------------------------------------------- vLLM engine

def _vllm_reload_weights(llm, named_tensors):
    """Reload full (name, tensor) pairs in HF names into the in-process worker (UniProcExecutor; also
    under external_launcher). Private paths that move between vLLM versions: keep every one of them here."""
    worker = llm.llm_engine.model_executor.driver_worker.worker
    # load_weights fails after start-up on the CPU backend (weights are repacked); reload_weights works.
    worker.reload_weights(weights_iterator=iter(named_tensors))
    lm_head = getattr(worker.model_runner.get_model(), "lm_head", None)
    if hasattr(lm_head, "cpu_linear"):
        # vLLM 0.32 CPU: a tied lm_head loads no tensor of its own, so its packed GEMM kept the old
        # embedding matrix while the embedding itself was updated; repack it from the current weight.
        lm_head.quant_method.process_weights_after_loading(lm_head)
    llm.reset_prefix_cache()  # cached KV was computed by the old weights


class VLLMEngine:
    def __init__(self, model_path, dtype="bfloat16", seed=0, gpu_memory_utilization=0.5, max_model_len=None,
                 distributed=False, enforce_eager=False, kv_cache_gib=None):
        # In-process engine: the trainer and the sampler share one process per rank (no engine subprocess).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        set_threads = torch.set_num_threads
        from vllm import LLM
        from vllm.platforms import current_platform

        kwargs = {}
        self.on_cpu = current_platform.is_cpu()
        if self.on_cpu:
            # Without an explicit KV size the CPU backend reserves gpu_memory_utilization of *host* RAM.
            kv = kv_cache_gib if kv_cache_gib is not None else float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", 2))
            kwargs["kv_cache_memory_bytes"] = int(kv * 2**30)
            # The prefix cache reuses whole blocks only: with the CPU default of 128, every turn re-prefills up to
            # 127 tokens per sample; 32 (the smallest the CPU attention kernels take) measured ~20% faster multi-turn.
            kwargs["block_size"] = 32
        else:
            kwargs["enable_sleep_mode"] = True  # weights offloaded / KV cache freed while the trainer runs
        if distributed:
            # Colocated under torchrun: every rank builds its own engine (tp=1) and samples its own shard.
            kwargs.update(distributed_executor_backend="external_launcher",
                          data_parallel_size=int(os.environ.get("WORLD_SIZE", 1)))
        self.llm = LLM(model=model_path, dtype=dtype, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
                       max_model_len=max_model_len, enable_prefix_caching=True, enforce_eager=enforce_eager,
                       tensor_parallel_size=1, logprobs_mode="processed_logprobs", **kwargs)
        # The CPU worker replaces torch.set_num_threads with a no-op; give the colocated trainer it back.
        torch.set_num_threads = set_threads
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.sleeping = False
        self.calls = 0  # request ids: f'{call}-{i}'

    def generate(self, prompt_token_ids, max_tokens, temperature=1.0, top_p=1.0, seed=None, stop=(), n=1,
                 eos_ids=None, timeout=None):
        """prompt_token_ids: list of M id lists; max_tokens, seed: one value or one per prompt.
        Returns M lists of n Completions. Log-probs are vLLM's processed ones (after temperature/top-p),
        i.e. what a trainer computes with the same temperature."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        m = len(prompt_token_ids)
        eos_ids = [self.tokenizer.eos_token_id] if eos_ids is None else list(eos_ids)
        # n > 1 becomes n requests of one completion each (seed + k): every completion is its own stream,
        # and the step loop below sees one finished output per request.
        flat = [(i, k) for i in range(m) for k in range(n)]
        max_tokens, seed = _per_prompt(max_tokens, m), _per_prompt(seed, m)
        params = [SamplingParams(n=1, max_tokens=max_tokens[i], temperature=temperature, top_p=top_p,
                                 seed=None if seed[i] is None else seed[i] + k,
                                 stop=list(stop) or None, include_stop_str_in_output=True,
                                 ignore_eos=True, stop_token_ids=eos_ids,  # exactly eos_ids stop a turn
                                 logprobs=0, detokenize=bool(stop))  # text only for stop-string matching
                  for i, k in flat]
        prompts = [TokensPrompt(prompt_token_ids=list(prompt_token_ids[i])) for i, _ in flat]
        deadline = _deadline(timeout)
        engine = self.llm.llm_engine
        # add_request + our own step loop (what LLM.generate does) so the deadline is checked every step.
        self.calls += 1
        req_ids = [f"{self.calls}-{i}-{k}" for i, k in flat]
        for rid, prompt, param in zip(req_ids, prompts, params):
            engine.add_request(rid, prompt, param)
        done = {}
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                _check_deadline(deadline, timeout, len(done), len(flat))
        except BaseException:
            engine.abort_request([r for r in req_ids if r not in done])
            raise
        results = [[] for _ in range(m)]
        for rid, (i, _) in zip(req_ids, flat):
            o = done[rid].outputs[0]
            results[i].append(Completion(list(o.token_ids), [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)],
                                         o.finish_reason == "stop"))
        return results

    def sleep(self, level=1):
        """Free accelerator memory for training (level 1: offload weights, drop KV). No-op on CPU."""
        if not self.on_cpu and not self.sleeping:
            self.llm.sleep(level=level)
            self.sleeping = True

    def wake_up(self):
        if self.sleeping:
            self.llm.wake_up()
            self.llm.reset_prefix_cache()  # the KV cache was dropped
            self.sleeping = False

    def close(self):
        """Shut the engine down. Under torchrun this also destroys the default process group (vLLM's
        teardown does), so call it after the trainer's last collective, instead of destroy_process_group."""
        self.llm.llm_engine.engine_core.shutdown()

    def sync_weights(self, named_tensors):
        """Load full (name, tensor) pairs in HF checkpoint names, e.g. model.full_state_dict(...)."""
        _vllm_reload_weights(self.llm, named_tensors)


# ----------------------------------------------------------------------------- transformers engine

class HFEngine:
    """Batched sampling with a KV cache in plain transformers: slow, simple, for debugging and cross-checks."""

    def __init__(self, model_path, dtype="float32", seed=0, max_model_len=None, device=None):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = load_causal_lm(model_path, dtype=getattr(torch, dtype)).to(self.device).eval()
        self.tokenizer = load_tokenizer(model_path)
        self.max_model_len = max_model_len or self.model.config.max_position_embeddings
        self.seed = seed

    @torch.no_grad()
    def generate(self, prompt_token_ids, max_tokens, temperature=1.0, top_p=1.0, seed=None, stop=(), n=1,
                 eos_ids=None, timeout=None):
        from transformers import DynamicCache

        m = len(prompt_token_ids)
        eos = {self.tokenizer.eos_token_id} if eos_ids is None else set(eos_ids)
        rows = [list(p) for p in prompt_token_ids for _ in range(n)]
        limits = [mt for mt in _per_prompt(max_tokens, m) for _ in range(n)]
        seeds = [(self.seed if s is None else s) + k for s in _per_prompt(seed, m) for k in range(n)]
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
            if not any(active):
                break
            mask = torch.cat([mask, mask.new_ones(B, 1)], 1)
            pos = pos[:, -1:] + 1
            logits = self.model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, past_key_values=cache,
                                use_cache=True).logits[:, -1].float()
        comps = [Completion(out_ids[i], out_lp[i], stopped[i]) for i in range(B)]
        return [comps[j * n:(j + 1) * n] for j in range(m)]

    def sleep(self, level=1):
        pass  # nothing to free: the debugging backend is not colocated with an accelerator trainer

    def wake_up(self):
        pass

    def close(self):
        pass

    @torch.no_grad()
    def sync_weights(self, named_tensors):
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        for name, tensor in named_tensors:
            if name in params:
                params[name].copy_(tensor)


def make_engine(model_path, kind="vllm", dtype="bfloat16", seed=0, gpu_memory_utilization=0.5, max_model_len=None,
                distributed=False, enforce_eager=False):
    if kind == "vllm":
        return VLLMEngine(model_path, dtype=dtype, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
                          max_model_len=max_model_len, distributed=distributed, enforce_eager=enforce_eager)
    if kind == "hf":
        return HFEngine(model_path, dtype=dtype, seed=seed, max_model_len=max_model_len)
    raise ValueError(f"unknown engine kind {kind!r} (vllm|hf)")


# ----------------------------------------------------------------------------- multi-turn sampling

def intervention_ids(tokenizer, text):
    """Token ids of the intervention: a INTERVENTIONS key or literal text, wrapped as its own paragraph."""
    text = INTERVENTIONS.get(text, text)
    return tokenizer.encode(f"\n\n{text}\n\n", add_special_tokens=False)


def has_answer(text):
    """Is there a final answer in the text, by reward.py's own extraction (so "no answer" means the same to both)?"""
    return extract_answer(text) is not None


def prepare_prompts(prompt_ids, max_prompt_length=None, truncate=False):
    """Reject (PromptTooLong) or left-truncate prompts longer than max_prompt_length -> (prompts, n_truncated).
    Left truncation keeps the end of the prompt: the chat template's assistant header."""
    if not max_prompt_length:
        return [list(p) for p in prompt_ids], 0
    out, cut = [], 0
    for i, p in enumerate(prompt_ids):
        if len(p) > max_prompt_length:
            if not truncate:
                raise PromptTooLong(f"prompt {i} has {len(p)} tokens > --max-prompt-length {max_prompt_length} "
                                    f"(pass --truncate-prompts to left-truncate)")
            p, cut = p[-max_prompt_length:], cut + 1
        out.append(list(p))
    return out, cut


def sample_seed(seed, prompt_index, sample_index, turn):
    """One seed per (prompt, sample, turn): reproducible for a fixed --seed, independent of batch and shard."""
    return int(np.random.SeedSequence([seed, prompt_index, sample_index, turn]).generate_state(1)[0] >> 1)


class Rollout(list):
    """Trajectory dicts, prompt-major (prompt_index, then sample_index); .stats holds timing and counts."""
    stats = {}


def sample(engine, prompt_ids, *, n=1, turn_tokens, max_turns=0, max_response_tokens=None, temperature=1.0,
           top_p=1.0, seed=0, stop=(), intervene_on="budget", intervention_ids, eos_ids=None, timeout=None,
           prompt_indices=None, desc=None):
    """Multi-turn intervention sampling. prompt_ids: list of id lists; prompt_indices: their global indices
    (for shards; default 0..len-1) -- seeds and `prompt_index` use them, so a shard reproduces its part of
    a single-engine run. Each turn sends every still-active sample in one engine call (prompt + response so
    far; the prefix cache spares recomputing earlier turns). desc: label of a transient progress bar over
    finished trajectories, advanced after each turn (None: no bar)."""
    if intervene_on not in INTERVENE_ON:
        raise ValueError(f"intervene_on must be one of {INTERVENE_ON}, got {intervene_on!r}")
    if turn_tokens < 1 or max_turns < 0 or n < 1:
        raise ValueError("need turn_tokens >= 1, max_turns >= 0, n >= 1")
    iv = list(intervention_ids)
    eos = {engine.tokenizer.eos_token_id} if eos_ids is None else set(eos_ids)
    indices = list(range(len(prompt_ids))) if prompt_indices is None else list(prompt_indices)
    max_resp = max_response_tokens or 2**62
    ctx = engine.max_model_len
    trajs = []
    for p, pi in zip(prompt_ids, indices):
        if len(p) >= ctx:
            raise PromptTooLong(f"prompt {pi} has {len(p)} tokens, no room left in max_model_len {ctx}")
        for j in range(n):
            trajs.append(dict(prompt_ids=list(p), response_ids=[], action_mask=[], rollout_logprobs=[], turns=0,
                              interventions=0, finished=False, truncated=False, prompt_index=pi, sample_index=j))

    def room(t):  # tokens this trajectory may still add, under both caps
        return min(max_resp - len(t["response_ids"]), ctx - len(t["prompt_ids"]) - len(t["response_ids"]))

    active, t0, calls = list(trajs), time.perf_counter(), 0
    bar = tqdm(total=len(trajs), desc=desc, disable=desc is None, leave=False, unit="traj")
    for turn in range(max_turns + 1):
        if not active:
            break
        bar.set_postfix(turn=turn + 1)
        budgets = [min(turn_tokens, room(t)) for t in active]
        seeds = [sample_seed(seed, t["prompt_index"], t["sample_index"], turn) for t in active]
        outs = engine.generate([t["prompt_ids"] + t["response_ids"] for t in active], budgets,
                               temperature=temperature, top_p=top_p, seed=seeds, stop=stop, n=1,
                               eos_ids=eos_ids, timeout=timeout)
        calls += 1
        still = []
        for t, (c,), budget in zip(active, outs, budgets):
            assert len(c.token_ids) <= budget, "engine exceeded max_tokens"
            t["response_ids"] += c.token_ids
            t["action_mask"] += [1] * len(c.token_ids)
            t["rollout_logprobs"] += c.logprobs
            t["turns"] += 1
            if c.stopped:  # EOS or stop string: done, unless EOS came without an answer and we intervene on that
                want = (intervene_on != "budget" and c.token_ids[-1] in eos
                        and not has_answer(engine.tokenizer.decode(t["response_ids"], skip_special_tokens=True)))
            else:  # cut by a budget: intervene only if it was the turn budget (not a cap) and we do on budget
                want = intervene_on != "no-answer" and budget == turn_tokens
            if want and t["interventions"] < max_turns and room(t) > len(iv):  # >= 1 token after the intervention
                t["response_ids"] += iv
                t["action_mask"] += [0] * len(iv)
                t["rollout_logprobs"] += [0.0] * len(iv)
                t["interventions"] += 1
                still.append(t)
            else:
                t["finished"], t["truncated"] = c.stopped, not c.stopped
        bar.update(len(active) - len(still))
        active = still
    bar.close()
    for t in trajs:
        t["response_text"] = engine.tokenizer.decode(t["response_ids"], skip_special_tokens=True)
    rollout = Rollout(trajs)
    rollout.stats = dict(seconds=time.perf_counter() - t0, engine_calls=calls,
                         action_tokens=sum(sum(t["action_mask"]) for t in trajs))
    return rollout


def to_batch(rollout, pad_id):
    """Trainer tensors: prompts left-padded [B, P], responses right-padded [B, R] (R >= 1)."""
    B = len(rollout)
    P = max(len(t["prompt_ids"]) for t in rollout)
    R = max(1, max(len(t["response_ids"]) for t in rollout))
    batch = dict(prompt_ids=torch.full((B, P), pad_id, dtype=torch.long),
                 prompt_mask=torch.zeros(B, P, dtype=torch.long),
                 response_ids=torch.full((B, R), pad_id, dtype=torch.long),
                 response_mask=torch.zeros(B, R, dtype=torch.long),
                 action_mask=torch.zeros(B, R, dtype=torch.long),
                 rollout_logprobs=torch.zeros(B, R, dtype=torch.float32))
    for i, t in enumerate(rollout):
        p, r = len(t["prompt_ids"]), len(t["response_ids"])
        batch["prompt_ids"][i, P - p:] = torch.tensor(t["prompt_ids"], dtype=torch.long)
        batch["prompt_mask"][i, P - p:] = 1
        if r:
            batch["response_ids"][i, :r] = torch.tensor(t["response_ids"], dtype=torch.long)
            batch["response_mask"][i, :r] = 1
            batch["action_mask"][i, :r] = torch.tensor(t["action_mask"], dtype=torch.long)
            batch["rollout_logprobs"][i, :r] = torch.tensor(t["rollout_logprobs"], dtype=torch.float32)
    return batch


def shard_indices(num_prompts, rank, world_size):
    """Strided shard of prompt indices for this rank: disjoint, covering, balanced to within one."""
    return list(range(rank, num_prompts, world_size))


# ----------------------------------------------------------------------------- CLI

def summarize(rollout, seconds):
    tokens = sum(len(t["response_ids"]) for t in rollout)
    actions = sum(sum(t["action_mask"]) for t in rollout)
    B = max(1, len(rollout))
    return dict(trajectories=len(rollout), action_tokens=actions, seconds=round(seconds, 3),
                tokens_per_s=round(actions / max(seconds, 1e-9), 1), response_tokens=tokens,
                mean_turns=round(sum(t["turns"] for t in rollout) / B, 3),
                intervened=round(sum(t["interventions"] > 0 for t in rollout) / B, 3),
                finished=round(sum(t["finished"] for t in rollout) / B, 3))


def write_jsonl(rows, path):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)  # atomic: a reader never sees half a file


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        die(message)


def parse_args(argv=None):
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="alias (smollm2) or HF model directory")
    p.add_argument("--data", required=True, help="bundled dataset name or .jsonl/.json/.parquet path")
    p.add_argument("--system-prompt", default=None, help="SYSTEM_PROMPTS key or literal text (data.py default)")
    p.add_argument("--limit", type=int, default=None, help="use the first N records")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--max-turns", type=int, default=3, help="max interventions per sample")
    p.add_argument("--turn-tokens", type=int, default=1000, help="token budget of one turn")
    p.add_argument("--max-response-tokens", type=int, default=None, help="cap on a whole response (all turns)")
    p.add_argument("--max-prompt-length", type=int, default=None, help="longest prompt in tokens")
    p.add_argument("--truncate-prompts", action="store_true", help="left-truncate longer prompts instead of failing")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, default=0, help="base seed; per-sample seeds derive from it")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable), kept in the output")
    p.add_argument("--intervene-on", choices=INTERVENE_ON, default="budget",
                   help="budget: turn hit its budget; no-answer: ended with EOS but no answer; both")
    p.add_argument("--intervention-text", default="paper", help="paper | reference | literal text")
    p.add_argument("--engine", choices=("vllm", "hf"), default="vllm", help="generation backend")
    p.add_argument("--dtype", default=None, help="engine dtype (default: bfloat16 for vllm, float32 for hf)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="vLLM accelerator memory share")
    p.add_argument("--max-model-len", type=int, default=None, help="engine context length (default: model's)")
    p.add_argument("--enforce-eager", action="store_true", help="vLLM: skip torch.compile (faster start-up)")
    p.add_argument("--rollout-timeout", type=float, default=None, help="seconds per engine call before failing")
    p.add_argument("--out", required=True, help="output .jsonl, one trajectory per line")
    args = p.parse_args(argv)
    for flag in ("n", "turn_tokens", "limit", "max_response_tokens", "max_prompt_length", "max_model_len"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            die(f"--{flag.replace('_', '-')} must be >= 1")
    if args.max_turns < 0:
        die("--max-turns must be >= 0")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        die("--temperature must be >= 0 and --top-p in (0, 1]")
    if args.rollout_timeout is not None and args.rollout_timeout <= 0:
        die("--rollout-timeout must be > 0")
    if not args.intervention_text.strip():
        die("--intervention-text is empty")
    return args


def main(argv=None):
    args = parse_args(argv)
    import data

    model_path = resolve_model(args.model)
    try:
        records = data.load_dataset(args.data, system_prompt=args.system_prompt, limit=args.limit)
    except (data.DataError, OSError) as e:
        die(f"--data {args.data}: {e}")
    tokenizer = load_tokenizer(model_path)
    try:
        prompts, n_cut = prepare_prompts([data.prompt_ids(tokenizer, r["messages"]) for r in records],
                                         args.max_prompt_length, args.truncate_prompts)
    except PromptTooLong as e:
        die(f"--data {args.data}: {e}")
    dtype = args.dtype or ("bfloat16" if args.engine == "vllm" else "float32")
    engine = make_engine(model_path, kind=args.engine, dtype=dtype, seed=args.seed,
                         gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
                         enforce_eager=args.enforce_eager)
    t0 = time.perf_counter()
    try:
        rollout = sample(engine, prompts, n=args.n, turn_tokens=args.turn_tokens, max_turns=args.max_turns,
                         max_response_tokens=args.max_response_tokens, temperature=args.temperature, top_p=args.top_p,
                         seed=args.seed, stop=args.stop, intervene_on=args.intervene_on,
                         intervention_ids=intervention_ids(tokenizer, args.intervention_text),
                         eos_ids=[tokenizer.eos_token_id], timeout=args.rollout_timeout)
    except (RolloutTimeout, PromptTooLong) as e:
        die(str(e))
    seconds = time.perf_counter() - t0
    for t in rollout:
        t["id"] = records[t["prompt_index"]]["id"]
    write_jsonl(rollout, args.out)
    summary = dict(summarize(rollout, seconds), prompts_truncated=n_cut, out=args.out)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
