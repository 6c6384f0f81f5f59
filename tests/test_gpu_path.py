"""The GPU path against its libraries' source, on the CPU: each test stubs what a GPU, another torch or another model
family would present (a kernel signature, memory numbers, a config, a thread count) and fails on the code that got
it wrong. The bf16-on-emulating-GPUs check is in test_dtype.py."""
import contextlib
import os
from types import SimpleNamespace

import pytest
import torch
from test_engine import GiB, fake_engine
from test_packing import trajectories
from torch.distributed.tensor import DTensor

import model as M
import train
import train_setup
from infra import collectives, engines, hf, packing, perf, sharding, system, vllm_internal


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    collectives.init_distributed()
    yield
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- torch 2.10's varlen kernel

def fake_varlen_module(monkeypatch, signature):
    """torch.nn.attention.varlen with a varlen_attn of the given keyword signature that records its keywords."""
    import sys
    import types

    seen = []
    ns = {}
    exec(f"def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, {signature}):\n"
         f"    seen.append(sorted(k for k in locals() if k not in ('query', 'key', 'value', 'cu_seq_q', 'cu_seq_k', "
         f"'max_q', 'max_k')))\n    return query", {"seen": seen}, ns)
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", types.SimpleNamespace(varlen_attn=ns["varlen_attn"]))
    return seen


@pytest.mark.parametrize("signature, takes_scale", [
    ("return_aux=None, is_causal=False", False),                                               # torch 2.10
    ("return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False", True)])            # torch 2.11+
def test_varlen_kernel_passes_scale_only_where_torch_takes_it(monkeypatch, signature, takes_scale):
    seen = fake_varlen_module(monkeypatch, signature)
    run = packing._torch_varlen()
    q = torch.zeros(6, 4, 32)
    run(q, q[:, :2], q[:, :2], torch.tensor([0, 6]), 6, 32 ** -0.5, 2)  # 2.10: TypeError before the fix
    assert ("scale" in seen[0]) == takes_scale
    assert run.takes_scale == takes_scale
    # a model whose scaling is not head_dim ** -0.5 (e.g. Gemma's query_pre_attn_scalar) needs the argument
    assert packing.kernel_takes(run, 32 ** -0.5, 32) and packing.kernel_takes(run, None, 32)
    assert packing.kernel_takes(run, 0.1, 32) == takes_scale
    assert not packing.kernel_takes(None, None, 32)


# ----------------------------------------------------------------------------- fp32 on a GPU with GQA

def test_per_sequence_attention_expands_kv_heads_off_the_cpu(monkeypatch):
    """Off the CPU, k/v heads are repeated and SDPA runs without enable_gqa: CUDA's memory-efficient kernel takes
    fp32 but no GQA, so enable_gqa would fall to the math backend and its [Hq, s, s] fp32 scores. On the CPU the
    fused GQA path stays. (meta tensors stand in for the GPU's: no data, real shapes.)"""
    calls = []

    def sdpa(q, k, v, is_causal, scale, enable_gqa):
        calls.append((q.device.type, k.shape[1], enable_gqa))
        return torch.empty_like(q)

    monkeypatch.setattr(packing.F, "scaled_dot_product_attention", sdpa)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    for device in ("meta", "cpu"):
        q, kv = torch.empty(1, 4, 8, 32, device=device), torch.empty(1, 2, 8, 32, device=device)
        packing._per_sequence_sdpa(q, kv, kv, cu, None)
    assert calls == [("meta", 4, False)] * 2 + [("cpu", 2, True)] * 2


def test_sequence_bounds_are_read_once_per_forward_not_per_layer(tiny_model_dir, monkeypatch):
    """cu_seq_lens.tolist() syncs the host with the GPU: once per forward, not in every layer."""
    model = hf.load_causal_lm(tiny_model_dir, attn_implementation="varlen")
    mb = packing.pack(trajectories(), torch.arange(5), "cpu")
    reads, tolist = [], torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t is mb["cu_seq_lens"]) or tolist(t))
    with torch.no_grad():
        M.token_logprobs(model, mb)
    assert sum(reads) == 1, f"{sum(reads)} reads of the sequence bounds in a {model.config.num_hidden_layers}-layer forward"


