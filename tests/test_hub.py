"""infra/hub.py through data.py: `limo` and `r1_220k` without --input fetch from a local HTTP server standing in for the
Hugging Face hub (HF_ENDPOINT), into a fresh cache (HF_HOME), then work from that cache without the server; a hub
that cannot be reached or answers 404 is one `error:` line naming --input, and nothing under --out."""
import hashlib
import io
import json
import os
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import run_script

import data
from infra import hub as hub_module

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # the one commit of every fake repository
API = re.compile(r"^/api/datasets/([^/]+/[^/]+)/(revision|tree)/([^/]+)")
RESOLVE = re.compile(r"^/datasets/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


class FakeHub:
    """A local stand-in for huggingface.co serving dataset repositories {repo: {path: bytes}} at COMMIT: the repo
    info, the tree listing and HEAD/GET of each file that huggingface_hub's snapshot_download asks for. Unknown
    repositories and files get the hub's 404s; `broken` answers a bare 404 to everything. Requests are logged as
    (method, path)."""

    def __init__(self, repos, broken=False):
        self.repos, self.broken, self.log = repos, broken, []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self):
                hub.answer(self, body=False)

            def do_GET(self):
                hub.answer(self, body=True)

            def log_message(self, *args):  # not on the test's stderr
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()

    def answer(self, req, body):
        path = unquote(urlsplit(req.path).path)
        self.log.append((req.command, path))
        api, resolve = API.match(path), RESOLVE.match(path)
        repo = (api or resolve) and self.repos.get((api or resolve).group(1))
        if self.broken or repo is None:
            return self.send(req, 404, b"", body, {} if self.broken else {"X-Error-Code": "RepoNotFound"})
        sha = (api or resolve).group(3 if api else 2)  # a commit asked for by its id is that commit
        sha = sha if re.fullmatch(r"[0-9a-f]{40}", sha) else COMMIT
        if api and api.group(2) == "revision":
            info = {"id": api.group(1), "sha": sha, "siblings": [{"rfilename": p} for p in repo]}
            return self.send(req, 200, json.dumps(info).encode(), body, {"Content-Type": "application/json"})
        if api:
            tree = [{"type": "file", "path": p, "size": len(b), "oid": oid(b)} for p, b in repo.items()]
            return self.send(req, 200, json.dumps(tree).encode(), body, {"Content-Type": "application/json"})
        blob = repo.get(resolve.group(3))
        if blob is None:
            return self.send(req, 404, b"", body, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": sha})
        self.send(req, 200, blob, body, {"X-Repo-Commit": sha, "ETag": f'"{oid(blob)}"'})

    @staticmethod
    def send(req, status, payload, body, headers):
        req.send_response(status)
        for k, v in {**headers, "Content-Length": str(len(payload))}.items():
            req.send_header(k, v)
        req.end_headers()
        if body:
            req.wfile.write(payload)

    def downloads(self):
        """The files fetched (GET of a resolve URL) so far."""
        return [p.split("/resolve/", 1)[1].split("/", 1)[1] for m, p in self.log if m == "GET" and "/resolve/" in p]


def oid(blob):
    return hashlib.sha1(blob).hexdigest()


def parquet_bytes(rows):
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


LIMO_ROWS = [{"question": f"LIMO problem {i}", "solution": f"sol {i}", "answer": str(i)} for i in range(20)]


def r1_row(n, answer="5", question_type="math-word-problem"):
    return {"problem": f"R1 problem {n}", "solution": "s", "answer": answer, "problem_type": "Algebra",
            "question_type": question_type, "source": "olympiads", "uuid": f"uuid-{n}",
            "generations": ["long text"], "correctness_math_verify": [True]}


# Two shards of the default config; rows 4 (a proof) and 9 (multiple choice) are filtered out.
R1_SHARDS = [[r1_row(n) for n in range(5)], [r1_row(n) for n in range(5, 12)]]
R1_SHARDS[0][4], R1_SHARDS[1][4] = r1_row(4, "proof", "proof"), r1_row(9, "B", "MCQ")
R1_KEPT = {f"uuid-{n}" for n in range(12)} - {"uuid-4", "uuid-9"}
REPOS = {
    "GAIR/LIMO": {"limo.jsonl": "".join(json.dumps(r) + "\n" for r in LIMO_ROWS).encode(), "README.md": b"# LIMO\n"},
    "open-r1/OpenR1-Math-220k": {
        "README.md": b"# OpenR1\n",
        "data/train-00000-of-00002.parquet": parquet_bytes(R1_SHARDS[0]),
        "data/train-00001-of-00002.parquet": parquet_bytes(R1_SHARDS[1]),
        "extended/train-00000-of-00001.parquet": parquet_bytes([r1_row(n) for n in range(100, 104)]),  # not ours
    },
}


@pytest.fixture
def fake_hub():
    hubs = []

    def start(repos=REPOS, broken=False):
        hubs.append(FakeHub(repos, broken))
        return hubs[-1]
    yield start
    for h in hubs:
        h.stop()


def unused_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hub_env(home, endpoint, **extra):
    """This environment without HF settings or proxies, pointed at `endpoint` with its own cache under `home`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_")) and not k.lower().endswith("_proxy")}
    return {**env, "HF_HOME": str(home), "HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_TELEMETRY": "1", **extra}


def run_data(env, *argv):
    return run_script("data.py", *argv, env=env, timeout=120)


def splits(out):
    return {s: pq.read_table(Path(out) / f"{s}.parquet").to_pylist() for s in ("train", "test")}


def by_hand(tmp_path, cmd, files, *flags):
    """data.py CMD --input FILES: the same files given by hand, in process."""
    paths = []
    for name, blob in files:
        paths.append(tmp_path / "by_hand" / name)
        paths[-1].parent.mkdir(parents=True, exist_ok=True)
        paths[-1].write_bytes(blob)
    data.main([cmd, "--input", *map(str, paths), "--out", str(tmp_path / "want"), *flags])
    return splits(tmp_path / "want")


def one_error_line(r):
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def test_limo_from_hub_then_from_cache(tmp_path, fake_hub):
    hub = fake_hub()
    env = hub_env(tmp_path / "hf", hub.url)
    r = run_data(env, "limo", "--out", tmp_path / "a")
    assert r.returncode == 0, r.stderr
    assert hub.downloads() == ["limo.jsonl"]  # the dataset's file, nothing else of the repository
    got = splits(tmp_path / "a")
    assert (len(got["train"]), len(got["test"])) == (18, 2)
    assert got == by_hand(tmp_path, "limo", [("limo.jsonl", REPOS["GAIR/LIMO"]["limo.jsonl"])])
    assert sorted(t["extra_info"]["question"] for t in got["train"] + got["test"]) == \
        sorted(r["question"] for r in LIMO_ROWS)

    r = run_data(env, "limo", "--out", tmp_path / "b")  # hub up: asks for the commit, downloads nothing
    assert r.returncode == 0, r.stderr
    assert hub.downloads() == ["limo.jsonl"] and splits(tmp_path / "b") == got
    hub.stop()
    r = run_data(env, "limo", "--out", tmp_path / "c")  # hub gone: the cached copy
    assert r.returncode == 0, r.stderr
    assert splits(tmp_path / "c") == got


def test_revision_picks_the_commit_fetched(tmp_path, fake_hub):
    hub = fake_hub()
    other = "89abcdef" * 5
    r = run_data(hub_env(tmp_path / "hf", hub.url), "limo", "--revision", other, "--out", tmp_path / "a")
    assert r.returncode == 0, r.stderr
    assert hub.log and all(other in p for _, p in hub.log) and f"at commit {other}" in r.stdout


def test_r1_220k_shards_from_hub_then_offline(tmp_path, fake_hub):
    hub = fake_hub()
    env = hub_env(tmp_path / "hf", hub.url)
    r = run_data(env, "r1_220k", "--out", tmp_path / "a", "--test-frac", "0.25")
    assert r.returncode == 0, r.stderr
    shards = sorted(p for p in REPOS["open-r1/OpenR1-Math-220k"] if p.startswith("data/"))
    assert sorted(hub.downloads()) == shards  # both shards of the default config, not extended/ nor README.md
    got = splits(tmp_path / "a")
    assert {t["extra_info"]["id"] for t in got["train"] + got["test"]} == R1_KEPT
    assert len(got["test"]) == 2  # round(10 * 0.25)
    want = by_hand(tmp_path, "r1_220k", [(Path(p).name, REPOS["open-r1/OpenR1-Math-220k"][p]) for p in shards],
                   "--test-frac", "0.25")
    assert got == want

    offline = {**env, "HF_HUB_OFFLINE": "1"}
    r = run_data(offline, "r1_220k", "--out", tmp_path / "b", "--test-frac", "0.25")
    assert r.returncode == 0, r.stderr
    assert splits(tmp_path / "b") == got and len(hub.downloads()) == len(shards)

    # A shard gone from the cache: offline, the rest is not passed off as the dataset.
    pinned = hub_module.DATASETS["r1_220k"]["revision"]  # the commit asked for, not the branch's head
    assert any(f"/{pinned}" in p for _, p in hub.log) and f"at commit {pinned}" in r.stdout
    snapshot = tmp_path / "hf" / "hub" / "datasets--open-r1--OpenR1-Math-220k" / "snapshots" / pinned
    (snapshot / shards[1]).unlink()
    r = run_data(offline, "r1_220k", "--out", tmp_path / "c")
    line = one_error_line(r)
    assert "data.py r1_220k: cannot fetch open-r1/OpenR1-Math-220k" in line and "HF_HUB_OFFLINE" in line
    assert "--input train-*.parquet" in line
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("cmd, repo, file", [("limo", "GAIR/LIMO", "limo.jsonl"),
                                             ("r1_220k", "open-r1/OpenR1-Math-220k", "train-*.parquet")])
def test_no_hub_and_empty_cache_is_one_line(tmp_path, cmd, repo, file):
    r = run_data(hub_env(tmp_path / "hf", f"http://127.0.0.1:{unused_port()}"), cmd, "--out", tmp_path / "out")
    line = one_error_line(r)
    assert line.startswith(f"error: data.py {cmd}: cannot fetch {repo} from the Hugging Face hub (")
    assert f"/datasets/{repo}/tree/{hub_module.DATASETS[cmd]['revision']} and pass --input {file}" in line
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


def test_offline_with_empty_cache_is_one_line(tmp_path):
    env = hub_env(tmp_path / "hf", f"http://127.0.0.1:{unused_port()}", HF_HUB_OFFLINE="1")
    line = one_error_line(run_data(env, "limo", "--out", tmp_path / "out"))
    assert "cannot fetch GAIR/LIMO: HF_HUB_OFFLINE is set and the cache holds no complete copy" in line
    assert line.endswith("and pass --input limo.jsonl") and not (tmp_path / "out").exists()


@pytest.mark.parametrize("broken", [False, True], ids=["unknown_repo", "bare_404"])
def test_hub_answering_404_is_one_line(tmp_path, fake_hub, broken):
    hub = fake_hub(repos={}, broken=broken)
    r = run_data(hub_env(tmp_path / "hf", hub.url), "limo", "--out", tmp_path / "out")
    line = one_error_line(r)
    assert "cannot fetch GAIR/LIMO from the Hugging Face hub (HTTP 404" in line and "--input limo.jsonl" in line
    assert hub.log and not (tmp_path / "out").exists()
