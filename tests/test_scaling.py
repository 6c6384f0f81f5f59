"""bench/scaling.py: the parameter count against transformers' own, the memory model against docs/memory.md's 1.5B
measurements, --engine-tp's refusal, the 32B plan, and docs/scaling.md against what the script prints now."""
import importlib.util
import itertools
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("scaling", ROOT / "bench" / "scaling.py")
scaling = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scaling)

DEFAULTS = scaling.parse_args([])  # 8 x 79.6 GiB, the README's batch


@pytest.mark.parametrize("size", list(scaling.SHAPES))
def test_parameter_count_equals_transformers(size):
    """The count from the config alone equals the numel of transformers' Qwen2 built from the same numbers on the
    meta device (no memory), for the policy and for the critic (backbone + a hidden -> 1 value head)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Model

    cfg = scaling.SHAPES[size]
    config = Qwen2Config(**{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        actor = sum(p.numel() for p in Qwen2ForCausalLM(config).parameters())
        backbone = sum(p.numel() for p in Qwen2Model(config).parameters())
    counts = scaling.param_counts(cfg)
    assert counts["actor"] == actor
    assert counts["critic"] == backbone + cfg["hidden_size"] + 1
    if size == "1.5B":
        assert round(actor / 1e9, 2) == 1.78  # docs/memory.md
    if size == "7B":
        assert round(actor / 1e9, 2) == 7.62


def test_one_rank_state_matches_the_measured_1_5b():
    """docs/memory.md: 27.4 GiB at rest on one rank (actor + Adam + reference, --adv grpo). The model alone is within
    4 %; with the reference's root the bench left gathered, within 1 %. The update peaks within 5 %."""
    one = scaling.parse_args(["--gpus", "1", "--gpu-gib", "1000"])
    cfg = scaling.SHAPES["1.5B"]
    plan = dict(engine_tp=1, offload=False, grad_checkpointing=False, micro_batch_tokens=1, adv="grpo",
                gpu_memory_utilization=0.0)
    m = scaling.memory(cfg, plan, one)
    measured = scaling.MEASURED_1_5B["state"] * scaling.GIB
    assert abs(m["rest"] / measured - 1) < 0.04
    root = 2 * scaling.param_counts(cfg)["root"]
    assert abs((m["rest"] + root) / measured - 1) < 0.01
    for (ckpt, tokens), peak in scaling.MEASURED_1_5B["update"].items():
        m = scaling.memory(cfg, dict(plan, grad_checkpointing=ckpt, micro_batch_tokens=tokens), one)
        assert abs((m["update_peak"] - m["context"] + root) / (peak * scaling.GIB) - 1) < 0.05


def test_engine_tp_that_does_not_divide_the_heads_is_refused():
    with pytest.raises(ValueError, match="must divide"):
        scaling.check_tp(scaling.SHAPES["1.5B"], 3, 12)   # 12 heads, but 2 KV heads
    with pytest.raises(ValueError, match="must divide"):
        scaling.check_tp(scaling.SHAPES["7B"], 8, 8)      # 4 KV heads
    assert scaling.tp_sizes(scaling.SHAPES["32B"], 8) == [1, 2, 4, 8]
    with pytest.raises(SystemExit):
        scaling.parse_args(["--model", "7B", "--engine-tp", "8"])


def test_32b_fits_only_with_offload():
    cfg = scaling.SHAPES["32B"]
    for adv in ("gae", "grpo"):
        plan = scaling.search(cfg, DEFAULTS, adv)
        assert plan["fits"] and plan["offload"]
        assert plan["rollout_peak"] <= 0.95 * 79.6 * scaling.GIB and plan["update_peak"] <= 0.95 * 79.6 * scaling.GIB
    for k, ckpt, adv, tokens in itertools.product(scaling.tp_sizes(cfg, 8), (False, True), ("gae", "grpo"),
                                                 (16384, 8192, 4096)):
        m = scaling.memory(cfg, dict(engine_tp=k, offload=False, grad_checkpointing=ckpt, micro_batch_tokens=tokens,
                                     adv=adv, gpu_memory_utilization=None), DEFAULTS)
        assert not m["fits"], (k, ckpt, adv, tokens)


def test_the_doc_is_what_the_script_prints():
    """Regenerate with `python bench/scaling.py --write docs/scaling.md` when this fails."""
    assert scaling.generated(ROOT / "docs" / "scaling.md") == scaling.render(DEFAULTS)


def test_every_command_line_of_the_plan_parses():
    """docs/scaling.md's and the README's train.py command lines use flags train.py has, with values it takes."""
    import shlex

    import train

    lines = [line for doc in ("docs/scaling.md", "README.md") for line in (ROOT / doc).read_text().splitlines()
             if ("train.py --model /path/to/DeepSeek" in line or line.startswith("$T --model"))]
    assert len(lines) >= 8, lines
    for line in lines:
        argv = shlex.split(line.split("train.py", 1)[1] if "train.py" in line else line[len("$T"):])
        args = train.parse_args(argv)
        assert args.data == "data/limo"


@pytest.mark.parametrize("size", ["1.5B", "7B"])
def test_lora_parameter_count_equals_the_adapted_model(size):
    """lora_params from the config equals the trained numel of lora.adapt on transformers' Qwen2 (meta device)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from infra import lora
    from infra.hf import decoder_layers

    cfg = scaling.SHAPES[size]
    with torch.device("meta"):
        m = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in cfg.items() if k != "model_type"}))
    lora.adapt(m, decoder_layers(m), 16, 32, lora.TARGETS, torch.bfloat16)
    assert scaling.lora_params(cfg, 16) == sum(p.numel() for p in m.parameters() if p.requires_grad)
    assert all(p.dtype == torch.bfloat16 for p in m.parameters() if not p.requires_grad)


def test_lora_fits_7b_on_fewer_gpus_than_full_fine_tuning():
    """The LoRA table's claim: without --offload, 7B grpo needs 4 GPUs fully fine-tuned and 1 with adapters; the
    LoRA state at rest is the bf16 base plus 16 B per adapter parameter."""
    cfg = scaling.SHAPES["7B"]
    assert scaling.fewest_gpus(cfg, DEFAULTS, "grpo", 0)[0] == 4
    gpus, m = scaling.fewest_gpus(cfg, DEFAULTS, "grpo", 16)
    assert gpus == 1
    p = scaling.param_counts(cfg)["actor"]
    assert m["rest"] == pytest.approx(2 * p + 12 * scaling.lora_params(cfg, 16))
    assert m["grads"] == pytest.approx(4 * scaling.lora_params(cfg, 16))
