"""train.py's memory per GPU from a model's config alone, and the cheapest flags that fit a node.

    python bench/scaling.py                                   # the four R1-Distill-Qwen shapes on 8 x 80 GB
    python bench/scaling.py --model 14B --engine-tp 4 --adv grpo --grad-checkpointing   # one flag set, checked
    python bench/scaling.py --config /path/to/config.json --gpus 8 --gpu-gib 79.6
    python bench/scaling.py --write docs/scaling.md           # regenerate the doc's tables

Computed, not measured; the constants come from docs/memory.md (one H200, 1.5B shape). GiB = 2^30 bytes.
Trainer (FSDP2, fp32 master weights, sharded over the N GPUs):
  at rest     actor 12 B/param (weights 4 + Adam m, v 8), critic the same (--adv gae), reference 4 B/param, / N
  update      + actor fp32 gradients 4 B/param / N, + max(activations + gathered bf16 units, optimiser temporaries)
  activations 75 B x hidden x layers per micro-batch token (fitted on the 1.5B measurement, so it already holds
              that shape's temporaries); / 7 with --grad-checkpointing (measured <= 0.41 MiB/token at 1.5B, an upper
              bound: the optimiser's peak hid it); tokens = max(--micro-batch-tokens, longest sequence)
  gathered    the root unit (embeddings, final norm, head) and one decoder layer in bf16, whole
  optimiser   foreach AdamW temporaries, about one fp32 copy of the shard (4 B/param / N)
  --offload   parameters, gradients, Adam state and the step on the host: the GPU keeps activations and gathered units
Engine (vLLM, one per K contiguous ranks, asleep during the update):
  awake       reserves --gpu-memory-utilization x the card: bf16 weights / K + its activations and CUDA graphs
              (assumed 3 GiB) + KV cache (the rest; each GPU holds 1/K of the KV heads)
Peaks: rollout = state at rest + the engine's share + context; update = the update phase + context (CUDA context,
NCCL buffers, fragmentation: assumed 3 GiB). A plan fits when both stay under (1 - --margin) of the card, the KV
cache holds at least one longest sequence (vLLM refuses to start otherwise), K divides the attention heads, the KV
heads and the GPUs, and --offload's host state fits --host-gib.
"""
import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from infra import engines  # noqa: E402  (the --engine-tp rule: one copy)
from infra.cli import ArgumentParser  # noqa: E402  (bad flags: one line)

GIB = 2 ** 30
ACT_BYTES = 75            # per token, x hidden x layers, no checkpointing (docs/memory.md's rule of thumb)
CKPT_DIVISOR = 7          # --grad-checkpointing keeps about a seventh
ENGINE_ACT_GIB = 3.0      # vLLM's forward activations and CUDA graphs inside its share (assumed)
CONTEXT_GIB = 3.0         # CUDA context, NCCL buffers, allocator fragmentation (assumed)
INTERVENTION_TOKENS = 40  # one intervention's text, as bench/gpu_bench.py's trajectories


def _qwen2(hidden, layers, heads, kv_heads, intermediate, vocab):
    return dict(model_type="qwen2", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=vocab,
                tie_word_embeddings=False)


# config.json of deepseek-ai/DeepSeek-R1-Distill-Qwen-{1.5B,7B,14B,32B} on the Hugging Face hub, read from copies of
# those files there (huggingface.co/XelotX/DeepSeek-R1-Distill-Qwen-32B, a duplicate of the official repository;
# RealSafe/RealSafe-R1-14B and neody/r1-14b-awq, both from DeepSeek-R1-Distill-Qwen-14B snapshots; 7B:
# mlfoundations-dev/DeepSeek-R1-Distill-Qwen-7B_OpenThoughts3, from snapshot 916b56a; 1.5B: as bench/gpu_bench.py).
# head_dim = hidden / heads = 128 in all four; none ties its head.
SHAPES = {
    "1.5B": _qwen2(1536, 28, 12, 2, 8960, 151936),
    "7B": _qwen2(3584, 28, 28, 4, 18944, 152064),
    "14B": _qwen2(5120, 48, 40, 8, 13824, 152064),
    "32B": _qwen2(5120, 64, 40, 8, 27648, 152064),
}
HUB = "DeepSeek-R1-Distill-Qwen-{}"

