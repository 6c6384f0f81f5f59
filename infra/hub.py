"""The Hugging Face hub copies of the datasets data.py preprocesses: `fetch_dataset(name)` downloads a dataset's
files into the normal Hugging Face cache (HF_HOME; a second call downloads nothing and works offline) with
huggingface_hub's progress bars, and returns their local paths. Imports huggingface_hub only when fetching."""
from pathlib import Path

# data.py's command -> where its dataset lives on the hub. `files` are glob patterns, so the shard count of a
# sharded dataset is read from the repository, not written here.
# `revision`: what is fetched unless data.py's --revision names another branch, tag or commit. OpenR1's is the commit
# whose tree has data/, extended/ and all/. LIMO's head commit is b60f446 on the hub, whose full id this code has not
# seen: its branch until then. data.py prints the commit each fetch resolved to.
DATASETS = {
    "limo": {"repo": "GAIR/LIMO", "revision": "main", "files": ("limo.jsonl",)},  # the 817 problems, one file
    # The `default` config (93.7k rows, 10 shards, 2.1 GB); `extended/` and `all/` hold the other configs.
    "r1_220k": {"repo": "open-r1/OpenR1-Math-220k", "revision": "e4e141ec9dea9f8326f4d347be56105859b2bd68",
                "files": ("data/train-*.parquet",)},
}


class HubError(RuntimeError):
    """The files could not be fetched; the message is one line: why, and what to download by hand instead."""


def fetch_dataset(name, revision=None):
    """(local paths (sorted) of dataset `name`'s files at `revision` (default: DATASETS'), the commit they are from),
    downloaded unless already cached; raises HubError."""
    from huggingface_hub import HfApi, constants, snapshot_download

    ds = dict(DATASETS[name], **({"revision": revision} if revision else {}))
    page = f"{constants.ENDPOINT}/datasets/{ds['repo']}/tree/{ds['revision']}"
    by_hand = (f"download {' '.join(ds['files'])} from {page} and pass "
               f"--input {' '.join(Path(f).name for f in ds['files'])}")
    try:
        # Asks for the revision first: a hub out of reach fails fast here and the cache answers, where
        # snapshot_download would retry listing a commit for half a minute, a warning line each time.
        cached = bool(constants.HF_HUB_OFFLINE)
        if not cached:
            try:
                HfApi().repo_info(ds["repo"], repo_type="dataset", revision=ds["revision"])
            except Exception as e:  # the hub's own answer (404, 401) stands; no answer at all means the cache
                if getattr(getattr(e, "response", None), "status_code", None) is not None:
                    raise
                cached = True
        # Lists the repository, then fetches the matching files. From the cache it returns the snapshot only if
        # the listing it cached shows every matching file there: a partial download never passes for the dataset.
        folder = snapshot_download(ds["repo"], repo_type="dataset", revision=ds["revision"],
                                   allow_patterns=list(ds["files"]), local_files_only=cached)
    except Exception as e:  # network, hub, cache or HTTP client (by version): the way out is the same, by hand
        why = (": HF_HUB_OFFLINE is set and the cache holds no complete copy" if constants.HF_HUB_OFFLINE
               else f" from the Hugging Face hub ({_reason(e)})")
        raise HubError(f"cannot fetch {ds['repo']}{why}; {by_hand}") from None
    paths = sorted(p for pattern in ds["files"] for p in Path(folder).glob(pattern))
    if not paths:
        raise HubError(f"{ds['repo']}@{ds['revision']} holds no {' '.join(ds['files'])}; {by_hand}")
    return paths, Path(folder).name  # (the cache's snapshots/<commit>/)


def _reason(error):
    """A few words for a failed fetch: the HTTP status if the hub answered one, else the first line of the error's
    cause (huggingface_hub wraps a refused connection in a long 'not in the cache' error)."""
    chain = [error]
    while chain[-1].__cause__ is not None and len(chain) < 10:
        chain.append(chain[-1].__cause__)
    for e in chain:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status is not None:
            return f"HTTP {status}" + (": not found, or it needs a login" if status in (401, 403, 404) else "")
    inner = chain[1] if len(chain) > 1 else error  # the first cause says what went wrong; deeper ones repeat it
    text = str(inner).strip().splitlines()
    return f"{type(inner).__name__}: {text[0][:120]}" if text else type(inner).__name__
