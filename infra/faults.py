"""Faults on shared clusters, for train.py's loop: preemption (SIGTERM, then SIGKILL 30 s later from torchrun and
SLURM alike), ranks that hang or die, and where in a step each happened.

Every phase of a step ends at a boundary that all ranks pass together (Guard.phase): each rank posts its arrival
and its SIGTERM flag in the process group's store, so a rank that does not arrive within --dist-timeout is named
by every survivor (one line, exit 1: torchrun can restart the group), and every rank takes the same decision on a
SIGTERM at the same point:
  - before the update has changed the weights (rollout, scoring, the no-grad passes, the update's first
    micro-batches): the step is abandoned (StepAbandoned) and train.py checkpoints the state it started from;
    the rollout and validation stop at the engine's next step (Guard.poll: their engine calls make no
    collectives beyond a tensor-parallel engine's own ranks, which decide together, and validation gathers its
    numbers only past the boundary), the no-grad passes and the update
    agree between micro-batches (Guard.check);
  - once an optimiser step has changed them: the step's update finishes (the safe point: its remaining
    mini-batches) and train.py checkpoints the step, its validation left pending for the resumed run.
The signal handler only sets a flag: nothing is raised inside an engine's scheduler or a `finally`; the code polls
the flag where stopping is safe. A watchdog thread sees the signal even while the main thread waits inside a
collective (a dead peer under NCCL): when no checkpoint is being written --shutdown-grace seconds later, it exits
with 143 instead of waiting for the SIGKILL.
"""
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager

import torch.distributed as dist

from infra.cli import error_line
from infra.collectives import RanksDisagree, group_any, wait_for_keys
from infra.engines import RolloutTimeout, SyncIncomplete

ARRIVE = "mutis/arrive"  # store keys ARRIVE/<boundary number>/<rank>: a rank's arrival and its SIGTERM flag
PREEMPTED = 143  # 128 + SIGTERM: schedulers and torchrun requeue / restart on a non-zero exit


class StepAbandoned(Exception):
    """Every rank agreed to stop before this step changed the weights: checkpoint the state the step started from."""


class Stopped(Exception):
    """Raised by Guard.poll inside an interruptible phase once a SIGTERM has arrived (the engines abort their
    unfinished requests and pass it on)."""


