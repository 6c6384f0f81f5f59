"""eval.py's generation journal: every finished engine request on disk as it finishes, so a stopped evaluation
continues where it stopped (rerun it with the same arguments and --out).

OUT/journal/<checkpoint>.settings.json  what the completions depend on beyond their request (model, sampling,
                                        engine, dtype): a rerun under other settings dies instead of mixing them
OUT/journal/<checkpoint>.rank<R>.jsonl  one JSON line per finished request, appended and fsync'ed by rank R:
                                        {"key": sha1 of (input ids, max_tokens, seed), "ids": [...], "stopped": b}

A request is identified by what it sends the engine, not by its place in a batch: every rank indexes every rank's
lines on a rerun, so the number of ranks may change, and a multi-turn trajectory replays its finished turns and
asks the engine only for the rest. The index holds each line's place, not its tokens (about 150 bytes a request
whatever its length); a rank reads the lines of its own requests when it replays them. A SIGKILL can leave half a
line at the end of a file: it is ignored (and cut off before rank R appends to its own file again), so that
request is generated again, never duplicated.
"""
import hashlib
import json
import math
import os
import re
from pathlib import Path

from infra.cli import die, no_link, write_atomic
from infra.engines import Completion


def slot(name):
    """A file-name stem for a checkpoint argument: readable, and distinct for distinct arguments."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_.")[-48:] or "model"
    return f"{safe}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"


def request_key(ids, max_tokens, seed):
    return hashlib.sha1(json.dumps([list(ids), int(max_tokens), seed]).encode()).hexdigest()


def replayed(token_ids, stopped):
    """A Completion as the journal gives it back: the tokens and whether the model stopped (no log-probs kept)."""
    return Completion(list(token_ids), [math.nan] * len(token_ids), bool(stopped))


class Journal:
    """The finished requests of one checkpoint: `done` (key -> where its line is) from every rank's file, `get` reading
    one back, and `record` appending this rank's new ones."""

    def __init__(self, directory, name, rank, settings, flag="--out"):
        self.done, self.file, self.memory = {}, None, {}
        if directory is None:  # in memory only (tests, benchmarks)
            return
        self.dir = Path(directory)
        self.stem = slot(name)
        if self.dir.is_symlink():
            die(f"{self.dir} is a symbolic link: refusing to write the journal through it (remove it)")
        self.dir.mkdir(parents=True, exist_ok=True)
        meta = self.dir / f"{self.stem}.settings.json"
        text = json.dumps(settings, indent=1, sort_keys=True) + "\n"
        if meta.exists() and meta.read_text() != text:
            old = json.loads(meta.read_text())
            diff = sorted(k for k in settings.keys() | old.keys() if old.get(k) != settings.get(k))
            die(f"{flag} {self.dir.parent}: holds generations of {name} under other settings ({', '.join(diff)}); "
                f"use another {flag}, or --overwrite to replace them")
        write_atomic(meta, text)  # every rank writes the same text
        self.path = self.dir / f"{self.stem}.rank{rank}.jsonl"
        self._cut_torn_tail()
        for f in sorted(self.dir.glob(f"{self.stem}.rank*.jsonl")):
            self._index(f)
        self.file = os.fdopen(no_link(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "ab")

    def _index(self, path):
        """key -> (file, offset) of each whole line: a line starts with its key ({"key": "<40 hex digits>", ...)."""
        offset = 0
        with open(path, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break  # the half line a kill left
                if line.startswith(b'{"key": "') and len(line) > 50:
                    self.done[line[9:49].decode("ascii", "replace")] = (path, offset)
                offset += len(line)

    def get(self, key):
        """The Completion of a finished request, or None (unknown, or its line does not parse: generate it again)."""
        if key in self.memory:
            return self.memory[key]
        if key not in self.done:
            return None
        path, offset = self.done[key]
        with open(path, "rb") as f:
            f.seek(offset)
            try:
                rec = json.loads(f.readline())
                return replayed(rec["ids"], rec["stopped"])
            except (ValueError, KeyError, TypeError):
                return None

    def _cut_torn_tail(self):
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        keep = data.rfind(b"\n") + 1
        if keep < len(data):
            with os.fdopen(no_link(self.path, os.O_RDWR), "r+b") as f:
                f.truncate(keep)

    def record(self, key, completion):
        """Append one finished request and make it durable before going on (in memory only: keep it)."""
        if self.file is None:
            self.memory[key] = replayed(completion.token_ids, completion.stopped)
            return
        offset = self.file.tell()
        self.file.write((json.dumps({"key": key, "ids": list(completion.token_ids),
                                     "stopped": bool(completion.stopped)}) + "\n").encode())
        self.file.flush()
        os.fsync(self.file.fileno())
        self.done[key] = (self.path, offset)

    def close(self):
        if self.file is not None:
            self.file.close()


class Journaled:
    """An engine for rollout.sample that answers requests the journal holds and sends the engine only the others, all
    in one call (bounded by max_in_flight), recording each as it finishes. on_request(n): n more requests done
    (progress). Log-probs are not asked for: eval.py keeps none (NaN in the completions)."""

    def __init__(self, engine, journal, max_in_flight=None, on_request=None, on_call=None):
        self.engine, self.journal, self.max_in_flight = engine, journal, max_in_flight
        self.on_request, self.on_call = on_request or (lambda n: None), on_call or (lambda n: None)
        self.tokenizer, self.max_model_len = engine.tokenizer, engine.max_model_len

    def generate(self, prompt_token_ids, max_tokens, temperature=1.0, top_p=1.0, seed=None, stop=(), eos_ids=None,
                 timeout=None, poll=None):
        m = len(prompt_token_ids)
        limits = list(max_tokens) if isinstance(max_tokens, (list, tuple)) else [max_tokens] * m
        seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * m
        keys = [request_key(p, n, s) for p, n, s in zip(prompt_token_ids, limits, seeds)]
        got = {k: c for k in set(keys) if (c := self.journal.get(k)) is not None}  # replayed from the journal
        todo = [i for i, k in enumerate(keys) if k not in got]
        self.on_call(m)
        self.on_request(m - len(todo))

        def finished(j, completion):
            self.journal.record(keys[todo[j]], completion)
            got[keys[todo[j]]] = replayed(completion.token_ids, completion.stopped)
            self.on_request(1)

        if todo:
            self.engine.generate([prompt_token_ids[i] for i in todo], [limits[i] for i in todo], temperature=temperature,
                                 top_p=top_p, seed=[seeds[i] for i in todo], stop=stop, eos_ids=eos_ids,
                                 timeout=timeout, logprobs=False, on_finish=finished, max_in_flight=self.max_in_flight,
                                 poll=poll)
        return [got[k] for k in keys]