# docs/memory.md, one H200, one rank, 1.5B shape, --adv grpo (actor + reference), GiB of torch.cuda.memory_allocated
MEASURED_1_5B = dict(state=27.4,  # update: (--grad-checkpointing, largest micro-batch's tokens) -> peak
                     update={(False, 13286): 73.5, (False, 16384): 83.3, (True, 13286): 40.7, (True, 16384): 40.7})


def head_dim(cfg):
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def param_counts(cfg):
    """Parameters of a Qwen2- or Llama-style causal LM from its config -> dict (counts): embed, layer (one decoder
    layer: q, k, v, o projections, SwiGLU MLP, two RMSNorms), norm, head (0 when tied), actor, critic (the backbone
    and a hidden -> 1 value head with bias, model.ValueModel), root (the FSDP2 root unit: embed, norm, head)."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * head_dim(cfg)
    kv = cfg["num_key_value_heads"] * head_dim(cfg)
    bias = cfg.get("attention_bias", False)                   # Llama-style: on q, k, v and o, or on none
    qkv_bias = bias or cfg.get("model_type") == "qwen2"        # Qwen2: on q, k, v always, never on o
    attn = h * q + 2 * h * kv + q * h + qkv_bias * (q + 2 * kv) + bias * h
    layer = attn + 3 * h * inter + 2 * h
    embed, norm = vocab * h, h
    head = 0 if cfg.get("tie_word_embeddings") else vocab * h
    backbone = embed + cfg["num_hidden_layers"] * layer + norm
    return dict(embed=embed, layer=layer, norm=norm, head=head, actor=backbone + head, critic=backbone + h + 1,
                root=embed + norm + head)


def lora_params(cfg, rank):
    """Trained parameters of --lora-rank R on every linear layer of every decoder block (lora.TARGETS): r x (in + out)
    for q, k, v, o and the three MLP projections."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * head_dim(cfg), cfg["num_key_value_heads"] * head_dim(cfg)
    return rank * cfg["num_hidden_layers"] * ((h + q) * 2 + (h + kv) * 2 + (h + inter) * 3)


def kv_bytes_per_token(cfg):
    """bf16 K and V of one token in all layers of the whole engine (bytes; a TP rank holds 1/K of it)."""
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim(cfg) * 2


def tp_sizes(cfg, gpus):
    """The --engine-tp values a model allows on this node (engines.tp_sizes)."""
    return engines.tp_sizes(cfg["num_attention_heads"], cfg["num_key_value_heads"], gpus)


def check_tp(cfg, k, gpus):
    """Refuse an --engine-tp the model or the node cannot split into (ValueError)."""
    if k not in tp_sizes(cfg, gpus):
        raise ValueError(f"--engine-tp {k}: must divide the attention heads ({cfg['num_attention_heads']}), the KV "
                         f"heads ({cfg['num_key_value_heads']}) and the GPUs ({gpus}); allowed: "
                         f"{', '.join(map(str, tp_sizes(cfg, gpus)))}")


def seq_tokens(setup):
    """The longest trajectory: prompt + every turn at full budget + every intervention (tokens)."""
    response = setup.max_response_tokens or ((setup.max_turns + 1) * setup.turn_tokens
                                             + setup.max_turns * INTERVENTION_TOKENS)
    return setup.prompt_tokens + response


