"""Datasets are untrusted input (issue 16): a copy of a real packed dataset, edited the way a hostile or broken
producer would, must give one clear error on open or a counted skip when read, never a crash, a wrong sample, a
read outside the dataset or a write outside the cache; the clean dataset still reads bit-identically."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from shardtrain.pack.nothing import NothingAccepted
from shardtrain.testing.indexes import write_index_dataset

from shardtrain import cli
from shardtrain.format.manifest import DatasetError, index_table, open_dataset, write_index
from shardtrain.format.tar import BLOCK
from shardtrain.load.config import StreamConfig
from shardtrain.load.loader import build_loader
from shardtrain.load.plan import BucketConfig
from shardtrain.load.reader import StreamError
from shardtrain.pack.packer import PackConfig, pack
from shardtrain.pack.verify import verify
from shardtrain.storage.cache import ShardCache
from shardtrain.testing.corpus import make_corpus
from shardtrain.world import World

SECRET = "db_password=hunter2"
_OPENED: list[str] = []


def _audit(event: str, args: tuple) -> None:
    if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # records every file this process opens (real opens; nothing is patched)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    root = tmp_path_factory.mktemp("untrusted")
    corpus = make_corpus(root / "corpus", [0.3 + 0.07 * i for i in range(12)], seed=3)
    pack(PackConfig(input=str(corpus), output=str(root / "ds"), max_samples_per_shard=4, workers=1, progress=False))
    return root / "ds"


@pytest.fixture
def copy(clean, tmp_path):
    """A private copy of the clean dataset, plus a file outside it that must never be read."""
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "creds.txt").write_text(SECRET + "\n" * 200)
    dst = tmp_path / "ds"
    shutil.copytree(clean, dst)
    return dst


def _manifest(d, fn) -> None:
    m = json.loads((d / "manifest.json").read_text())
    fn(m)
    (d / "manifest.json").write_text(json.dumps(m))


def _index(d, fn) -> None:
    rows = pq.read_table(d / "index.parquet").to_pylist()
    fn(rows)
    write_index(str(d), index_table(rows))


_OFFSETS = ("offset", "size", "audio_offset", "audio_size", "json_offset", "json_size")


def _read(url, **kw):
    """{key: (pcm sha1, text)} of one epoch, and the loader's stats."""
    kw.setdefault("max_skipped_share", 1.0)  # these tests count their skips; the share stop is tested elsewhere
    cfg = StreamConfig(bucket=BucketConfig(max_batch_seconds=3.0, num_buckets=2), epochs=1, **kw)
    loader = build_loader(str(url), world=World(), seed=0, cfg=cfg)
    out = {}
    for batch, _ in loader:
        for i, k in enumerate(batch.keys):
            pcm = batch.waves[i, : int(batch.lengths[i])].numpy().tobytes()
            out[k] = (hashlib.sha1(pcm).hexdigest(), batch.texts[i])
    return out, loader.stats()


def _opened_under(path) -> list[str]:
    return [p for p in _OPENED if os.path.abspath(p).startswith(str(path))]


# ---- 1. metadata validated on open: one clear error naming field and value, nothing outside read -------------
@pytest.mark.parametrize("name", ["../outside/creds.txt", "/etc/passwd", "s3://other-bucket/shard-000000.tar",
                                  "shard-000000.tar/../../outside/creds.txt", "sub/shard-000000.tar"])
def test_shard_name_must_stay_inside_dataset(copy, name, capsys):
    _manifest(copy, lambda m: m["shards"][0].update(name=name))
    _OPENED.clear()
    with pytest.raises(DatasetError, match=r"shards\[0\]\.name = .*must match"):
        open_dataset(str(copy))
    with pytest.raises(DatasetError, match=r"shards\[0\]\.name"):
        build_loader(str(copy), world=World(), seed=0, cfg=StreamConfig())
    assert cli.main(["inspect", str(copy), "--verify", "--no-progress"]) == 2
    err = capsys.readouterr()
    assert "shards[0].name" in err.err and SECRET not in err.out + err.err
    assert not _opened_under(copy.parent / "outside")


@pytest.mark.parametrize("name", ["../outside/creds.txt", "/tmp/x.parquet", "index.parquet/../../x.parquet"])
def test_index_name_must_stay_inside_dataset(copy, name):
    _manifest(copy, lambda m: m.update(index=name))
    _OPENED.clear()
    with pytest.raises(DatasetError, match=r"index = .*must match"):
        open_dataset(str(copy))
    assert not _opened_under(copy.parent / "outside")


