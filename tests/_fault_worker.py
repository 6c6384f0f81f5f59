"""train.main with one fault injected at a scripted point (test_faults.py): python _fault_worker.py FAULT TRAIN_ARGS...

FAULT is KIND:STEP[:RANK[:N]]: at step STEP (on rank RANK, default every rank), where KIND says:
  term-rollout    SIGTERM to this process inside the engine's generate call
  term-logprobs   SIGTERM inside the N-th no-grad log-prob micro-batch (default 1)
  term-update     SIGTERM inside the N-th update micro-batch (default 1)
  term-validate   SIGTERM as validation starts
  kill-rollout    SIGKILL this process inside its rollout (first attempt of a torchrun group only)
  stall-rollout   sleep 600 s inside the rollout
The wall time of the signal goes to $FAULT_TIME_FILE."""
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import engines  # noqa: E402
import train  # noqa: E402

kind, step, *rest = sys.argv[1].split(":")
step, rank = int(step), int(rest[0]) if rest and rest[0] != "*" else None
nth = int(rest[1]) if len(rest) > 1 else 1
me = int(os.environ.get("RANK", 0))
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
current, calls = [0], {"logprobs": 0, "update": 0}


def fire(what):
    if what.startswith("term"):
        Path(os.environ["FAULT_TIME_FILE"]).write_text(str(time.time()))
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs at the next bytecode, inside this phase
    elif what == "kill-rollout" and first_attempt:
        os.kill(os.getpid(), signal.SIGKILL)
    elif what == "stall-rollout":
        time.sleep(600)


def here(what):
    return current[0] == step and (rank is None or rank == me) and kind == what


real_sample_batch = train.sample_batch


def sample_batch(run, args, s, desc=None):
    current[0] = s
    if here("kill-rollout") or here("stall-rollout"):
        fire(kind)
    return real_sample_batch(run, args, s, desc)


def inside_generate(real):
    def generate(self, *a, **k):
        if here("term-rollout"):
            fire(kind)
        return real(self, *a, **k)
    return generate


real_logprobs = train.token_logprobs


def token_logprobs(model, mb, *a, **k):
    phase = "update" if train.torch.is_grad_enabled() else "logprobs"
    calls[phase] += current[0] == step
    if here(f"term-{phase}") and calls[phase] == nth:
        fire(kind)
    return real_logprobs(model, mb, *a, **k)


real_validate = train.validate


def validate(run, args):
    if here("term-validate"):
        fire(kind)
    return real_validate(run, args)


train.sample_batch, train.token_logprobs, train.validate = sample_batch, token_logprobs, validate
engines.HFEngine.generate = inside_generate(engines.HFEngine.generate)
engines.VLLMEngine.generate = inside_generate(engines.VLLMEngine.generate)
train.main(sys.argv[2:])
