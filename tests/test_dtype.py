"""--dtype/--engine-dtype auto (system.choose_dtype) and the quiet console (system.quiet_logs)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, run_script

from infra import system as S

X86 = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx2 avx512f avx512bw {extra}\n\n"


@pytest.mark.parametrize("extra, want", [
    ("avx512_bf16 avx512_vnni", "bfloat16"),
    ("amx_tile amx_bf16 amx_int8", "bfloat16"),
    ("avx512_vnni", "float32"),  # AVX-512 without bf16: torch says "supported", but it is emulated
])
def test_auto_on_cpu_reads_the_flags(monkeypatch, extra, want):
    monkeypatch.setattr(S, "_cpuinfo_text", lambda: X86.format(extra=extra))
    dtype, reason = S.choose_dtype("auto", "cpu")
    assert dtype == want
    assert reason == ("CPU without avx512_bf16/amx_bf16: bf16 would be emulated" if want == "float32"
                      else f"CPU with {'avx512_bf16' if 'avx512_bf16' in extra else 'amx_bf16'}")


def test_explicit_and_hf_engine(monkeypatch):
    monkeypatch.setattr(S, "_cpuinfo_text", lambda: X86.format(extra="avx512_bf16"))
    assert S.choose_dtype("float32", "cpu") == ("float32", "requested")
    assert S.choose_dtype("bfloat16", "cpu") == ("bfloat16", "requested")
    assert S.choose_dtype("auto", "cpu", engine="hf")[0] == "float32"      # the debugging engine stays exact
    assert S.choose_dtype("auto", "cpu", engine="vllm")[0] == "bfloat16"


def test_aarch64_and_timing_fallback(monkeypatch):
    monkeypatch.setattr(S, "_cpuinfo_text", lambda: "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n")
    assert S.choose_dtype("auto", "cpu")[0] == "bfloat16"
    monkeypatch.setattr(S, "_cpuinfo_text", lambda: "processor\t: 0\nFeatures\t: fp asimd\n")
    assert S.choose_dtype("auto", "cpu")[0] == "float32"
    monkeypatch.setattr(S, "_cpuinfo_text", lambda: None)  # no /proc/cpuinfo: time a matmul once
    monkeypatch.setattr(S, "_timed_bf16", [])
    dtype, reason = S.choose_dtype("auto", "cpu")
    assert dtype in ("bfloat16", "float32") and "matmul" in reason


def fake_gpu(monkeypatch, major, minor, name):
    """A stubbed CUDA device: torch's is_bf16_supported counts emulation unless told not to, as on real V100/T4."""
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: major >= 8 or including_emulation)


@pytest.mark.parametrize("major, name", [(7, "Tesla V100-SXM2-16GB"), (7, "Tesla T4")])
def test_auto_on_a_gpu_that_emulates_bf16(monkeypatch, major, name):
    """V100/T4: bf16 only emulated (vLLM refuses it below compute capability 8.0): fp16 engine, fp32 trainer."""
    fake_gpu(monkeypatch, major, 0, name)
    dtype, reason = S.choose_dtype("auto", "cuda")
    assert (dtype, reason) == ("float32", f"{name} (compute capability {major}.0) without native bf16")
    assert S.choose_dtype("auto", "cuda", engine="vllm")[0] == "float16"
    assert S.choose_dtype("float32", "cuda") == ("float32", "requested")


def test_explicit_bf16_on_a_gpu_that_emulates_it_is_one_line(monkeypatch, capsys):
    fake_gpu(monkeypatch, 7, 5, "Tesla T4")
    with pytest.raises(SystemExit) as e:
        S.choose_dtype("bfloat16", "cuda", engine="vllm")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: --engine-dtype bfloat16: Tesla T4 (compute capability 7.5) without native bf16")


def test_auto_on_ampere_and_later(monkeypatch):
    fake_gpu(monkeypatch, 9, 0, "NVIDIA H200")
    assert S.choose_dtype("auto", "cuda") == ("bfloat16", "NVIDIA H200 (compute capability 9.0) with bf16")
    assert S.choose_dtype("bfloat16", "cuda") == ("bfloat16", "requested")


@pytest.mark.slow  # a train.py start
def test_train_startup_line_states_the_dtype():
    """The [setup] line says what was chosen and why, before any model loads (here the run stops soon after it:
    the batch is larger than the data set)."""
    proc = run_script("train.py", "--data", "arith_test", "--batch-size", "100000", "--engine-dtype", "float32")
    assert proc.returncode == 2 and "fewer than --batch-size" in proc.stderr, proc.stderr[-2000:]
    want, why = S.choose_dtype("auto")
    assert f"[setup] dtype {want} ({why}); vllm engine dtype float32 (requested)" in proc.stdout.splitlines()