# ----------------------------------------------------------------------------- attention variants never dropped

def save_config(tmp_path, config, name):
    from transformers import AutoTokenizer

    out = tmp_path / name
    config.save_pretrained(out)
    AutoTokenizer.from_pretrained(M.resolve_model("smollm2")).save_pretrained(out)
    return str(out)


def small(cls, **kw):
    return cls(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, head_dim=32, **kw)


def test_mistral_sliding_window_is_refused_not_dropped(tmp_path, capsys):
    """Mistral passes sliding_window= as a keyword and has no module attribute: varlen used to compute full causal
    attention past the window without a word."""
    from transformers import MistralConfig, MistralForCausalLM

    config = small(MistralConfig, sliding_window=4)
    model = MistralForCausalLM(config).eval()
    model.config._attn_implementation = "varlen"  # past the load-time check: the run-time one must hold too
    packing.register_varlen_attention()
    mb = packing.pack(trajectories(), torch.arange(5), "cpu")
    with pytest.raises(ValueError, match=r"sliding-window attention \(sliding_window=4\)"), torch.no_grad():
        model(**packing.model_inputs(mb))
    path = save_config(tmp_path, config, "mistral")
    with pytest.raises(SystemExit):
        hf.load_causal_lm(path, attn_implementation="varlen", meta=True)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sliding-window attention (sliding_window=4)" in err and "sdpa" in err
    hf.load_causal_lm(path, attn_implementation="sdpa", meta=True)  # sdpa masks the window itself


@pytest.mark.parametrize("kwargs, what", [({"softcap": 50.0}, "soft-capping"), ({"s_aux": torch.zeros(2)}, "sinks"),
                                          ({"sliding_window": 4096}, "sliding-window")])
def test_attention_keywords_the_kernel_does_not_compute_are_refused(kwargs, what):
    q = torch.zeros(1, 2, 5, 32)
    with pytest.raises(ValueError, match=what):
        packing.varlen_attention(torch.nn.Module(), q, q, q, None, **kwargs)
    packing.varlen_attention(torch.nn.Module(), q, q, q, None, sliding_window=None, softcap=None)  # None: not asked


def test_config_checks_for_each_family(tmp_path, capsys):
    from transformers import Gemma2Config, LlamaConfig, Qwen2Config

    ok = [small(LlamaConfig), small(Qwen2Config), small(Qwen2Config, sliding_window=64)]  # use_sliding_window off
    for config in ok:
        assert hf.unsupported_features(config, "varlen") == []
    assert hf.unsupported_features(small(Qwen2Config, use_sliding_window=True, sliding_window=64, max_window_layers=0),
                                  "varlen") == ["sliding-window attention (sliding_window=64)"]
    gemma = small(Gemma2Config)
    assert hf.unsupported_features(gemma, "varlen") == ["sliding-window attention (sliding_window=4096)",
                                                       "attention logit soft-capping (50.0)",
                                                       "final logit soft-capping (30.0)"]
    assert hf.unsupported_features(gemma, "sdpa") == ["final logit soft-capping (30.0)"]  # token_logprobs' own head
    assert hf.unsupported_features(gemma, "sdpa", head=False) == []                       # the critic has none
    with pytest.raises(SystemExit):
        hf.refuse_unsupported(save_config(tmp_path, gemma, "gemma2"), "sdpa")
    assert "final logit soft-capping (30.0): this model cannot be trained here" in capsys.readouterr().err


# ----------------------------------------------------------------------------- vLLM's activation peak on wake-up

