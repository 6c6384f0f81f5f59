"""The one place that relies on vLLM below its public `LLM` API (checked against vLLM 0.32; these paths move between
versions): engines.VLLMEngine's weight reload, its CPU sleep, its shutdown, its memory figures and its CPU sampler's
token ranks."""
import logging

import torch


def vllm_internal(llm, op, named_tensors=(), repack_tied_head=False):
    """The one place that relies on vLLM below its public `LLM` API (checked against vLLM 0.32; these paths
    move between versions). The engine is in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, also forced by
    external_launcher), so LLM.collective_rpc / LLM.apply_model call into the one worker directly, arguments
    as they are (a generator of tensors, a closure), nothing serialised.
      op="reload": load full (name, tensor) pairs in HF names, in place, through the worker's reload_weights
        (model.load_weights fails after start-up on the CPU backend: weights are repacked at load) -> vLLM's own
        warnings that a layer or parameter received nothing (layerwise.py "<Layer>: Failed to load weights",
        inplace.py "Following weights were not loaded ..."), taken off the console: the caller judges them.
      op="discard": what a GPU's sleep(level=2) leaves of the weights, on the CPU backend, which has no sleep mode:
        every parameter filled with NaN, and every packed CPU GEMM (a layer's `cpu_linear`, which holds its own
        copy of the weight) answering NaN, until a reload of that layer replaces it; buffers stay (the GPU worker
        saves and restores them).
      op="discarded": the parameters and layers a discard left that no reload has replaced since (names).
      op="largest_layer": bytes of the largest layer's own parameters (its share on this rank).
      op="shutdown": stop the engine core (LLM has no close()).
      op="activation_peak": the GPU worker's profiled activation peak (peak_activation_memory, set by
        determine_available_memory), which its KV cache was sized to leave room for."""
    if op == "shutdown":
        llm.llm_engine.engine_core.shutdown()
        return
    if op == "activation_peak":  # bytes, or None where the worker has no such measure (CPU, other versions)
        peaks = llm.collective_rpc(lambda worker: getattr(worker, "peak_activation_memory", None))
        return peaks[0] if peaks else None
    if op in ("discard", "discarded", "largest_layer"):
        return llm.apply_model({"discard": _discard, "discarded": _discarded,
                                "largest_layer": _largest_layer}[op])[0]
    assert op == "reload", op
    heard = _Unloaded()
    loggers = [logging.getLogger(f"vllm.model_executor.model_loader.reload.{m}") for m in ("layerwise", "inplace")]
    for log in loggers:
        log.addFilter(heard)
    try:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors)})
    finally:
        for log in loggers:
            log.removeFilter(heard)
    if repack_tied_head:
        def repack(model):
            # vLLM 0.32 CPU: a tied lm_head loads no tensor of its own, so its packed GEMM kept the old
            # embedding matrix while the embedding itself was updated; repack it from the current weight.
            lm_head = getattr(model, "lm_head", None)
            if hasattr(lm_head, "cpu_linear"):
                lm_head.quant_method.process_weights_after_loading(lm_head)
        llm.apply_model(repack)
    return heard.messages


class _Unloaded(logging.Filter):
    """Collects vLLM's warnings that a reload left something unloaded, and keeps them off the console."""

    def __init__(self):
        super().__init__()
        self.messages = []

    def filter(self, record):
        message = record.getMessage()
        if "Failed to load weights" in message or "were not loaded" in message:
            self.messages.append(message)
            return False
        return True


class _NaNLinear:
    """A discarded layer's GEMM: the layer's own output shape, every value NaN (uninitialised memory at worst)."""

    def __init__(self, packed):
        self.packed = packed

    def __call__(self, x, weight, bias=None):
        return self.packed(x, weight, bias).fill_(float("nan"))


def _discard(model):
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p.numel() and p.is_floating_point():
                p.data.fill_(float("nan"))
        if callable(getattr(module, "cpu_linear", None)) and not isinstance(module.cpu_linear, _NaNLinear):
            module.cpu_linear = _NaNLinear(module.cpu_linear)


def _discarded(model):
    layers = [f"{n}.weight (its packed GEMM)" for n, m in model.named_modules()
              if isinstance(getattr(m, "cpu_linear", None), _NaNLinear)]
    return layers + [n for n, p in model.named_parameters()
                     if p.numel() and p.is_floating_point() and bool(torch.isnan(p).any())]


def _largest_layer(model):
    return max((sum(p.numel() * p.element_size() for p in m.parameters(recurse=False)) for m in model.modules()),
               default=0)


def eager_token_ranks():
    """vLLM's sampler ranks each sampled token (how many logits reach its own) with a torch.compile'd kernel. On the
    CPU backend that is an inductor C++ build in every process: seconds at the first generate with a warm cache, over
    ten cold. The eager expression gives the same counts; its [B, V] bool temporary is what the kernel avoids on a
    GPU, and is small beside the logits on a CPU. Called on the CPU backend only, before the engine is built."""
    from vllm.v1.sample import sampler

    sampler.batched_count_greater_than = _count_at_least


def _count_at_least(x, values):
    return (x >= values).sum(-1)  # [B, V] >= [B, 1] -> [B]: the rank of each row's value, as vLLM's kernel counts it