@pytest.mark.vllm
def test_rollout_cli_is_quiet(tiny_model_dir, tmp_path):
    """vLLM's INFO lines and known-harmless warnings stay off the console without --verbose."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"problem": "What is 1+1?", "answer": "2"}) + "\n")
    proc = run_script("rollout.py", "--model", tiny_model_dir, "--data", data, "--max-turns", "1", "--turn-tokens", "4",
                      "--enforce-eager", "--out", tmp_path / "r.jsonl")
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = (proc.stdout + proc.stderr).splitlines()
    assert not [line for line in console if " INFO " in line], console
    assert "[setup] vllm engine dtype" in proc.stderr
    assert len(console) < 12, console  # ~50 lines of vLLM configuration and warnings before


KEEP_FREED_PROBE = r"""
import ctypes, json, resource
import torch
from infra import system as S

class MallInfo2(ctypes.Structure):  # glibc >= 2.33
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
SIZE = 64 << 20  # over glibc's largest mmap threshold (32 MB)

libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def alloc_free(use_torch):  # -> (bytes mmapped while it lives, heap bytes after it is freed, page faults to write it)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    if use_torch:
        x = torch.ones(SIZE // 4)      # float32: every page written
    else:                              # glibc alone: no other allocation in between, so reuse is deterministic
        x = libc.malloc(SIZE)
        ctypes.memset(x, 1, SIZE)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    mmapped = libc.mallinfo2().hblkhd
    libc.free(x) if not use_torch else None
    del x
    return dict(mmapped=mmapped, heap_after=libc.mallinfo2().arena, faults=faults)

out = dict(default=[alloc_free(t) for t in (True, False, False)], cuda=S.keep_freed_memory("cuda"))
out["after_cuda"] = [alloc_free(t) for t in (True, False, False)]
out["applied"] = S.keep_freed_memory("cpu")
out["kept"] = [alloc_free(t) for t in (True, False, False)]
print(json.dumps(out))
"""


def run_probe(code):
    """`python -c CODE` in a clean process from the repository root -> (the JSON its last stdout line holds, stderr)."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1]), proc.stderr


def page_size():
    """What one page fault maps for a large fresh block: a 2 MB huge page where transparent huge pages are
    'always' on (a machine set up for GPUs often is), else 4 KiB."""
    thp = Path("/sys/kernel/mm/transparent_hugepage")
    try:
        if "[always]" in (thp / "enabled").read_text():
            return int((thp / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        pass
    return 4096


def test_keep_freed_memory_keeps_large_blocks_in_the_heap(tmp_path):
    """glibc maps a 64 MB block on its own, unmaps it when freed and page-faults every page again on the next
    allocation; after keep_freed_memory("cpu") the block comes from the heap, stays there when freed and is
    reused without faults. A CUDA device leaves glibc alone."""
    if not hasattr(__import__("ctypes").CDLL(None), "mallinfo2"):
        pytest.skip("not glibc >= 2.33")
    r, _ = run_probe(KEEP_FREED_PROBE)
    size = 64 << 20
    pages = size // page_size()
    for before in r["default"] + r["after_cuda"]:                  # glibc's default, also after the CUDA call
        assert before["mmapped"] >= size and before["faults"] >= pages // 2, r
    assert r["cuda"] is False and r["applied"] is True
    for kept in r["kept"]:
        assert kept["mmapped"] < size <= kept["heap_after"], r   # from the heap (torch's too), kept there when freed
    assert r["kept"][2]["faults"] < pages // 10, r               # and reused without touching the kernel


FREEZE_PROBE = """
import gc, json, sys, time, weakref
import torch
from transformers import AutoModelForCausalLM  # noqa: F401 (torch._dynamo and triton with it)
from infra.system import freeze_imports

class Node:
    pass

def full_collection_s():
    t = time.perf_counter()
    gc.collect()
    return time.perf_counter() - t

before = full_collection_s()
freeze_imports()
a, b = Node(), Node()
a.other, b.other = b, a  # a cycle made after the freeze, as a model's or FSDP's are
alive = weakref.ref(a)
del a, b
after = full_collection_s()
print(json.dumps(dict(before=before, after=after, frozen=gc.get_freeze_count(), cycle_freed=alive() is None)))
sys.stdout.flush()
"""


def test_freeze_imports_sets_the_imports_aside_and_later_cycles_are_still_collected():
    """After system.freeze_imports a full collection skips what the imports made (torch's and transformers' modules)
    and still frees a cycle made afterwards; the normal exit unfreezes them (no leak report from native bindings,
    which the frozen objects would never reach at finalisation)."""
    r, stderr = run_probe(FREEZE_PROBE)
    assert r["frozen"] > 100_000 and r["cycle_freed"], r
    assert r["after"] < r["before"] / 5, r  # (a pass over ~10^5 objects against one over the few made since)
    assert "leaked" not in stderr, stderr[-2000:]