def test_wake_needs_room_for_the_activation_peak_vllm_profiled(monkeypatch, capsys):
    """vLLM sized its KV cache leaving room for its profiled activation peak, allocated during generate outside the
    sleep pools: weights + KV cache fitting is not enough."""
    engine, log, device = fake_engine(monkeypatch)
    engine.activation_peak = 3 * GiB
    engine.sleep()  # weights and KV cache (4 GiB) freed: 14 GiB free
    device["free"] -= 8 * GiB  # the trainer's gradients and Adam state: 6 GiB free, 4 + 3 needed
    with pytest.raises(SystemExit):
        engine.sync_weights(iter([("model.norm.weight", torch.ones(2))]))
    err = capsys.readouterr().err
    assert "need 4.0 GiB and its weight sync or forward passes up to 3.0 GiB more" in err and "only 6.0 GiB" in err, err
    assert ("wake_up", ["weights"]) not in log


def test_wake_of_the_weights_needs_room_for_what_the_sync_holds(monkeypatch, capsys):
    """A sync holds each vLLM layer's full tensors until the layer is complete, and the layer rebuilt (sync_peak):
    the weights' wake counts it when it is larger than generate's activations; the KV cache's wake, after the sync has
    freed it, does not."""
    engine, log, device = fake_engine(monkeypatch)
    engine.activation_peak, engine.sync_peak = 1 * GiB, 3 * GiB
    engine.sleep()  # 14 GiB free
    device["free"] -= 8 * GiB  # 6 free: 4 to wake and 1 of activations fit, 4 and the sync's 3 do not
    with pytest.raises(SystemExit):
        engine.sync_weights(iter([("model.norm.weight", torch.ones(2))]))
    assert "its weight sync or forward passes up to 3.0 GiB more" in capsys.readouterr().err
    device["free"] += 1 * GiB  # 7 free: the weights wake, load, and the KV cache's wake needs 3 + 1 of the 6 left
    engine.sync_weights(iter([("model.norm.weight", torch.ones(2))]))
    engine.generate([[1, 2, 3]], 8)
    assert not engine.asleep


def test_activation_peak_is_read_from_the_worker_or_bounded_at_the_first_sleep(monkeypatch):
    worker = SimpleNamespace(peak_activation_memory=5 * GiB)
    llm = SimpleNamespace(collective_rpc=lambda method, **kw: [method(worker)])
    assert vllm_internal.vllm_internal(llm, "activation_peak") == 5 * GiB
    assert vllm_internal.vllm_internal(SimpleNamespace(collective_rpc=lambda m, **kw: [m(object())]),
                                  "activation_peak") is None  # a worker without the measure
    engine, _, _ = fake_engine(monkeypatch)
    engine.activation_peak, engine.reserved = None, 8 * GiB  # no measure: the reservation minus what sleep frees
    engine.sleep()
    assert engine.activation_peak == 4 * GiB


# ----------------------------------------------------------------------------- FSDP2 around the no-grad passes

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where init_distributed's mesh is


def sharded_tiny(path, critic=False):
    build = M.load_critic if critic else hf.load_causal_lm
    m = sharding.shard(build(path, attn_implementation="varlen").to(DEVICE))
    m.requires_grad_(False)
    return m


def root_params_sharded(model):
    embed = (model.backbone if isinstance(model, M.ValueModel) else model.model).embed_tokens.weight
    return isinstance(embed, DTensor)


def test_no_grad_passes_reshard_every_model(tiny_model_dir, one_rank_group):
    """FSDP2 reshards a root module in backward only: after a no-grad pass its embedding, norm and head stayed
    gathered -- the reference's for the whole run, since it never runs backward."""
    run = SimpleNamespace(ref=sharded_tiny(tiny_model_dir), actor=sharded_tiny(tiny_model_dir),
                          critic=sharded_tiny(tiny_model_dir, critic=True), reuse_old=False,
                          autocast=contextlib.nullcontext, device=DEVICE)
    args = SimpleNamespace(micro_batch_size=2, micro_batch_tokens=None, temperature=1.0)
    ref, old, values = train.no_grad_passes(run, args, trajectories(), lambda phase: None)
    assert ref.shape == old.shape == values.shape == (5, 20)
    assert [root_params_sharded(m) for m in (run.ref, run.actor, run.critic)] == [True] * 3


