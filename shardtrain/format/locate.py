"""Why a URL is not an openable dataset, told apart so the message can carry the command that fixes it.

    no manifest.json at URL -> look (a bounded listing, only on this error path):
        nothing there                          -> wrong path: check it
        _pack.lock / _work/ / shards / index   -> a pack in progress or interrupted: wait, or re-run pack (resumes)
        audio or transcripts (3 levels deep,   -> an unpacked corpus: `shardtrain pack URL OUT`, then use OUT
        depth first)
        anything else                          -> not a dataset: check the path

Cost: at most MAX_LISTINGS directory listings (local: microseconds each; S3: one LIST request each), paid only
when opening failed.
"""
from __future__ import annotations

from shardtrain.format.safe import printable

AUDIO_SUFFIXES = (".flac", ".wav", ".opus", ".ogg", ".mp3", ".m4a", ".sph")
CORPUS_NAMES = ("wav.scp", "segments", "text", "manifest.tsv", "validated.tsv", "dataset_info.json",
                "dataset_dict.json", "state.json")
CORPUS_SUFFIXES = (".txt", ".lab", ".tsv", ".csv", ".jsonl", ".jsonl.gz", ".arrow", ".parquet")
PACK_NAMES = ("_pack.lock", "_work", "index.parquet", "rejects.jsonl")
MAX_LISTINGS = 24


def _kind(name: str) -> str | None:
    low = name.lower()
    if name in PACK_NAMES or (low.startswith("shard-") and low.endswith(".tar")):
        return "pack"
    if low.endswith(AUDIO_SUFFIXES):
        return "audio"
    if name in CORPUS_NAMES or low.endswith(CORPUS_SUFFIXES):
        return "corpus"
    return None


def _survey(url: str, storage_options: dict | None) -> tuple[bool, set[str]]:
    """(anything there, kinds found): the top level, then up to 3 levels of sub-folders, MAX_LISTINGS at most.

    Depth first, sub-folders in name order: a corpus keeps its audio at the bottom of a uniform tree (LibriSpeech
    `<spk>/<chapter>/`, thousands of speakers), so the first branch reaches it in 3 listings at any width; breadth
    first would spend the whole budget listing speaker folders.
    """
    from shardtrain import storage

    fs, path = storage.fs_and_path(url, storage_options)
    if fs.isfile(path):
        return True, {"file"}
    kinds: set[str] = set()
    stack, listed, found = [(path, 0)], 0, False
    while stack and listed < MAX_LISTINGS:
        folder, depth = stack.pop()
        try:
            entries = fs.ls(folder, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            continue
        listed += 1
        below = []
        for e in entries:
            found = True
            name = str(e["name"]).rstrip("/").rsplit("/", 1)[-1]
            kind = _kind(name)
            if kind == "pack" and depth > 0:
                kind = None  # a pack's own files are at its top level
            if kind:
                kinds.add(kind)
            if e.get("type") == "directory" and depth < 3 and kind != "pack":
                below.append((str(e["name"]), depth + 1))
        stack.extend(sorted(below, reverse=True))  # the first sub-folder by name is listed next
        if "pack" in kinds or "audio" in kinds:
            break
    return found, kinds


def nothing_there(url: str) -> str:
    """The line for a dataset URL where nothing exists (pure: the CLI says it before importing any reader)."""
    return f"no dataset at {printable(url, 200)}: nothing is there; check the path (a dataset is the OUTPUT folder " \
           f"of `shardtrain pack INPUT OUTPUT`)"


def missing_manifest_message(url: str, storage_options: dict | None = None) -> str:
    """One line for a URL without manifest.json: what is there, and the command that fixes it."""
    from shardtrain import storage

    shown = printable(url, 200)
    try:
        found, kinds = _survey(url, storage_options)
    except OSError:  # the listing itself failed: say what is known
        found, kinds = True, set()
    if not found and storage.exists(url, storage_options):
        return f"no dataset at {shown}: an empty folder; check the path (a dataset is the OUTPUT folder of " \
               f"`shardtrain pack INPUT OUTPUT`)"
    if not found:
        return nothing_there(url)
    if "file" in kinds:
        return f"{shown} is a file, not a dataset; pass the folder that `shardtrain pack INPUT OUTPUT` wrote " \
               f"(it holds manifest.json)"
    if "pack" in kinds:
        return f"incomplete dataset: no manifest.json at {shown} yet (a pack in progress or interrupted: it writes " \
               f"the manifest last); wait for the running pack, or re-run `shardtrain pack INPUT {shown}` (it resumes)"
    if kinds & {"audio", "corpus"}:
        return f"{shown} is an unpacked corpus (audio or transcripts, no manifest.json); pack it first: " \
               f"`shardtrain pack {shown} OUTPUT`, then pass OUTPUT"
    return f"no dataset at {shown}: no manifest.json and nothing `shardtrain pack` reads; check the path"