def auto_utilization(rest, setup):
    """The largest --gpu-memory-utilization the rollout phase leaves room for, in steps of 0.05, at most 0.9."""
    room = (1 - setup.margin) * setup.gpu_gib * GIB - rest - CONTEXT_GIB * GIB
    return max(0.0, min(0.9, math.floor(room / (setup.gpu_gib * GIB) * 20 + 1e-9) / 20))


def memory(cfg, plan, setup):
    """Per-GPU bytes of one flag set. plan: dict(engine_tp, offload, grad_checkpointing, micro_batch_tokens, adv,
    gpu_memory_utilization (None: auto_utilization)). setup: the node and the rollout (gpus, gpu_gib, margin,
    host_gib, prompt and response lengths, batch_size, samples_per_prompt). -> dict of bytes and the verdict."""
    p, n, k = param_counts(cfg), setup.gpus, plan["engine_tp"]
    check_tp(cfg, k, n)
    gae, off = plan["adv"] == "gae", plan["offload"]
    m = dict(plan)
    on_gpu = 0 if off else 1
    m["lora_rank"] = r = plan.get("lora_rank", 0)
    # trained parameters (fp32 weights 4 B + Adam 8 B, gradients 4 B) and frozen ones (LoRA's base: bf16, 2 B)
    trained = lora_params(cfg, r) if r else p["actor"]
    frozen = p["actor"] if r else 0
    critic_trained = trained + (cfg["hidden_size"] + 1 if r else p["critic"] - p["actor"])  # + the value head
    m["actor_state"] = on_gpu * (12 * trained + 2 * frozen) / n
    m["critic_state"] = on_gpu * (12 * critic_trained + 2 * (p["critic"] - cfg["hidden_size"] - 1) * bool(r)) / n \
        if gae else 0
    m["ref_state"] = on_gpu * 4 * p["actor"] / n if not r else 0  # LoRA: the base with the adapters off
    m["rest"] = m["actor_state"] + m["critic_state"] + m["ref_state"]
    if m["gpu_memory_utilization"] is None:
        m["gpu_memory_utilization"] = auto_utilization(m["rest"], setup)
    # rollout: the engine's share of the card, split into weights, activations and the KV cache
    seq = seq_tokens(setup)
    m["engine"] = m["gpu_memory_utilization"] * setup.gpu_gib * GIB
    m["engine_weights"] = 2 * p["actor"] / k
    m["engine_act"] = ENGINE_ACT_GIB * GIB
    m["kv"] = m["engine"] - m["engine_weights"] - m["engine_act"]
    m["kv_tokens"] = max(m["kv"], 0) * k / kv_bytes_per_token(cfg)          # per engine (K GPUs)
    share = setup.batch_size * setup.samples_per_prompt * k / n * seq         # tokens one engine samples, full length
    m["held"] = min(1.0, m["kv_tokens"] / share)
    m["context"] = CONTEXT_GIB * GIB
    m["rollout_peak"] = m["rest"] + m["engine"] + m["context"]
    # update: the actor's (the larger model; the critic updates after the actor's gradients are freed)
    m["tokens"] = max(plan["micro_batch_tokens"], seq)
    per_token = ACT_BYTES * cfg["hidden_size"] * cfg["num_hidden_layers"]
    m["act"] = m["tokens"] * per_token / (CKPT_DIVISOR if plan["grad_checkpointing"] else 1)
    m["gathered"] = 2 * (p["root"] + p["layer"])
    m["grads"] = on_gpu * 4 * trained / n
    m["opt_temp"] = on_gpu * 4 * trained / n
    m["update_peak"] = m["rest"] + m["grads"] + max(m["act"] + m["gathered"], m["opt_temp"]) + m["context"]
    host = 16 * trained + 2 * frozen + (16 * critic_trained + 2 * frozen * bool(r) if gae else 0)
    m["host"] = (host + 4 * p["actor"] * (not r)) if off else 0  # per node
    cap = (1 - setup.margin) * setup.gpu_gib * GIB
    m["fits"] = (m["rollout_peak"] <= cap and m["update_peak"] <= cap and m["kv_tokens"] >= seq
                 and m["host"] <= setup.host_gib * GIB)
    return m