def test_sha256_that_would_escape_the_cache(copy, tmp_path):
    _manifest(copy, lambda m: m["shards"][0].update(sha256=str(tmp_path / "pwn")))
    with pytest.raises(DatasetError, match=r"shards\[0\]\.sha256 = .*64 lowercase hex"):
        open_dataset(str(copy))
    # and the cache itself never leaves its folder, whatever names it is handed
    root = tmp_path / "cache"
    cache = ShardCache(str(root), 1 << 30)
    before = set(tmp_path.rglob("*"))
    for name, sha in [("shard-000000.tar", str(tmp_path / "pwn")), ("../../escape.tar", "0" * 64),
                      ("/abs/escape.tar", "a" * 64), ("x\x00y.tar", "b" * 64)]:
        with cache.open(name, sha, 3, lambda: [b"abc"]) as f:
            local = f.name
            assert os.path.dirname(os.path.abspath(local)) == str(root) and f.read() == b"abc"
    created = {p for p in set(tmp_path.rglob("*")) - before if root not in p.parents and p != root}
    assert not created, f"written outside the cache: {created}"


@pytest.mark.parametrize("edit, match", [
    (lambda rows: [rows[i].update({k: rows[0][k] for k in _OFFSETS}) for i in (1, 2, 3)],
     r"rows 0 and 1 overlap in shard 0: bytes \[0, \d+\) and \[0, \d+\) \(3 such pairs\)"),
    (lambda rows: rows[2].update(offset=-1024), r"offset = -1024: offset must be >= 0"),
    (lambda rows: rows[3].update(shard=7), r"shard = 7: shard must be in \[0, 3\)"),
    (lambda rows: rows[0].update(num_samples=1 << 40), r"num_samples = 1099511627776"),
    (lambda rows: rows[0].update(size=3 << 30), r"size = 3221225472: member ends past the end of its shard"),
    (lambda rows: rows[0].update(audio_size=3 << 30), r"audio_size = 3221225472, duration_s = 0.3: audio_size is larger than any codec stores"),
    (lambda rows: rows[0].update(json_size=5 << 20), r"json_size must be <= 1048576"),
    (lambda rows: rows[0].update(duration_s=float("nan")), r"duration_s must be finite"),
    (lambda rows: rows[0].update(key="../evil"), r"key must match"),
    (lambda rows: rows[1].update(key=rows[0]["key"]), r"duplicate keys"),
    (lambda rows: rows.pop(), r"rows for shard 2, the manifest says 4"),
])
def test_hostile_index_rows_refused_on_open(copy, edit, match):
    _index(copy, edit)
    with pytest.raises(DatasetError, match=match):
        build_loader(str(copy), world=World(), seed=0, cfg=StreamConfig())
    problems = verify(open_dataset(str(copy)), progress=False)
    assert [p.kind for p in problems] == ["index_unreadable"] and "DatasetError" in problems[0].detail


_NO_BIG_ALLOC = """
import os, resource, sys
import psutil
from shardtrain.format.manifest import DatasetError
from shardtrain.load.config import StreamConfig
from shardtrain.load.loader import build_loader
from shardtrain.world import World
vm = psutil.Process().memory_info().vms
resource.setrlimit(resource.RLIMIT_AS, (vm + (5 << 29), vm + (5 << 29)))  # 2.5 GiB of headroom, not 3
for url in sys.argv[1:]:
    try:
        loader = build_loader(url, world=World(), seed=0, cfg=StreamConfig(epochs=1))
        print("read", sum(len(b) for b, _ in loader), "samples")  # the old reader: MemoryError here
    except DatasetError as e:
        print("refused:", str(e)[:160])
sys.stdout.flush()
os._exit(0)  # skip interpreter teardown: native thread pools may fail to start threads under the address limit
"""


def test_3gib_sizes_refused_without_allocating(copy, tmp_path):
    """An index `size`/`audio_size` of 3 GiB (with the manifest's shard bytes inflated to match) is refused before
    any allocation: checked in a process whose address space has only 2.5 GiB to spare (a MemoryError otherwise). Two malloc
    arenas: each thread's arena reserves 64 MB of address space, which made a 2 GiB margin flaky under load."""
    big = tmp_path / "big"
    shutil.copytree(copy, big)
    for d, field in ((copy, "size"), (big, "audio_size")):
        _manifest(d, lambda m: m["shards"][0].update(bytes=8 << 30))
        _index(d, lambda rows: rows[0].update({field: 3 << 30}))
    p = subprocess.run([sys.executable, "-c", _NO_BIG_ALLOC, str(copy), str(big)], capture_output=True, text=True,
                       timeout=120,
                       env={**os.environ, "PYTHONPATH": os.getcwd(), "ARROW_DEFAULT_MEMORY_POOL": "system",
                            "MALLOC_ARENA_MAX": "2"})
    lines = p.stdout.splitlines()
    assert p.returncode == 0 and len(lines) == 2, p.stdout + p.stderr[-2000:]
    assert "size exceeds its members by more than" in lines[0]
    assert "audio_size = 3221225472" in lines[1]


