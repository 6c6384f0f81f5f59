"""Shared fixtures: models are built once per test session."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the flat top-level modules

import model  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_dir():
    """The embedded SmolLM2-135M-Instruct directory (prepared on first use)."""
    return model.resolve_model("smollm2")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random 2-layer Llama (hidden 128, head_dim 32) with the SmolLM2 tokenizer, fp32."""
    return model.make_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def vllm_two_rank_env():
    """Environment for a 2-rank torchrun test with a vLLM engine per rank; skips (with the reason printed)
    where that cannot run. vLLM's CPU build: both ranks on CPU with gloo. Its CUDA build cannot be forced
    onto the CPU, so 2 ranks need 2 GPUs (one per rank)."""
    import os

    import torch

    try:
        from vllm.platforms import current_platform
    except ImportError as e:
        reason = f"vLLM is not installed ({e})"
    else:
        if current_platform.is_cpu():
            return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        if torch.cuda.device_count() >= 2:
            return {**os.environ, "OMP_NUM_THREADS": "1"}
        reason = f"2 ranks with vLLM's CUDA build need 2 GPUs, found {torch.cuda.device_count()}"
    print(f"SKIP: {reason}", file=sys.stderr)
    pytest.skip(reason)
