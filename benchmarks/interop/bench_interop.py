"""Audio reads of a shardtrain dataset opened as a lhotse CutSet: shardtrain's IO backend vs lhotse's own reader.

`shardtrain.interop.lhotse.open_cutset` points each cut at `<dataset>/shard-NNNNNN.tar/<key>.flac`. With the
ShardMemberIOBackend (installed by open_cutset) that is one ranged read located by index.parquet; without it
(a process that never called open_cutset) lhotse's TarAsDirBackend opens the tar and scans its headers up to the
member, so its cost grows with the samples per shard. Both decode the same bytes with the same lhotse decoder.

    .venv/bin/python -m benchmarks.interop.bench_interop                      # 400 tone samples in one shard
    .venv/bin/python -m benchmarks.interop.bench_interop --samples 1000 --repeats 3
"""
from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import git_sha, json_line, markdown_table


def main(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-interop-"))
    try:
        return _run(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(work: Path, args: argparse.Namespace) -> dict:
    from lhotse.serialization import get_default_io_backend, io_backend

    from shardtrain.interop.lhotse import open_cutset
    from shardtrain.pack.packer import PackConfig, pack
    from shardtrain.testing.corpus import make_corpus

    corpus = make_corpus(work / "corpus", [1.0 + (i % 10) * 0.2 for i in range(args.samples)], seed=0)
    pack(PackConfig(input=str(corpus), output=str(work / "ds"), progress=False))  # one shard: < 256 MB
    cuts = list(open_cutset(str(work / "ds")))

    def per_cut_ms(ctx) -> float:
        t = time.perf_counter()
        with ctx:
            for cut in cuts:
                cut.load_audio()
        return (time.perf_counter() - t) / len(cuts) * 1e3

    ours, tar = [], []
    for _ in range(args.repeats):
        ours.append(per_cut_ms(contextlib.nullcontext()))
        tar.append(per_cut_ms(io_backend(get_default_io_backend())))
    out = {"git_sha": git_sha(), "samples_in_shard": len(cuts), "repeats": args.repeats,
           "shardtrain_backend_ms_per_cut": round(statistics.median(ours), 2),
           "lhotse_tar_as_dir_ms_per_cut": round(statistics.median(tar), 2)}
    out["ratio"] = round(out["lhotse_tar_as_dir_ms_per_cut"] / out["shardtrain_backend_ms_per_cut"], 1)
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=400, help="samples in the (single) shard")
    p.add_argument("--repeats", type=int, default=3, help="alternating timed passes per reader (median)")
    res = main(p.parse_args())
    print(json_line(res))
    print(markdown_table([{"reader": "ShardMemberIOBackend (ranged read)", "ms": res["shardtrain_backend_ms_per_cut"]},
                          {"reader": "lhotse TarAsDirBackend (header scan)", "ms": res["lhotse_tar_as_dir_ms_per_cut"]}],
                         [("reader", "reader"), ("ms", "ms per cut (median)")]))