@pytest.mark.parametrize("raw, match", [
    (b"[" * 200_000 + b"]" * 200_000, "nested too deeply"),
    (b'{"format": "shardtrain", "format_version": 1, "x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
     "nested too deeply"),
    (b"[]", "a manifest is a JSON object"),
    (b"\xff\xfe{", "not valid JSON"),
    (b'{"format": "shardtrain", "format_version": 1}', r"shards = None must be a list"),
    (b'{"format": "shardtrain", "format_version": 1, "shards": [7], "totals": {}}', r"shards\[0\] = 7 must be an"),
    (b'{"format": "shardtrain", "format_version": 1, "shards": [{"name": "shard-000000.tar"}]}',
     r"shards\[0\]\.samples = None must be an integer"),
    (b'{"format": "shardtrain", "format_version": 1, "shards": [], "totals": {"samples": true, "seconds": 0, '
     b'"bytes": 0, "shards": 0}}', r"totals\.samples = True must be an integer"),
    (b'{"format": "shardtrain", "format_version": 1, "shards": [], "totals": {"samples": 5, "seconds": 0, '
     b'"bytes": 0, "shards": 0}}', r"totals say 0 shards / 5 samples"),
])
def test_malformed_manifest_is_one_clear_error(copy, raw, match, capsys):
    (copy / "manifest.json").write_bytes(raw)
    with pytest.raises(DatasetError, match=match):
        open_dataset(str(copy))
    assert cli.main(["inspect", str(copy), "--verify", "--no-progress"]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_inspect_prints_manifest_strings_escaped(copy, capsys):
    _manifest(copy, lambda m: m.update(created_utc="\x1b[2J\x1b]0;pwned\x07", tool_version="1" * 500))
    assert cli.main(["inspect", str(copy)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "1" * 100 not in out and "\\x1b[2J" in out
    _index(copy, lambda rows: rows[0].update(codec="\x1b[2Jflac"))  # inspect prints the codec mix
    assert cli.main(["inspect", str(copy)]) == 2
    err = capsys.readouterr().err
    assert "column codec holds" in err and "\x1b" not in err


def _rewrite_shard(d, shard: int, replace: dict[str, bytes]) -> None:
    """Rewrite one shard with some members' data replaced, as a producer would: a valid tar, and index rows,
    manifest bytes and sha256 updated to match, so only the reader's own checks can catch the content."""
    from shardtrain.format.tar import ShardWriter, iter_tar_members

    path = d / f"shard-{shard:06d}.tar"
    members = [(n, data) for n, _, data in iter_tar_members(open(path, "rb"))]
    offsets = {}
    with open(path, "wb") as f, ShardWriter(f) as w:
        for (audio_name, audio), (json_name, meta) in zip(members[::2], members[1::2]):
            key, ext = audio_name.rsplit(".", 1)
            offsets[key] = w.add(key, ext, audio, replace.get(json_name, meta))
    def fix_rows(rows):
        for r in rows:
            if r["key"] in offsets:
                r.update({k: getattr(offsets[r["key"]], k) for k in _OFFSETS})
    _index(d, fix_rows)
    _manifest(d, lambda m: m["shards"][shard].update(bytes=w.bytes, sha256=w.sha256))


def test_deep_json_member_is_a_counted_skip(copy):
    """A `<key>.json` member nested 200,000 deep: a counted skip in the loader and one problem in `inspect
    --verify`, never a RecursionError."""
    row = pq.read_table(copy / "index.parquet").to_pylist()[5]
    _rewrite_shard(copy, row["shard"], {f"{row['key']}.json": b"[" * 200_000 + b"]" * 200_000})
    problems = verify(open_dataset(str(copy)), progress=False)
    assert [(p.key, p.kind, p.detail) for p in problems] == [(row["key"], "bad_json", "nested too deeply")]
    batches, stats = _read(copy)
    assert stats["skipped"] == 1 and stats["skipped_keys"][0] == {
        "key": row["key"], "shard": f"shard-{row['shard']:06d}.tar", "reason": "bad_json: nested too deeply"}
    assert len(batches) == 11


# ---- 2. the reader verifies what it reads: counted skips, never a wrong sample -------------------------------
def _flip(path, pos: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x01]))


def _fix_checksum(path, header_at: int) -> None:
    """What a hostile producer does after renaming a member: recompute the ustar checksum."""
    with open(path, "r+b") as f:
        f.seek(header_at)
        block = bytearray(f.read(BLOCK))
        block[148:156] = b" " * 8
        block[148:156] = b"%06o\x00 " % sum(block)
        f.seek(header_at)
        f.write(block)


@pytest.mark.parametrize("damage, reason", [
    ("name", "bad_header: "),  # flipped byte in a member name: the ustar checksum catches it
    ("name_rechecksummed", "index_mismatch: members "),  # renamed with a valid checksum: name != index key
    ("json_name", "bad_header: "),
    ("transcript", "index_mismatch: the json transcript differs"),
    ("size_field", "bad_header: "),
])
def test_reader_verifies_headers_and_transcripts(clean, copy, damage, reason):
    ref, ref_stats = _read(clean)
    assert ref_stats["skipped"] == 0 and len(ref) == 12
    row = pq.read_table(copy / "index.parquet").to_pylist()[6]
    shard = copy / f"shard-{row['shard']:06d}.tar"
    audio_hdr, json_hdr = row["audio_offset"] - BLOCK, row["json_offset"] - BLOCK
    if damage == "name":
        _flip(shard, audio_hdr + 2)
    elif damage == "name_rechecksummed":
        _flip(shard, audio_hdr + 2)
        _fix_checksum(shard, audio_hdr)
    elif damage == "json_name":
        _flip(shard, json_hdr + 1)
    elif damage == "size_field":
        _flip(shard, audio_hdr + 124 + 8)  # an octal digit of the size field
    else:
        data = shard.read_bytes()
        at = data.index(b'"text":"', row["json_offset"]) + len(b'"text":"') + 1
        _flip(shard, at)
    got, stats = _read(copy)
    assert stats["skipped"] == 1
    (err,) = stats["skipped_keys"]
    assert err["key"] == row["key"] and err["reason"].startswith(reason), err
    assert got == {k: v for k, v in ref.items() if k != row["key"]}, "every other sample must be bit-identical"
    problems = verify(open_dataset(str(copy)), progress=False)
    assert problems and all(p.kind in ("sha256_mismatch", "members_mismatch", "bad_header", "bad_json", "tar_error")
                            for p in problems)
    assert any(p.kind == "sha256_mismatch" for p in problems)


def test_skipped_key_never_carries_shard_bytes(copy):
    """The old reader took the key from the tar header and logged it; a crafted header name then leaked file
    contents into logs and loader state. Keys now come from the (checked) index; shard text is escaped."""
    row = pq.read_table(copy / "index.parquet").to_pylist()[4]
    shard = copy / f"shard-{row['shard']:06d}.tar"
    with open(shard, "r+b") as f:
        f.seek(row["audio_offset"] - BLOCK)
        f.write(b"\x1b[31m" + SECRET.encode() + b"\n.flac")
    _fix_checksum(shard, row["audio_offset"] - BLOCK)
    _, stats = _read(copy)
    (err,) = stats["skipped_keys"]
    assert err["key"] == row["key"] and "\x1b" not in err["reason"] and "\n" not in err["reason"]
    assert len(err["reason"]) <= 300


# ---- 3. a plan with no batch is an error when the loader (and train) is built -------------------------------
def test_plan_without_batch_is_an_error_at_build_time(clean, tmp_path):
    with pytest.raises(StreamError, match=r"all 12 utterances are longer than stream.bucket.max_batch_seconds=0.1"):
        build_loader(str(clean), world=World(), seed=0,
                     cfg=StreamConfig(bucket=BucketConfig(max_batch_seconds=0.1)))
    empty = tmp_path / "empty"
    corpus = make_corpus(tmp_path / "c", [0.3, 0.4], seed=1)
    with pytest.raises(NothingAccepted):  # pack writes no dataset that accepted nothing
        pack(PackConfig(input=str(corpus), output=str(empty), min_duration_s=5.0, workers=1, progress=False))
    # one written elsewhere (a hand-made manifest + index of 0 rows) is still refused by the loader, naming it
    with pytest.raises((StreamError, DatasetError), match="zero"):
        build_loader(write_index_dataset(tmp_path / "zero", 0), world=World(), seed=0, cfg=StreamConfig())
    # 0.30 .. 0.58 s fit a 0.62 s budget: 5 usable samples, fewer than 6 ranks
    with pytest.raises(StreamError, match="5 usable samples for 6 ranks"):
        build_loader(str(clean), world=World(rank=0, world_size=6), seed=0,
                     cfg=StreamConfig(bucket=BucketConfig(max_batch_seconds=0.62)))


@pytest.mark.slow
def test_train_refuses_a_plan_without_batch(clean, tmp_path):
    """`shardtrain train` used to loop forever here; now it exits at once with the reason."""
    cmd = [sys.executable, "-m", "shardtrain", "train", "--data", str(clean), "--out", str(tmp_path / "run"),
           "--max-steps", "3", "--set", "stream.bucket.max_batch_seconds=0.1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert p.returncode != 0 and "no batch can be planned" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
