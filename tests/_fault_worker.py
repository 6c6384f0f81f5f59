"""train.main with one fault injected at a scripted point (test_faults.py): python _fault_worker.py FAULT TRAIN_ARGS...

FAULT is KIND:STEP[:RANK[:N]]: at step STEP (on rank RANK, default every rank), where KIND says:
  term-rollout    SIGTERM to this process inside the engine's generate call
  term-logprobs   SIGTERM inside the N-th no-grad log-prob micro-batch (default 1)
  term-update     SIGTERM inside the N-th update micro-batch (default 1)
  term-validate   SIGTERM as validation starts
  agent-*         the same points, but the SIGTERM goes to torchrun's agent, which sends it to every rank at once
                  (as under SLURM); agent-validate-late: this rank's validation first waits 5 s, so that the other
                  ranks have finished their shards and wait for it when the signal lands
  kill-rollout    SIGKILL this process inside its rollout (once: the first attempt of a torchrun group)
  stall-rollout   sleep 600 s inside the rollout (once)
  diverge-rollout this rank's tensor-parallel engine hands back one other token than its peers (--engine-tp)
The wall time of the signal goes to $FAULT_TIME_FILE (when set). "Once" is a marker file in $FAULT_ONCE_DIR where that is
set (the restart count cannot say it: an agent that restarts hung workers does not count that restart), else the
first attempt by TORCHELASTIC_RESTART_COUNT."""
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train  # noqa: E402
from infra import engines  # noqa: E402

kind, step, *rest = sys.argv[1].split(":")
step, rank = int(step), int(rest[0]) if rest and rest[0] != "*" else None
nth = int(rest[1]) if len(rest) > 1 else 1
me = int(os.environ.get("RANK", 0))
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
current, calls, validating = [0], {"logprobs": 0, "update": 0}, [False]


def fire(what):
    if what.startswith(("term", "agent")):
        if "FAULT_TIME_FILE" in os.environ:
            Path(os.environ["FAULT_TIME_FILE"]).write_text(str(time.time()))
        if what == "agent-validate-late":
            time.sleep(5)
        os.kill(os.getppid() if what.startswith("agent") else os.getpid(), signal.SIGTERM)
    elif what == "kill-rollout" and first_time(what):
        os.kill(os.getpid(), signal.SIGKILL)
    elif what == "stall-rollout" and first_time(what):
        time.sleep(600)


def first_time(what):
    if "FAULT_ONCE_DIR" not in os.environ:
        return first_attempt
    marker = Path(os.environ["FAULT_ONCE_DIR"]) / f"{what}.rank{me}"
    if marker.exists():
        return False
    marker.write_text("fired")
    return True


def here(what):
    """At the scripted step and rank, for the scripted kind (agent-X fires where term-X does)."""
    return current[0] == step and (rank is None or rank == me) and kind.replace("agent-", "term-") == what


real_sample_batch = train.sample_batch


def sample_batch(run, args, s, desc=None, poll=None):
    current[0] = s
    if here("kill-rollout") or here("stall-rollout"):
        fire(kind)
    return real_sample_batch(run, args, s, desc, poll)


def inside_generate(real):
    def generate(self, *a, **k):
        if here("term-rollout") or (validating[0] and here("term-validate-late")):
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


def validate(run, args, poll=None):
    if here("term-validate"):
        fire(kind)
    validating[0] = True
    try:
        return real_validate(run, args, poll)
    finally:
        validating[0] = False


real_agree = engines.VLLMEngine._agree


def agree(self, completions):
    if here("diverge-rollout"):
        completions[0].token_ids[-1] += 1
    return real_agree(self, completions)


print(f"[fault-worker] rank {me}, TORCHELASTIC_RESTART_COUNT {os.environ.get('TORCHELASTIC_RESTART_COUNT')}",
      file=sys.stderr, flush=True)
train.sample_batch, train.token_logprobs, train.validate = sample_batch, token_logprobs, validate
engines.HFEngine.generate = inside_generate(engines.HFEngine.generate)
engines.VLLMEngine.generate = inside_generate(engines.VLLMEngine.generate)
engines.VLLMEngine._agree = agree
train.main(sys.argv[2:])
from infra.system import exit_without_teardown  # noqa: E402

exit_without_teardown()  # as train.py ends