def test_weight_sync_gathers_in_the_engine_dtype(tiny_model_dir, one_rank_group, monkeypatch):
    """Each shard is cast before the all-gather: half the traffic of fp32 and no full fp32 copy."""
    model = sharded_tiny(tiny_model_dir)
    gathered, full_tensor = [], DTensor.full_tensor
    monkeypatch.setattr(DTensor, "full_tensor", lambda t: gathered.append(t.dtype) or full_tensor(t))
    synced = dict(sharding.full_state_dict(model, torch.bfloat16))
    assert gathered and set(gathered) == {torch.bfloat16}
    want = hf.load_causal_lm(tiny_model_dir).state_dict()
    for name, t in synced.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t.cpu(), want[name].to(torch.bfloat16)), name


# ----------------------------------------------------------------------------- threads after the engine starts

def test_trainer_threads_are_set_after_the_engine_starts(tiny_model_dir, tmp_path, monkeypatch):
    """vLLM's GPU worker sets torch to one thread unless OMP_NUM_THREADS is set (and torchrun sets it to 1 for
    several ranks): the trainer's CPU work (--offload's optimiser step) then ran single-threaded."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert system.trainer_threads() == 4 and system.trainer_threads(3) == 3

    def vllm_like_engine(*a, **k):
        torch.set_num_threads(1)
        return SimpleNamespace(dtype=torch.float32)

    monkeypatch.setattr(engines, "make_engine", vllm_like_engine)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    before = torch.get_num_threads()
    args = train.parse_args(["--model", tiny_model_dir, "--data", "arith_train", "--adv", "grpo", "--engine", "hf",
                             "--dtype", "float32", "--out", str(tmp_path)])
    try:
        run = train_setup.setup(args)
        assert torch.get_num_threads() == 2  # 8 cores / 4 local ranks
        assert run.flops["actor"] == perf.model_shape(hf.load_causal_lm(tiny_model_dir))
    finally:
        torch.set_num_threads(before)
        import torch.distributed as dist
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- model FLOPs

def test_model_flops_against_a_hand_count(tmp_path):
    """make_tiny's Llama: hidden 128, 2 layers, 4 heads of 32, 2 KV heads, MLP 256, tied head over the vocabulary."""
    path = M.make_tiny(tmp_path / "m")
    model = hf.load_causal_lm(path)
    V = model.config.vocab_size
    per_layer = 128 * 128 * 2 + 128 * 64 * 2 + 3 * 128 * 256 + 2 * 128  # q, o; k, v; gate, up, down; 2 norms
    shape = perf.model_shape(model)
    assert shape == dict(layer_params=2 * per_layer, head_params=V * 128, layers=2, attn_width=128, frozen_base=False)
    seqs, resps = [10, 7], [4, 3]
    want = 2 * (2 * per_layer) * 17 + 2 * (V * 128) * 7 + 2 * 2 * 128 * (10 ** 2 + 7 ** 2)
    assert perf.forward_flops(shape, seqs, resps) == want
    critic = perf.model_shape(M.load_critic(path))
    assert critic == dict(shape, head_params=128 + 1)  # the value head
    # a step: reference + old log-probs + values, no grad; actor and critic forward + backward per PPO epoch
    batch = {"prompt_mask": torch.tensor([[1] * 6, [0, 0] + [1] * 4]), "response_mask": torch.tensor([[1] * 4, [1] * 3 + [0]])}
    run = SimpleNamespace(flops={"actor": shape, "critic": critic}, reuse_old=False)
    a, c = perf.forward_flops(shape, seqs, resps), perf.forward_flops(critic, seqs, resps)
    from train_logs import phase_flops
    assert phase_flops(run, SimpleNamespace(ppo_epochs=2), batch) == {"flops_logprobs": 2 * a + c,
                                                                      "flops_update": 3 * (a + c) * 2}
    # LoRA (rank 4 on all seven projections): the adapters count as layer parameters, the frozen base gets no weight
    # gradients, so training is 3 F less one F's weight part (2 P s + 2 P_head r)
    from infra import lora
    adapted = lora.adapt(model, hf.decoder_layers(model), 4, 8, lora.TARGETS, torch.float32)
    lora_shape = perf.model_shape(adapted)
    adapters = 4 * (2 * (128 + 128) + 2 * (128 + 64) + 3 * (128 + 256))  # r x (in + out): q, o; k, v; gate, up, down
    assert lora_shape == dict(shape, layer_params=2 * (per_layer + adapters), frozen_base=True)
    f = perf.forward_flops(lora_shape, seqs, resps)
    weights = 2 * (2 * (per_layer + adapters)) * 17 + 2 * (V * 128) * 7
    assert perf.training_flops(lora_shape, seqs, resps) == 3 * f - weights
    assert perf.training_flops(shape, seqs, resps) == 3 * a


