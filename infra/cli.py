"""Command-line plumbing shared by every CLI: one-line errors, the parser, a positive-int flag type, writes that are
atomic and never follow a link.

Imports nothing of ours, so every module may import it.
"""
import argparse
import errno
import os
import sys
from pathlib import Path


def error_line(msg):
    """'error: msg' as one line to write at once (ranks sharing a pipe cannot split it), starting a line of its own:
    a tqdm bar redraws itself with \\r and has no newline until it closes, whether it is this process's or, under
    torchrun, local rank 0's on the terminal this rank shares."""
    from tqdm import tqdm

    drawn = len(getattr(tqdm, "_instances", ()))  # this process's open bars (a disabled bar does not register)
    shared = os.environ.get("LOCAL_RANK", "0") != "0"
    return ("\n" if drawn or shared else "") + "error: " + str(msg).replace("\n", " ") + "\n"


def die(msg):
    """A bad input: one line on stderr, exit code 2."""
    sys.stderr.write(error_line(msg))
    sys.stderr.flush()
    raise SystemExit(2)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose bad-flag errors are one `die` line (exit 2) instead of usage text. No abbreviations:
    `--intervention` must not silently mean `--intervention-text`, nor `--n` some other flag."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        die(message)


def positive_int(text):
    """argparse type of every count flag: an integer >= 1 (the error names the flag: 'argument --x: ...')."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def deprecated(old, new):
    """argparse action of a renamed flag: stores into `new`'s dest with a one-line notice on stderr."""
    class Renamed(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            sys.stderr.write(f"warning: {old} is deprecated, use {new}\n")
            setattr(namespace, self.dest, values)
    return Renamed


def no_link(path, flags=os.O_WRONLY | os.O_CREAT | os.O_TRUNC):
    """os.open(path, flags) for writing, refusing a symbolic link there in one line (exit 2): a link planted in an
    output directory (someone else's checkpoint directory, a shared one) must not make us write a file outside it."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            die(f"{path} is a symbolic link: refusing to write through it (remove it, or use another directory)")
        raise


def write_atomic(path, data):
    """Write text or bytes to a temp file beside `path`, then rename: a reader never sees half a file, and a link at
    `path` is replaced, never followed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")  # one per process: ranks never share a temp file
    try:
        tmp.unlink(missing_ok=True)  # (a link there: the link itself)
        with os.fdopen(no_link(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
