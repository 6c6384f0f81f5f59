"""Command-line plumbing shared by every CLI: one-line errors, the parser, a positive-int flag type, atomic writes.

Imports nothing of ours, so every module may import it.
"""
import argparse
import os
import sys
from pathlib import Path


def die(msg):
    """A bad input: one line on stderr, exit code 2."""
    line = "error: " + str(msg).replace("\n", " ") + "\n"
    sys.stderr.write(line)  # one write: ranks sharing a pipe (PYTHONUNBUFFERED) cannot split the line
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


def write_atomic(path, data):
    """Write text or bytes to a temp file beside `path`, then rename: a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")  # one per process: ranks never share a temp file
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