def test_peak_table_and_flag(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert perf.peak_tflops("cuda") == 756.0
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GH200 480GB")
    assert perf.peak_tflops("cuda") == 989.0
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert perf.peak_tflops("cuda") is None and perf.peak_tflops("cuda", 123.0) == 123.0
    assert perf.peak_tflops("cpu") is None


# ----------------------------------------------------------------------------- --compile: every layer compiled

def compiled_layer_coverage(path):
    """Actor, reference and critic compiled (model.compile_model) with a backend that records which decoder layer
    was running each time compiled code ran -> {"model pass": layers that ran compiled}, over the passes train.py
    makes: the update (train mode, activation checkpointing, backward) and the no-grad passes (eval mode)."""
    active, mode, seen = [None], [None], {}

    def backend(gm, example_inputs):
        def run(*args):
            if active[0] is not None:
                seen.setdefault(active[0][0], set()).add(active[0][1])
            return gm.forward(*args)
        return run

    actor, ref = (hf.load_causal_lm(path, attn_implementation="varlen") for _ in range(2))
    critic = M.load_critic(path, attn_implementation="varlen")
    for name, m in (("actor", actor), ("ref", ref), ("critic", critic)):
        M.compile_model(m, backend=backend)
        for i, layer in enumerate(hf.decoder_layers(m)):
            layer.register_forward_pre_hook(lambda mod, a, name=name, i=i: active.__setitem__(0, (f"{name} {mode[0]}", i)))
            layer.register_forward_hook(lambda mod, a, out: active.__setitem__(0, None))
    mb = packing.pack(trajectories(), torch.arange(5), "cpu")
    mode[0] = "update"
    for name, m in (("actor", actor), ("critic", critic)):
        backbone = m.backbone if isinstance(m, M.ValueModel) else m
        backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
        out = m(mb) if name == "critic" else M.token_logprobs(m, mb, 0.7, with_entropy=True)[0]
        out.sum().backward()
        m.eval()
    mode[0] = "no-grad"
    with torch.no_grad():  # reference, old log-probs, values
        for name, m in (("ref", ref), ("actor", actor), ("critic", critic)):
            m(mb) if name == "critic" else M.token_logprobs(m, mb, 0.7)
    return seen


@pytest.mark.slow  # Dynamo traces three models in two modes (a recording backend: no compiler needed)
def test_compile_runs_every_layer_of_every_model_compiled(tmp_path):
    """All decoder layers share one code object and its compiled graphs: nothing guards on the layer object, so more
    layers than Dynamo's recompile limit (8) still run compiled, in each of actor, reference and critic, with and
    without grad. The recording is checked by lowering the limit to one graph: later passes then run eager."""
    import torch._dynamo

    layers = 10
    path = M.make_tiny(tmp_path / "m", layers=layers)
    torch._dynamo.reset()
    seen = compiled_layer_coverage(path)
    passes = ("actor update", "critic update", "ref no-grad", "actor no-grad", "critic no-grad")
    assert seen == {name: set(range(layers)) for name in passes}, seen
    torch._dynamo.reset()
    # config.patch, not monkeypatch: monkeypatch's undo deletes the attribute, which hides Dynamo's option for good
    with torch._dynamo.config.patch(recompile_limit=1):
        starved = compiled_layer_coverage(path)
    assert starved != seen  # the recording sees layers fall back to eager
    torch._dynamo.reset()