def search(cfg, setup, adv, lora_rank=0, offloads=(False, True)):
    """The cheapest plan that fits with this --adv, or None. Cheapest: no --offload (the step on the host) before
    no --grad-checkpointing (recomputes the forward) before the largest micro-batch (--micro-batch-tokens halved
    until one sequence goes alone: more all-gathers only); then the K whose engine holds the most of its rollout
    at once, the smallest that holds all of it (its utilisation is the largest the rollout phase allows)."""
    seq = seq_tokens(setup)
    micro = [setup.micro_batch_tokens]
    while micro[-1] > seq:  # the last one below the longest sequence: each sequence then goes alone
        micro.append(micro[-1] // 2)
    for offload in offloads:
        for ckpt in (False, True):
            for tokens in micro:
                plans = [memory(cfg, dict(engine_tp=k, offload=offload, grad_checkpointing=ckpt,
                                          micro_batch_tokens=tokens, adv=adv, gpu_memory_utilization=None,
                                          lora_rank=lora_rank), setup)
                         for k in tp_sizes(cfg, setup.gpus)]
                plans = [m for m in plans if m["fits"]]
                if plans:
                    return max(plans, key=lambda m: (round(m["held"], 2), -m["engine_tp"]))
    return None


def flags(m):
    """train.py's flags of a plan."""
    out = [f"--lora-rank {m['lora_rank']}"] if m.get("lora_rank") else []
    out += [f"--engine-tp {m['engine_tp']}"]
    out += [f"--adv {m['adv']}"] if m["adv"] != "gae" else []
    out += ["--offload"] if m["offload"] else []
    out += ["--grad-checkpointing"] if m["grad_checkpointing"] else []
    return " ".join(out + [f"--micro-batch-tokens {m['micro_batch_tokens']}",
                           f"--gpu-memory-utilization {m['gpu_memory_utilization']:.2f}"])


def command(name, m, gpus):
    return f"torchrun --nproc_per_node {gpus} train.py --model /path/to/{name} --data data/limo {flags(m)}"


def gib(b):
    return f"{b / GIB:.1f}"


def table(columns, setup):
    """Markdown: one row per component, one column per (title, memory dict)."""
    n, gpu = setup.gpus, f"{setup.gpu_gib:g}"
    host = lambda m: gib(m["host"]) if m["offload"] else "-"  # noqa: E731
    state = lambda key: lambda m: gib(m[key]) if not m["offload"] else "0 (host)"  # noqa: E731
    rows = [
        ("flags", lambda m: f"`{flags(m)}`"),
        (f"actor fp32 weights + Adam m, v: 12 B/param / {n}", state("actor_state")),
        ("critic, the same (`--adv gae`)", lambda m: state("critic_state")(m) if m["adv"] == "gae" else "-"),
        (f"reference fp32 weights: 4 B/param / {n}", state("ref_state")),
        ("**trainer state at rest**", lambda m: f"**{gib(m['rest'])}**"),
        (f"vLLM share: utilization x {gpu} GiB", lambda m: gib(m["engine"])),
        ("- engine bf16 weights / K", lambda m: gib(m["engine_weights"])),
        ("- engine activations, CUDA graphs (assumed)", lambda m: gib(m["engine_act"])),
        ("- KV cache", lambda m: gib(m["kv"])),
        ("KV tokens per engine; its rollout held at once",
         lambda m: f"{m['kv_tokens'] / 1e3:,.0f} k; {100 * m['held']:.0f} %"),
        ("CUDA context, NCCL, fragmentation (assumed)", lambda m: gib(m["context"])),
        ("**rollout peak**", lambda m: f"**{gib(m['rollout_peak'])}**"),
        (f"actor fp32 gradients: 4 B/param / {n}", state("grads")),
        ("activations: tokens x 75 B x hidden x layers (/ 7 checkpointed)",
         lambda m: f"{gib(m['act'])} ({m['tokens']:,} tokens)"),
        ("gathered bf16: root (embeddings, head) + one layer", lambda m: gib(m["gathered"])),
        (f"optimiser temporaries: 4 B/param / {n}", state("opt_temp")),
        ("**update peak**: state + grads + max(act + gathered, optimiser) + context",
         lambda m: f"**{gib(m['update_peak'])}**"),
        ("host RAM per node (`--offload`: 16 B/param actor, critic; 4 reference)", host),
        (f"**fits {n} x {gpu} GiB** ({100 * (1 - setup.margin):.0f} % usable)",
         lambda m: "**yes**" if m["fits"] else "no"),
    ]
    out = ["| per GPU, GiB | " + " | ".join(t for t, _ in columns) + " |",
           "|---|" + "---|" * len(columns)]
    out += [f"| {label} | " + " | ".join(fn(m) for _, m in columns) + " |" for label, fn in rows]
    return out


def given_plan(args):
    return dict(engine_tp=args.engine_tp, offload=args.offload, grad_checkpointing=args.grad_checkpointing,
                micro_batch_tokens=args.micro_batch_tokens, adv=args.adv,
                gpu_memory_utilization=args.gpu_memory_utilization, lora_rank=args.lora_rank)


def check_1_5b():
    """The model against docs/memory.md's one-rank 1.5B measurements -> markdown lines. The bench ran --adv grpo and
    kept the reference's root unit gathered after its no-grad pass (train.py reshards it): add it, bf16, whole."""
    cfg, p = SHAPES["1.5B"], param_counts(SHAPES["1.5B"])
    one = argparse.Namespace(gpus=1, gpu_gib=1e6, margin=0.0, host_gib=0, prompt_tokens=0, max_response_tokens=1,
                             max_turns=0, turn_tokens=0, batch_size=1, samples_per_prompt=1)
    ref_root = 2 * p["root"]
    out = ["| one rank, 1.5B, GiB | computed | measured | computed / measured |", "|---|---|---|---|"]

    def row(label, computed, measured):
        out.append(f"| {label} | {computed / GIB:.1f} | {measured:.1f} | {computed / GIB / measured:.3f} |")

    m = memory(cfg, dict(engine_tp=1, offload=False, grad_checkpointing=False, micro_batch_tokens=1, adv="grpo",
                         gpu_memory_utilization=0.0), one)
    row("state at rest: actor 12 B/param + reference 4 B/param", m["rest"], MEASURED_1_5B["state"])
    row(f"the same + the reference's gathered root ({gib(ref_root)} GiB, as the bench held it)", m["rest"] + ref_root,
        MEASURED_1_5B["state"])
    for (ckpt, tokens), measured in MEASURED_1_5B["update"].items():
        m = memory(cfg, dict(engine_tp=1, offload=False, grad_checkpointing=ckpt, micro_batch_tokens=tokens,
                             adv="grpo", gpu_memory_utilization=0.0), one)
        label = f"update peak, {tokens:,}-token micro-batch, {'with' if ckpt else 'without'} checkpointing"
        row(label, m["update_peak"] - m["context"] + ref_root, measured)
    return out


def render(args):
    """The whole report (markdown lines): the plan per model and its command lines, the 1.5B check, then per model
    every component."""
    setup, shapes = args, models(args)
    plans = {name: {adv: search(cfg, setup, adv) for adv in ("gae", "grpo")} for name, cfg in shapes}
    peaks = lambda m: f"{gib(m['rollout_peak'])} / {gib(m['update_peak'])}" if m else "-"  # noqa: E731
    out = [f"## The plan: {setup.gpus} x {setup.gpu_gib:g} GiB", "",
           f"Rollout: {setup.batch_size} prompts x {setup.samples_per_prompt} samples per step, longest trajectory "
           f"{seq_tokens(setup):,} tokens (prompt {setup.prompt_tokens} + response); engine activations "
           f"{ENGINE_ACT_GIB:g} GiB and context {CONTEXT_GIB:g} GiB assumed; {100 * (1 - setup.margin):.0f} % of the "
           f"card usable; host RAM {setup.host_gib:g} GiB per node.", "",
           "| model | parameters | `--adv gae` | peaks, GiB: rollout / update | `--adv grpo` | peaks |",
           "|---|---|---|---|---|---|"]
    for name, cfg in shapes:
        gae, grpo = plans[name]["gae"], plans[name]["grpo"]
        out.append(f"| {name} | {param_counts(cfg)['actor'] / 1e9:.2f} B | `{flags(gae) if gae else 'does not fit'}` "
                   f"| {peaks(gae)} | `{flags(grpo) if grpo else 'does not fit'}` | {peaks(grpo)} |")
    for adv in ("gae", "grpo"):
        out += ["", f"`--adv {adv}`:", "", "```bash"]
        out += [command(name, plans[name][adv], setup.gpus) for name, _ in shapes if plans[name][adv]] + ["```"]
    out += [""] + lora_table(args, shapes)
    out += ["", "## Check: the model against the measured 1.5B figures", ""] + check_1_5b()
    for name, cfg in shapes:
        p = param_counts(cfg)
        cols = [("given flags", memory(cfg, given_plan(args), setup))]
        cols += [(f"plan, `--adv {adv}`", m) for adv, m in plans[name].items() if m]
        out += ["", f"## {name}", "",
                f"hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, {cfg['num_attention_heads']} heads "
                f"/ {cfg['num_key_value_heads']} KV heads of {head_dim(cfg)}, MLP {cfg['intermediate_size']}, "
                f"vocabulary {cfg['vocab_size']:,}{', tied head' if cfg.get('tie_word_embeddings') else ''}: actor "
                f"{p['actor'] / 1e9:.2f} B parameters ({p['actor']:,}), critic {p['critic'] / 1e9:.2f} B; "
                f"`--engine-tp` in {', '.join(map(str, tp_sizes(cfg, setup.gpus)))}.", ""]
        out += table(cols, setup)
    return out


def fewest_gpus(cfg, setup, adv, lora_rank):
    """(GPUs, plan) of the smallest node of 1, 2, 4 or 8 of these cards that a plan without --offload fits (its host
    step is the slow way to fit anything), or (None, None)."""
    for gpus in (1, 2, 4, 8):
        plan = search(cfg, argparse.Namespace(**dict(vars(setup), gpus=gpus)), adv, lora_rank, offloads=(False,))
        if plan:
            return gpus, plan
    return None, None


def lora_table(args, shapes):
    """Markdown: the fewest GPUs each model needs, full fine-tuning against --lora-rank (lora_params: its trained
    parameters; the frozen base in bf16, no reference copy)."""
    r = args.lora_rank or 16
    out = [f"## LoRA (`--lora-rank {r}`) beside full fine-tuning: the fewest {args.gpu_gib:g} GiB GPUs without "
           "`--offload`", "",
           f"LoRA: the base once in bf16 (2 B/param), frozen; the adapters ({r} x (in + out) of every linear layer of "
           "every block) with fp32 weights, gradients and Adam state; no reference copy (the base with the adapters "
           "off); a `--adv gae` critic has adapters of its own on a bf16 copy of its backbone. Activations as full "
           "fine-tuning (the frozen layers still pass gradients to their inputs).", "",
           "| model | `--adv` | full fine-tune: GPUs, state at rest per GPU | flags | "
           f"`--lora-rank {r}`: GPUs, state at rest per GPU | flags |", "|---|---|---|---|---|---|"]
    fewest = {(name, adv, rank): fewest_gpus(cfg, args, adv, rank) for name, cfg in shapes
              for adv in ("gae", "grpo") for rank in (0, r)}
    for name, _ in shapes:
        for adv in ("gae", "grpo"):
            cells = []
            for rank in (0, r):
                gpus, m = fewest[name, adv, rank]
                cells += [f"{gpus}, {gib(m['rest'])} GiB", f"`{flags(m)}`"] if m else ["more than 8", "-"]
            out.append(f"| {name} | {adv} | " + " | ".join(cells) + " |")
    out += ["", "```bash"] + [command(name, m, gpus) for name, _ in shapes
                              for gpus, m in [fewest[name, "grpo", r]] if m] + ["```"]
    out += ["", f"Trained parameters at `--lora-rank {r}`: " + ", ".join(
        f"{name.split('-')[-1]} {lora_params(cfg, r) / 1e6:.1f} M ({100 * lora_params(cfg, r) / param_counts(cfg)['actor']:.2f} %)"
        for name, cfg in shapes) + "."]
    return out + [""] + sync_table(shapes, {name: fewest[name, "grpo", r] for name, _ in shapes})


NVLINK, PCIE, HBM = 300e9, 25e9, 2e12  # bytes/s assumed per GPU: NCCL all-gather, pinned host copies, device copies


def sync_table(shapes, plans):
    """Markdown: what LoRA's weight sync costs per step and GPU in each of three ways to give a sleeping engine its
    weights back, at each model's LoRA plan (plans: name -> (GPUs, plan)). The vLLM layer the sync holds longest is the
    largest of the embedding, the head, qkv_proj and gate_up_proj."""
    out = ["## LoRA's weight sync per step: three ways to give the engine back what its sleep dropped", "",
           "Each step the engine's sleep (vLLM's level 2) drops every weight, and vLLM rebuilds a fused layer it "
           "receives in part (q/k/v, gate/up) from uninitialised memory. train.py resends the whole base with the "
           "adapted layers merged (`resend`). The alternatives: vLLM's level-1 sleep, which copies every weight to "
           "pinned host memory and back, the sync then sending the adapted layers whole (`level 1`); or "
           "`sleep_preserve_parameter_names` on the frozen tensors (embeddings, head, norms with LoRA on every linear "
           "layer), which then stay on the GPU through the update (`preserve`). Per GPU, bf16, at each model's "
           f"`--adv grpo` LoRA plan above; times at {NVLINK / 1e9:.0f} GB/s all-gather, {PCIE / 1e9:.0f} GB/s host "
           f"copies and {HBM / 1e12:.0f} TB/s device copies (assumed, not measured). Measured on SmolLM2-135M on a "
           "CPU: docs/benchmarks.md.", "",
           "| model | GPUs, `--engine-tp` | way | gathered per step | pinned host memory | held by the sync | "
           "kept on the GPU through the update | time per step |", "|---|---|---|---|---|---|---|---|"]
    for name, cfg in shapes:
        gpus, plan = plans[name]
        if not plan:
            continue
        p, k, h, inter = param_counts(cfg), plan["engine_tp"], cfg["hidden_size"], cfg["intermediate_size"]
        q, kv = cfg["num_attention_heads"] * head_dim(cfg), cfg["num_key_value_heads"] * head_dim(cfg)
        frozen = 2 * (p["embed"] + p["head"] + p["norm"] + cfg["num_hidden_layers"] * 2 * h)  # bytes: no adapter
        whole, linear = 2 * p["actor"], 2 * p["actor"] - frozen
        layer = 2 * max(p["embed"], p["head"], h * (q + 2 * kv), 2 * h * inter) / k  # the largest, this GPU's share
        # FSDP2's shards gathered, then about 6 bytes of device copies per byte (the cast, an adapted layer's fp32
        # merge, vLLM's rebuilt layer and its copy into the engine's storage)
        gather = lambda b: b * (gpus - 1) / gpus / NVLINK + 6 * b / k / HBM  # noqa: E731
        rows = [("resend", whole, "-", (k + 1) * layer, 0, gather(whole)),
                ("level 1", linear, f"{gib(whole / k)} GiB held, {gib(2 * whole / k)} GiB moved", (k + 1) * layer, 0,
                 gather(linear) + 2 * whole / k / PCIE),
                ("preserve", linear, "-", (k + 1) * layer, frozen / k, gather(linear))]
        for way, sent, host, held, kept, seconds in rows:
            out.append(f"| {name} | {gpus}, {k} | {way} | {gib(sent)} GiB | {host} | {gib(held)} GiB | "
                       f"{gib(kept)} GiB | {seconds:.2f} s |")
    return out


def models(args):
    """[(name, config)]: --config's file, else the built-in shapes asked for."""
    if args.config:
        cfg = json.loads(Path(args.config).read_text())
        cfg = cfg.get("text_config", cfg)  # multimodal wrappers keep the LM's fields one level down
        return [(cfg.get("_name_or_path") or Path(args.config).resolve().parent.name, cfg)]
    return [(HUB.format(size), SHAPES[size]) for size in args.model]


BEGIN, END = "<!-- generated by bench/scaling.py: do not edit by hand -->", "<!-- end of generated part -->"


def write(path, lines):
    """Replace the generated part of `path` (between BEGIN and END) with lines."""
    text = Path(path).read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    Path(path).write_text(head + BEGIN + "\n" + "\n".join(lines) + "\n" + END + tail)


def generated(path):
    """The generated part of `path` as lines (what `write` put there)."""
    text = Path(path).read_text()
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n").split("\n")


def parse_args(argv=None):
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", choices=list(SHAPES), default=list(SHAPES), help="built-in shapes")
    ap.add_argument("--config", help="an HF config.json instead of the built-in shapes")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs (ranks) on the node")
    # an 80 GB H100 reports 81,559 MiB: 79.6 GiB
    ap.add_argument("--gpu-gib", type=float, default=79.6, help="memory of one GPU in GiB")
    ap.add_argument("--margin", type=float, default=0.05, help="share of the card kept free for the model's error")
    ap.add_argument("--host-gib", type=float, default=1800, help="host RAM per node for --offload (DGX H100: 2 TB)")
    g = ap.add_argument_group("train.py's flags (the 'given flags' column; its defaults)")
    g.add_argument("--engine-tp", type=int, default=1)
    g.add_argument("--lora-rank", type=int, default=0, help="also the LoRA table's rank (0 there: 16)")
    g.add_argument("--offload", action="store_true")
    g.add_argument("--grad-checkpointing", action="store_true")
    g.add_argument("--micro-batch-tokens", type=int, default=16384, help="also where the search starts")
    g.add_argument("--adv", choices=("gae", "grpo", "rloo"), default="gae")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="plans choose their own")
    g.add_argument("--batch-size", type=int, default=64)
    g.add_argument("--samples-per-prompt", type=int, default=8)
    g.add_argument("--max-response-tokens", type=int, default=None,
                   help="default: every turn at full budget plus every intervention")
    g.add_argument("--turn-tokens", type=int, default=1000)
    g.add_argument("--max-turns", type=int, default=3)
    g.add_argument("--prompt-tokens", type=int, default=300, help="longest prompt counted in the KV cache")
    ap.add_argument("--write", metavar="PATH", help="replace the generated part of PATH (docs/scaling.md)")
    args = ap.parse_args(argv)
    for name, cfg in models(args):
        try:
            check_tp(cfg, args.engine_tp, args.gpus)
        except ValueError as e:
            ap.error(f"{name}: {e}")
    return args


def main(argv=None):
    args = parse_args(argv)
    lines = render(args)
    if args.write:
        write(args.write, lines)
    else:
        print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