class Guard:
    def __init__(self, rank, world, timeout, grace, engine_group=None):
        self.rank, self.world, self.timeout, self.grace = rank, world, timeout, grace
        self.engine_group = engine_group  # the ranks of a tensor-parallel engine (--engine-tp): they stop together
        self.step, self.where = 0, "setup"
        self.signalled = threading.Event()  # a SIGTERM reached this rank
        self.stopping = False               # every rank agreed to stop after this step's weights changed
        self.weights_changed = False        # an optimiser step of the current step has run
        self.writing = False                # a checkpoint is being written: the watchdog lets it finish
        self.done = threading.Event()       # the orderly exit is complete
        self._interruptible, self._seq = False, 0
        # the group's store: its own for each torchrun restart (collectives.attempt_store), no stale arrivals
        self._store = dist.distributed_c10d._get_default_store() if world > 1 else None
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        signal.set_wakeup_fd(self._write)  # written by the C-level handler at once, even inside a blocking collective
        threading.Thread(target=self._watchdog, args=(read,), daemon=True).start()

    # ---- the signal

    def _on_signal(self, signum, frame):  # a flag and a clock only: the loops poll the flag where stopping is safe
        self.t_signal = getattr(self, "t_signal", time.monotonic())
        self.signalled.set()

    def poll(self):
        """Between engine steps of an interruptible phase: raise Stopped once a SIGTERM has arrived. The ranks of
        one tensor-parallel engine decide together (each of its steps is a collective over them): stop when any
        of them got the signal."""
        if not self._interruptible:
            return
        stop = self.signalled.is_set()
        if self.engine_group is not None:
            stop = group_any(stop, self.engine_group)
        if stop:
            raise Stopped

    def _watchdog(self, fd):
        while (byte := os.read(fd, 1)) != bytes([signal.SIGTERM]):
            if not byte:  # close(): the run ended
                return
        t0 = time.monotonic()
        while not self.done.wait(0.2):
            if time.monotonic() - t0 > self.grace and not self.writing:
                sys.stderr.write(error_line(f"SIGTERM: no checkpoint within --shutdown-grace {self.grace:g}s (step "
                                            f"{self.step}, {self.where}: another rank did not get there, or the phase "
                                            f"outlasted the grace); exiting"))
                sys.stderr.flush()
                os._exit(PREEMPTED)

    # ---- boundaries

    def start_step(self, step):
        self.step, self.weights_changed = step, False

    def run(self, name, fn, interruptible=False, commits=False, decides=True):
        """fn() as one phase of the step, ended by a boundary every rank passes together (see the module docstring)
        -> fn's result, or None when a SIGTERM cut an interruptible phase short on this rank (fn polls: Guard.poll;
        it makes no collective, so ranks may leave it at different points); then the boundary raises StepAbandoned
        before the weights changed, and sets `stopping` after. commits: the step cannot be abandoned once fn is
        done (the update: its optimiser and LR steps). decides=False: the boundary waits for every rank, nothing
        more (the checkpoint). A collective failing inside (a timeout, a dead peer), an engine call past
        --rollout-timeout, a tensor-parallel engine's ranks disagreeing or a weight sync leaving the engine
        incomplete is one line naming the step and the phase, exit 1."""
        self.where, result = name, None
        try:
            if not (interruptible and self.signalled.is_set() and self.engine_group is None):  # (a group polls)
                self._interruptible = interruptible
                result = fn()
        except Stopped:
            result = None
        except dist.DistError as e:
            self._die(f"a collective failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
        except (RanksDisagree, RolloutTimeout, SyncIncomplete) as e:  # (a tensor-parallel engine's ranks decide each
            self._die(str(e))                                          # together: they all get here)
        finally:
            self._interruptible = False
        self.weights_changed = self.weights_changed or commits
        if decides:
            self.boundary(name)
        else:
            self._arrive()
        return result

    def check(self):
        """Between micro-batches of the no-grad passes and the update (a collective: every rank calls it as often):
        abandon the step while its weights are unchanged."""
        if not self.weights_changed and self._arrive():
            raise StepAbandoned

    def boundary(self, name):
        """Wait for every rank to finish `name`; a rank missing after --dist-timeout is named in one line (exit 1).
        Then agree on the SIGTERM flags: stop now (StepAbandoned) or, the weights changed, after the step."""
        self.where = name
        if self._arrive() and not self.stopping:
            if not self.weights_changed:
                raise StepAbandoned
            self.stopping = True

    def _arrive(self):
        """Post this rank's arrival (with its SIGTERM flag) in the store, wait for every rank's -> any flag set."""
        if self.world == 1:
            return self.signalled.is_set()
        self._seq += 1
        keys = [f"{ARRIVE}/{self._seq}/{r}" for r in range(self.world)]
        self._store.set(keys[self.rank], "1" if self.signalled.is_set() else "0")
        if missing := wait_for_keys(self._store, keys, time.monotonic() + self.timeout):
            self._die(f"rank(s) {', '.join(str(r) for r, k in enumerate(keys) if k in missing)} did not arrive "
                      f"within --dist-timeout ({self.timeout:g}s)")
        flags = self._store.multi_get(keys)
        if self._seq > 1:  # every rank has passed the previous boundary: its key is no longer waited for
            self._store.delete_key(f"{ARRIVE}/{self._seq - 1}/{self.rank}")
        return any(f == b"1" for f in flags)

    def _die(self, what):
        sys.stderr.write(error_line(f"step {self.step}, {self.where}: {what}"))
        sys.stderr.flush()
        self.done.set()
        os._exit(1)  # not SystemExit: the process group's teardown would wait on the missing rank

    # ---- checkpoints and the exit

    @contextmanager
    def writing_checkpoint(self):
        self.writing = True
        try:
            yield
        finally:
            self.writing = False

    def close(self):
        """Give the process its default SIGTERM handling back (train.main may run inside another program)."""
        self.done.set()
        signal.signal(signal.SIGTERM, self._previous)
        signal.set_wakeup_fd(-1)
        os.close(self._write)  # the watchdog reads the end of the pipe and returns

    def exit_preempted(self, saved_step, master):
        if master:
            took = time.monotonic() - getattr(self, "t_signal", time.monotonic())
            saved = f"checkpointed step {saved_step}" if saved_step else "nothing to checkpoint before step 1"
            print(f"[signal] SIGTERM at step {self.step} ({self.where}): {saved} {took:.1f}s after the signal; "
                  f"exiting {PREEMPTED} to be requeued", flush=True)
        self.done.set()
        sys.stdout.flush()
        os._exit(PREEMPTED)  # no teardown: vLLM's and the process group's can block a preempted exit
