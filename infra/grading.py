"""A killable worker pool for slow grading (reward.py's math-verify path).

A comparison can hang (sympy on an adversarial answer), and math-verify's own timeouts use SIGALRM,
which only works on the main thread. So each comparison runs in a persistent worker process (a
"guard") that is killed and replaced when it exceeds its time limit: the kill is the limit, and it
works from any thread and inside torchrun workers. Guards are forked from a "zygote" that imported
the judge once, so a replacement costs milliseconds. Imports nothing of ours (the zygote imports the
judge's module by name).
"""
import atexit
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, wait

STARTUP_S = 120.0  # the zygote imports sympy once: slow on a busy machine, not comparison time


def _zygote_main(fd, judge, warmup):
    """Zygote: import the judge and warm it up once, then fork a ready guard for each request (fork
    costs milliseconds, an import seconds). Guards share our process group, so when the parent
    goes away (EOF on the socket, even after a SIGKILL) one killpg also ends guards stuck in C."""
    import importlib
    import logging
    import resource
    logging.disable(logging.WARNING)  # "timeout disabled" warnings are expected: we are the timeout
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # killed guards are reaped by the kernel
    try:  # a runaway big-int computation fails with MemoryError instead of swapping
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    except (ValueError, OSError):
        pass
    sock = socket.socket(fileno=fd)
    module, name = judge.split(":")
    fn = getattr(importlib.import_module(module), name)
    fn(*warmup)  # pay imports and parser set-up before forking
    sock.sendall(b"r")
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, 1, 2)
        if not msg:
            os.killpg(0, signal.SIGKILL)
        pid = os.fork()
        if pid == 0:
            sock.close()
            try:
                _guard_main(fn, *fds)
            finally:
                os._exit(0)
        for f in fds:
            os.close(f)
        sock.sendall(pid.to_bytes(4, "little"))


def _guard_main(fn, rfd, wfd):
    """Guard: receive a task, answer bool(fn(*task)) (False when it raises), until the parent closes the pipe."""
    inp, out = Connection(rfd, writable=False), Connection(wfd, readable=False)
    while True:
        try:
            task = inp.recv()
        except EOFError:
            return
        try:
            ok = fn(*task)
        except Exception:
            ok = False
        out.send(bool(ok))


_ZYGOTE = {}  # proc, sock
_GUARDS = []  # forked guards: [0] serves is_equivalent, all of them serve score_batch
_LOCK = threading.Lock()


def _zygote(judge, warmup):
    if _ZYGOTE and _ZYGOTE["proc"].poll() is None:
        return _ZYGOTE["sock"]
    ours, theirs = socket.socketpair()  # not inherited by other children: EOF when we die
    # the judge's module is imported from where the caller has it, and this module from above its package
    paths = [os.path.dirname(os.path.abspath(sys.modules[judge.split(":")[0]].__file__)),
             os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    code = (f"import sys; sys.path[:0] = {paths!r}; from infra import grading; "
            f"grading._zygote_main({theirs.fileno()}, {judge!r}, {warmup!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                            start_new_session=True)  # own process group, out of reach of the terminal's ^C
    theirs.close()
    ours.settimeout(STARTUP_S)
    try:
        ready = ours.recv(1)
    except OSError:  # timed out
        ready = b""
    if ready != b"r":
        proc.kill()
        raise RuntimeError(f"infra/grading.py: the {judge} worker failed to start (is math-verify installed? "
                           "see its traceback above)")
    _ZYGOTE.update(proc=proc, sock=ours)
    return ours


def _start(judge, warmup, retry=True):
    sock = _zygote(judge, warmup)
    r1, w1 = os.pipe()  # parent -> guard (os.pipe fds are not inherited by other children)
    r2, w2 = os.pipe()  # guard -> parent
    try:
        socket.send_fds(sock, [b"f"], [r1, w2])
        reply = sock.recv(4, socket.MSG_WAITALL)
    except OSError:
        reply = b""
    finally:
        os.close(r1)
        os.close(w2)
    if len(reply) < 4:  # the zygote died: start a new one, once (and never os.kill pid 0)
        for fd in (w1, r2):
            os.close(fd)
        _ZYGOTE["proc"].kill()
        if retry:
            return _start(judge, warmup, retry=False)
        raise RuntimeError(f"infra/grading.py: the {judge} worker keeps dying")
    pid = int.from_bytes(reply, "little")
    return {"pid": pid, "send": Connection(w1, readable=False), "recv": Connection(r2, writable=False)}


def _restart(i, judge, warmup, kill=True):
    if kill:  # not when it is known dead: its pid may already belong to someone else
        try:
            os.kill(_GUARDS[i]["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
    _GUARDS[i]["send"].close()
    _GUARDS[i]["recv"].close()
    _GUARDS[i] = _start(judge, warmup)


def run(tasks, workers, timeout, judge, warmup=()):
    """Verdicts bool(judge(*task)) for tasks [(pred, golds)] on `workers` guards, in order. A task gets
    `timeout` seconds per gold; then its guard is killed (and replaced) and the verdict is False.
    judge: "module:function", imported once in the zygote and first called with `warmup` there
    (one judge per process: the first call's)."""
    out = [False] * len(tasks)
    if not tasks:  # the fast path decided everything: no worker needed
        return out
    with _LOCK:
        while len(_GUARDS) < workers:
            _GUARDS.append(_start(judge, warmup))
        todo, busy = list(range(len(tasks)))[::-1], {}  # busy: guard index -> (task, deadline)
        while todo or busy:
            for i in range(workers):
                if todo and i not in busy:
                    t = todo.pop()
                    try:
                        _GUARDS[i]["send"].send(tasks[t])
                        busy[i] = (t, time.monotonic() + timeout * len(tasks[t][1]))
                    except OSError:  # it died while idle
                        todo.append(t)
                        _restart(i, judge, warmup, kill=False)
            left = min([d for _, d in busy.values()], default=0.0) - time.monotonic()
            ready = wait([_GUARDS[i]["recv"] for i in busy], max(left, 0.0))
            for i in list(busy):
                if _GUARDS[i]["recv"] in ready:
                    try:
                        msg = _GUARDS[i]["recv"].recv()
                    except (EOFError, OSError):
                        msg = None
                    out[busy.pop(i)[0]] = bool(msg)
                    if msg is None:  # it crashed
                        _restart(i, judge, warmup, kill=False)
                elif time.monotonic() > busy[i][1]:
                    busy.pop(i)  # over its limit: the verdict stays False
                    _restart(i, judge, warmup)
    return out


def _shutdown():
    if _ZYGOTE:
        _ZYGOTE["sock"].close()  # EOF: the zygote kills its guards and itself


def _after_fork():
    global _LOCK
    _LOCK = threading.Lock()
    for g in _GUARDS:  # the parent's workers are not ours: drop our copies of their fds
        g["send"].close()
        g["recv"].close()
    _shutdown()
    _GUARDS.clear()
    _ZYGOTE.clear()


os.register_at_fork(after_in_child=_after_fork)
atexit.register(_shutdown)
