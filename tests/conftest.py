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
