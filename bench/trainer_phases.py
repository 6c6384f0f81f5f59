"""The trainer's two GPU-heavy phases as train.py runs them, for bench/train_bench.py (CPU) and bench/gpu_bench.py:
the no-grad log-prob pass and the PPO update, on rollout-like trajectories, through this checkout's code or an
earlier one's (--code DIR: a copy of an older commit, for before/after on one machine in one run), plus the same
tokens through the bare transformers model one unpadded sequence at a time."""
import importlib
import os
import sys
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]


def load_code(code_dir=None):
    """model, parallel, train, setup, packing (None before it existed) and system of code_dir (default: this
    checkout), under the names of the flat layout whatever the version's: where the plumbing lives in infra/,
    `parallel` is its collectives, sharding, weights and export modules, and `model` holds hf.py's loaders too."""
    os.environ.setdefault("MUTIS_MODELS_DIR", str(ROOT / "models"))  # one prepared SmolLM2 for every version
    code = Path(code_dir or ROOT).resolve()
    sys.path.insert(0, str(code))
    imp = importlib.import_module
    if (code / "infra").is_dir():
        model, infra = imp("model"), [imp(f"infra.{m}") for m in ("collectives", "sharding", "weights", "hf_export")]
        joined = lambda *mods: SimpleNamespace(**{k: v for m in mods for k, v in vars(m).items()})  # noqa: E731
        return SimpleNamespace(model=joined(imp("infra.hf"), model), parallel=joined(*infra), train=imp("train"),
                               setup=imp("train_setup"), packing=imp("infra.packing"), system=imp("infra.system"))
    mods = {name: imp(name) for name in ("model", "parallel", "train")}
    mods["packing"] = imp("packing") if (code / "packing.py").exists() else None
    mods["system"] = imp("system") if (code / "system.py").exists() else mods["model"]
    # train.py's setup helpers (make_optimizer) moved to trainer_setup.py; older versions keep them in train.py
    mods["setup"] = imp("trainer_setup") if (code / "trainer_setup.py").exists() else mods["train"]
    return SimpleNamespace(**mods)


def rollout_like(n, vocab, seed, prompt=(80, 120), response=(64, 192), turn=64, intervention=12, every=3):
    """Trajectories as rollout.sample returns them; every `every`-th one with a turn cut after `turn` tokens and an
    intervention (`intervention` context tokens, action mask 0) after it, then every further turn too."""
    g = torch.Generator().manual_seed(seed)
    ints = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    trajs = []
    for i in range(n):
        p, r = ints(*prompt), ints(*response)
        action = [1] * r
        if i % every == 0:
            for start in range(turn, r - intervention, turn + intervention):
                action[start:start + intervention] = [0] * intervention
        trajs.append(dict(prompt_ids=torch.randint(0, vocab, (p,), generator=g).tolist(),
                          response_ids=torch.randint(0, vocab, (r,), generator=g).tolist(),
                          action_mask=action, rollout_logprobs=[0.0] * r))
    return trajs


class Phases:
    """The log-prob pass and the update through one code version's API (packed: this checkout; padded: before)."""

    def __init__(self, code, targs, autocast, device):
        self.code, self.targs, self.autocast, self.device = code, targs, autocast, device
        self.packed = code.packing is not None

    def micro(self, batch, rows):
        t = self.targs
        if self.packed:
            return self.code.packing.micro_batches(batch, rows, t.micro_batch_size, t.micro_batch_tokens, self.device)
        return self.code.parallel.micro_batches(batch, rows, t.micro_batch_size)

    def padding(self, batch, groups):
        """Share of the computed tokens that are padding."""
        counts = self.counts(batch, groups)
        return counts["padding"] / max(counts["computed"], 1)

    def counts(self, batch, groups):
        """{"padding", "computed"} tokens of these micro-batches as this code version lays them out."""
        return (self.code.packing or self.code.parallel).padding_counts(batch, groups)

    def logprobs(self, model, batch):
        M, T = self.code.model, self.targs.temperature
        if self.packed:
            return self.code.packing.forward_pass(lambda mb: M.token_logprobs(model, mb, temperature=T), batch,
                                                  self.autocast, self.device, self.targs.micro_batch_size,
                                                  self.targs.micro_batch_tokens)
        return self.code.parallel.forward_pass(
            lambda x: M.token_logprobs(model, x["input_ids"], x["attention_mask"], x["response_start"], temperature=T),
            batch, self.targs.micro_batch_size, self.autocast, self.device)

    def update(self, actor, opt, batch, mini):
        rows = self.micro(batch, mini) if self.packed else mini
        return self.code.train.ppo_update(actor, None, opt, None, batch, rows, self.targs, self.autocast, self.device)


def plain_pass(model, trajs, autocast, grad, temperature, device):
    """The bare model, one unpadded sequence at a time: forward (head on the response positions only), log-prob
    of each response token (+ entropy and backward when grad)."""
    for t in trajs:
        ids = torch.tensor([t["prompt_ids"] + t["response_ids"]], device=device)
        r = len(t["response_ids"])
        with (nullcontext() if grad else torch.no_grad()), autocast():
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=r + 1).logits[:, :-1].float() / temperature
            logp = torch.log_softmax(logits, -1)
            token = logp.gather(-1, ids[:, -r:, None]).squeeze(-1)
            if grad:
                entropy = -(logp.exp() * logp).sum(-1)
                (token.sum() + 0.001 * entropy.sum()).backward()
