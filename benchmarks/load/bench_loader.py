"""Loader throughput: shardtrain vs a plain webdataset pipeline vs the decode-only limit, same shards.

    corpus (espeak-ng speech, or --corpus tone) -> `shardtrain pack` (16 MB shards; cached in --work-dir)
    decode-only limit: every shard read + every FLAC member decoded to int16, one process per core, with
                       soundfile over BytesIO and with shardtrain's decode_into; the faster one is the 100%
    for storage in (local disk, SeaweedFS on loopback):
        shardtrain: shardtrain.load.bench.bench_loader (planned duration buckets under --max-batch-seconds;
                    decode threads in its own process, no worker processes)
        webdataset: WebDataset(urls, shardshuffle) -> shuffle(1000) -> soundfile decode -> fixed batch size
                    (the batch size that holds the same mean audio as a shardtrain batch) -> DataLoader(workers),
                    for workers in (0, 1, 2)
    -> audio-s/s, samples/s, padding efficiency, first-batch latency, peak RSS (process tree), and the ratios
       shardtrain / webdataset and shardtrain / decode-limit; one JSON line per run, a JSON file and a table

Every measured run is a fresh interpreter (common.run_isolated); the clock starts after imports, before the
loader is built, and stops after the last batch of one epoch. webdataset has no s3:// handler: it gets
presigned http URLs of the same objects and reads them with its own curl handler (its cheapest S3 path).
All reads hit the page cache after the first run (the same for every tool). Run:

    .venv/bin/python -m benchmarks.load.bench_loader                 # 4,000 speech utterances, 0/1/2 workers
    .venv/bin/python -m benchmarks.load.bench_loader --quick         # 400 utterances, smoke test (~1-2 min)
"""
from __future__ import annotations

import argparse
import io
import json
import logging
import os
import tempfile
import time
from pathlib import Path

from benchmarks import common

log = logging.getLogger("bench")


# ---------------------------------------------------------------------------------------------- runners
def run_shardtrain(url: str, workers: int, max_batch_seconds: float, seed: int = 0,
                   decode_threads: int | None = None, storage_options: dict | None = None, epochs: int = 1) -> dict:
    """`epochs` of the real loader on one rank (shardtrain.load.bench: the clock includes reading the index).
    `workers` must be 0 (the loader has no worker processes; StreamConfig refuses others)."""
    from shardtrain.load.bench import BenchConfig, bench_loader
    from shardtrain.load.plan import BucketConfig
    from shardtrain.load.config import StreamConfig
    from shardtrain.world import World

    kw = {} if decode_threads is None else {"decode_threads": decode_threads}
    stream = StreamConfig(bucket=BucketConfig(max_batch_seconds=max_batch_seconds), num_workers=workers, **kw)
    return bench_loader(url, world=World(), seed=seed, stream=stream, bench=BenchConfig(epochs=epochs),
                        storage_options=storage_options)


def _wds_decode(sample: dict, sample_rate_hz: int):
    """(float32 wave, text); a member at another rate than the dataset's raises: its length would count as the
    wrong number of audio seconds."""
    import soundfile as sf

    from shardtrain.format.codecs import CODECS

    audio = next((sample[c] for c in CODECS if c in sample), None)
    if audio is None:
        raise ValueError(f"{sample['__key__']}: no audio member ({', '.join(CODECS)}) in {sorted(sample)}")
    wave, rate = sf.read(io.BytesIO(audio), dtype="float32")
    if rate != sample_rate_hz:
        raise ValueError(f"{sample['__key__']}: {rate} Hz in a dataset of {sample_rate_hz} Hz")
    text = json.loads(sample["json"]).get("text", "")  # shardtrain parses the json too
    return wave, text


def _pad(items: list):
    """float32 [B, T] zero-padded + lengths + texts, padded in numpy like shardtrain does.

    Not torch slice assignment: in the main process (num_workers=0) torch's intra-op threads made that 10x
    slower on 2 busy cores (3.1 s for 5 batches), which would charge webdataset for our collate, not its own.
    """
    import numpy as np
    import torch

    lengths = np.array([len(w) for w, _ in items], dtype=np.int64)
    out = np.zeros((len(items), int(lengths.max())), dtype=np.float32)
    for i, (w, _) in enumerate(items):
        out[i, :len(w)] = w
    return torch.from_numpy(out), torch.from_numpy(lengths), [t for _, t in items]


def run_webdataset(urls: list[str], workers: int, batch_size: int, seed: int = 0, shuffle_buffer: int = 1000,
                   epochs: int = 1, *, sample_rate_hz: int) -> dict:
    """The plain pipeline a webdataset user writes: shard shuffle, sample shuffle, decode, fixed batches; one
    pass over the DataLoader per epoch, as a training loop does. Audio seconds = delivered lengths /
    `sample_rate_hz` (the dataset's rate, common.dataset_rate)."""
    import functools
    import itertools

    import torch
    import webdataset as wds

    from shardtrain.load.bench import RssSampler

    with RssSampler() as rss:
        t0 = time.perf_counter()
        ds = (wds.WebDataset(urls, shardshuffle=len(urls), seed=seed, empty_check=False)
              .shuffle(shuffle_buffer).map(functools.partial(_wds_decode, sample_rate_hz=sample_rate_hz))
              .batched(batch_size, collation_fn=_pad, partial=True))
        dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers,
                                         prefetch_factor=2 if workers else None)
        batches = itertools.chain.from_iterable(dl for _ in range(epochs))
        out = common.time_batches(batches, sample_rate_hz=sample_rate_hz, t_start=t0, rss=rss)
    return {**out, "workers": workers, "batch_size": batch_size}


def _flac_frames(blob: bytes) -> int:
    """Total samples from a FLAC STREAMINFO block (bytes 18-25 hold rate, channels, depth and the 36-bit count)."""
    return int.from_bytes(blob[18:26], "big") & ((1 << 36) - 1)


def _flac_rate(blob: bytes) -> int:
    """Sample rate from a FLAC STREAMINFO block (the 20 bits at byte 18)."""
    return int.from_bytes(blob[18:21], "big") >> 4


def _limit_worker_init() -> None:
    """Imports done in each pool worker before the clock starts (not charged to the ceiling)."""
    import numpy  # noqa: F401
    import soundfile  # noqa: F401

    import shardtrain.format.audio  # noqa: F401


def _decode_shard(path: str, decoder: str = "soundfile") -> tuple[float, int, float]:
    """(audio seconds, utterances, CPU seconds) of one shard: read the whole tar, decode every FLAC member to int16.
    Seconds are each member's decoded frames over its own rate (STREAMINFO), not a fixed 16 kHz. A shard whose
    samples are not all FLAC raises: skipping their audio would make the ceiling measure part of the work.

    decoder "soundfile": `sf.read(BytesIO)`, what a user writes; "libsndfile": libsndfile on a memfd without
    Python IO callbacks (shardtrain's decoder before dr_flac: the fastest libsndfile path); "decode_into":
    shardtrain's own path (dr_flac for FLAC), so the ceiling cannot be flattered by a slower decoder than the
    loader's.
    """
    import tarfile

    import numpy as np
    import soundfile as sf

    from shardtrain.format import audio

    cpu0 = time.process_time()
    with open(path, "rb") as f:
        data = f.read()
    seconds, n, metas = 0.0, 0, 0
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
        for m in tf:
            metas += m.name.endswith(".json")
            if m.name.endswith(".flac"):
                blob = tf.extractfile(m).read()
                if decoder == "soundfile":
                    frames = len(sf.read(io.BytesIO(blob), dtype="int16")[0])
                elif decoder == "libsndfile":
                    frames = audio._decoder().decode_into(blob, np.zeros(_flac_frames(blob), np.int16))
                else:
                    frames = audio.decode_into(blob, np.zeros(_flac_frames(blob), np.int16))
                seconds += frames / _flac_rate(blob)
                n += 1
    if n != metas:
        raise ValueError(f"{path}: {metas - n} of {metas} samples are not FLAC; the decode limit reads FLAC only")
    return seconds, n, time.process_time() - cpu0


def run_decode_limit(paths: list[str], processes: int, epochs: int = 1, decoder: str = "soundfile") -> dict:
    """The machine's ceiling: tar read + decode in a tight loop, one process per core, nothing else."""
    import functools
    import multiprocessing

    paths = sorted(paths, key=os.path.getsize, reverse=True) * epochs  # largest first: the pool's tail stays short
    with multiprocessing.get_context("fork").Pool(processes, initializer=_limit_worker_init) as pool:
        pool.map(abs, range(processes))  # workers started and imports done before the clock
        from shardtrain.load.bench import RssSampler

        with RssSampler() as rss:
            t0 = time.perf_counter()
            res = list(pool.imap_unordered(functools.partial(_decode_shard, decoder=decoder), paths, chunksize=1))
            wall = time.perf_counter() - t0
    audio_s, n, cpu = sum(r[0] for r in res), sum(r[1] for r in res), sum(r[2] for r in res)
    # CPU seconds of the decode work itself: on a machine shared with other jobs, audio seconds per CPU second
    # compares costs where wall-clock rates only compare luck with the scheduler
    return {"samples": n, "audio_seconds": round(audio_s, 3), "wall_seconds": round(wall, 3),
            "cpu_seconds": round(cpu, 3), "audio_s_per_cpu_s": round(audio_s / max(cpu, 1e-9), 1),
            "audio_s_per_s": round(audio_s / wall, 1), "samples_per_s": round(n / wall, 2),
            "padding_efficiency": None, "first_batch_s": None, "peak_rss_mb": round(rss.peak_bytes / 2**20, 1),
            "processes": processes}


RUNNERS = {"shardtrain": ("bench_loader", "run_shardtrain"), "webdataset": ("bench_loader", "run_webdataset"),
           "lhotse": ("compare", "run_lhotse")}


# ---------------------------------------------------------------------------------------------- orchestration
class Targets:
    """Where each tool reads the same data from, per storage ("local" or "s3"); owns the S3 server."""

    def __init__(self, ds: Path, storages: list[str], work_dir: Path, shar: Path | None = None):
        self.ds, self.shar, self.s3, self.env = ds, shar, None, {}
        self.warm: list[Path] = [ds] + ([shar] if shar is not None else [])
        """What every run reads (the S3 server's data folder too, when there is one): read before each run."""
        self.kw: dict[tuple[str, str], dict] = {}
        shards = common.shard_paths(ds)
        self.kw[("shardtrain", "local")] = {"url": str(ds)}
        rate = common.dataset_rate(ds)  # the peers count audio seconds from decoded lengths at this rate
        self.kw[("webdataset", "local")] = {"urls": shards, "sample_rate_hz": rate}
        if shar is not None:
            self.kw[("lhotse", "local")] = {**_shar_fields(shar, lambda p: str(p)), "sample_rate_hz": rate}
        if "s3" in storages:
            from shardtrain.testing.s3server import LocalS3

            self._tmp = tempfile.TemporaryDirectory(prefix="s3-", dir=work_dir)
            self.s3 = LocalS3(Path(self._tmp.name) / "data").start()
            self.warm.append(Path(self._tmp.name) / "data")
            t0 = time.perf_counter()
            url = common.upload_dir(self.s3, ds, "bench", "ds")
            self.kw[("shardtrain", "s3")] = {"url": url, "storage_options": self.s3.storage_options}
            keys = [f"ds/{Path(p).name}" for p in shards]
            self.kw[("webdataset", "s3")] = {"urls": common.presigned_urls(self.s3, "bench", keys),
                                             "sample_rate_hz": rate}
            if shar is not None:
                common.upload_dir(self.s3, shar, "bench", "shar")

                def curl(p: Path) -> str:
                    (u,) = common.presigned_urls(self.s3, "bench", [f"shar/{p.name}"])
                    gunzip = " | gunzip -c" if p.name.endswith(".gz") else ""  # lhotse does not unzip pipes
                    # the trailing shell comment gives lhotse the file name it picks the reader by
                    return f"pipe:curl -s -f -L '{u}'{gunzip} #/{p.name}"

                self.kw[("lhotse", "s3")] = {**_shar_fields(shar, curl), "sample_rate_hz": rate}
            self.env = self.s3.env
            log.info("uploaded to SeaweedFS %s in %.1f s", self.s3.endpoint_url, time.perf_counter() - t0)

    def close(self) -> None:
        if self.s3 is not None:
            self.s3.stop()
            self._tmp.cleanup()


def _shar_fields(shar: Path, to_url) -> dict:
    cuts = sorted(shar.glob("cuts.*.jsonl.gz"))
    recs = sorted(shar.glob("recording.*.tar"))
    return {"cuts_paths": [to_url(p) for p in cuts], "recording_paths": [to_url(p) for p in recs]}


def run_matrix(targets: Targets, tools: list[str], storages: list[str], workers_list: list[int], repeats: int,
               common_kw: dict[str, dict], jsonl, tool_workers: dict[str, list[int]] | None = None,
               ) -> tuple[dict[tuple[str, str, int], list[dict]], dict]:
    """Every (tool, storage, workers) `repeats` times, plus the decode limit once per repeat.

    `tool_workers` overrides `workers_list` per tool (compare.py adds shardtrain's own default, 0 workers).

    Repeats are the outer loop and the limit is measured inside it, so slow phases of a shared machine spread
    over every tool and over the ceiling alike instead of landing on one of them. Every run starts with all
    inputs read once (common.warm_page_cache: this VM reclaims idle page cache within seconds, which hit most the
    tool that reads files the run before it did not, lhotse's Shar).
    """
    runs: dict[tuple[str, str, int], list[dict]] = {}
    limit_runs: dict[tuple[int, str], list[dict]] = {}
    cores = os.cpu_count() or 1
    for rep in range(repeats):
        for procs, decoder in ((cores, "soundfile"), (cores, "libsndfile"), (cores, "decode_into"),
                               (1, "soundfile")):
            common.warm_page_cache(*targets.warm)
            r = common.run_isolated("bench_loader", "run_decode_limit",
                                    {"paths": common.shard_paths(targets.ds), "processes": procs, "decoder": decoder,
                                     "epochs": common_kw.get("decode-limit", {}).get("epochs", 1)})
            r.update(tool=f"decode-limit-{decoder}" if procs > 1 else "decode-1proc", storage="local", rep=rep)
            limit_runs.setdefault((procs, decoder), []).append(r)
            _log_run(r, jsonl)
        for storage in storages:
            for workers in sorted({w for t in tools for w in (tool_workers or {}).get(t, workers_list)}):
                for tool in tools:
                    if workers not in (tool_workers or {}).get(tool, workers_list):
                        continue
                    script, func = RUNNERS[tool]
                    kw = {**targets.kw[(tool, storage)], **common_kw.get(tool, {}), "workers": workers}
                    common.warm_page_cache(*targets.warm)
                    r = common.run_isolated(script, func, kw, env=targets.env)
                    r.update(tool=tool, storage=storage, workers=workers, rep=rep)
                    runs.setdefault((tool, storage, workers), []).append(r)
                    _log_run(r, jsonl)
    # the ceiling is the fastest decoder (medians), so no choice of decoder flatters the ratios; the libsndfile
    # ceiling (the faster of its two paths) is issue 20's definition, kept beside it
    by_decoder = {d: common.aggregate(limit_runs[(cores, d)]) for d in ("soundfile", "libsndfile", "decode_into")}

    def fastest(decoders: tuple[str, ...]) -> str:
        return max(decoders, key=lambda d: by_decoder[d]["audio_s_per_s"]["median"] or 0)

    best, best_sf = fastest(tuple(by_decoder)), fastest(("soundfile", "libsndfile"))
    many = limit_runs[(cores, best)]
    limit = {"runs": many, **common.aggregate(many), "decoder": best, "by_decoder": by_decoder,
             "libsndfile": {"decoder": best_sf, **by_decoder[best_sf]},
             "one_process": common.aggregate(limit_runs[(1, "soundfile")])}
    limit["effective_cores"] = common.ratio(limit["audio_s_per_s"]["median"],
                                            limit["one_process"]["audio_s_per_s"]["median"])
    return runs, limit


def _log_run(r: dict, jsonl) -> None:
    jsonl.write(common.json_line(r) + "\n")
    jsonl.flush()
    log.info("%-12s %-5s w=%s rep %d: %8.1f audio-s/s  pad %.2f  first %.2f s  rss %.0f MB", r["tool"],
             r["storage"], r.get("workers", r.get("processes")), r["rep"], r["audio_s_per_s"],
             r.get("padding_efficiency") or 0, r.get("first_batch_s") or 0, r["peak_rss_mb"])


def rows_for_table(runs: dict, limit: dict, ref_workers: int | None = None) -> tuple[list[dict], list[dict]]:
    """(formatted table rows, JSON summary rows) with ratios against shardtrain of the same storage and of the
    same workers, or of `ref_workers` when given (compare.py: shardtrain's default, threads in one process).
    Without a shardtrain run to compare with (`--tools webdataset lhotse`) the ratios are None, not 1."""
    table, summary = [], []
    lim = limit["audio_s_per_s"]["median"]
    for (tool, storage, workers), rs in runs.items():
        agg = common.aggregate(rs)
        ref_runs = runs.get(("shardtrain", storage, workers if ref_workers is None else ref_workers))
        st = common.aggregate(ref_runs)["audio_s_per_s"]["median"] if ref_runs else None
        me = agg["audio_s_per_s"]["median"]
        row = {"tool": tool, "storage": storage, "workers": workers, "runs": len(rs), **agg,
               "vs_shardtrain": common.ratio(me, st), "shardtrain_over_tool": common.ratio(st, me),
               "of_decode_limit": common.ratio(me, lim),
               "of_libsndfile_limit": common.ratio(me, limit["libsndfile"]["audio_s_per_s"]["median"])}
        summary.append(row)
        table.append({"tool": tool, "storage": storage, "workers": workers, "runs": len(rs),
                      "audio": common.fmt_stat(agg["audio_s_per_s"]), "steady": common.fmt_stat(agg["steady_audio_s_per_s"]),
                      "samples": common.fmt_stat(agg["samples_per_s"]),
                      "pad": common.fmt_stat(agg["padding_efficiency"], 2),
                      "batch_s": common.fmt_stat(agg["batch_audio_s"]),
                      "first": common.fmt_stat(agg["first_batch_s"], 2), "rss": common.fmt_stat(agg["peak_rss_mb"]),
                      "st_over": f"{row['shardtrain_over_tool']:.2f}" if row["shardtrain_over_tool"] else "-",
                      "limit": f"{row['of_decode_limit']:.0%}" if row["of_decode_limit"] else "-"})
    for decoder, agg in limit["by_decoder"].items():
        table.append({"tool": f"decode-limit ({decoder})", "storage": "local", "workers": f"{os.cpu_count()} procs",
                      "runs": agg["audio_s_per_s"]["n"], "audio": common.fmt_stat(agg["audio_s_per_s"]), "steady": "-",
                      "samples": common.fmt_stat(agg["samples_per_s"]), "pad": "-", "batch_s": "-", "first": "-",
                      "rss": common.fmt_stat(agg["peak_rss_mb"]), "st_over": "-",
                      "limit": f"{common.ratio(agg['audio_s_per_s']['median'], lim):.0%}" if lim else "-"})
    one = limit["one_process"]
    table.append({"tool": "decode, 1 process", "storage": "local", "workers": "1 proc", "runs": one["audio_s_per_s"]["n"],
                  "audio": common.fmt_stat(one["audio_s_per_s"]), "steady": "-",
                  "samples": common.fmt_stat(one["samples_per_s"]),
                  "pad": "-", "batch_s": "-", "first": "-", "rss": common.fmt_stat(one["peak_rss_mb"]), "st_over": "-",
                  "limit": f"{common.ratio(one['audio_s_per_s']['median'], lim):.0%}" if lim else "-"})
    return table, summary


COLUMNS = [("tool", "loader"), ("storage", "storage"), ("workers", "workers"), ("runs", "runs"),
           ("audio", "audio-s/s"), ("steady", "audio-s/s after 1st batch"), ("samples", "samples/s"), ("pad", "padding eff."),
           ("batch_s", "audio s / batch"), ("first", "first batch s"),
           ("rss", "peak RSS MB"), ("st_over", "shardtrain / this"), ("limit", "of decode limit")]


def wds_batch_size(ds: Path, max_batch_seconds: float) -> int:
    """Fixed batch size holding, on average, the audio of one shardtrain batch (same work per step)."""
    return max(1, round(max_batch_seconds / common.dataset_summary(ds)["mean_duration_s"]))


def main(args: argparse.Namespace) -> dict:
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    corpus = common.prepare_corpus(work, args.utterances, kind=args.corpus, seed=args.seed)
    ds = common.prepare_dataset(work, corpus, shard_mb=args.shard_mb)
    info = common.dataset_summary(ds)
    bs = wds_batch_size(ds, args.max_batch_seconds)
    log.info("dataset %s: %s; webdataset batch size %d", ds, info, bs)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    with open(out_dir / "bench_loader.jsonl", "w") as jsonl:
        targets = Targets(ds, args.storage, work)
        try:
            runs, limit = run_matrix(targets, ["shardtrain", "webdataset"], args.storage, args.workers, args.repeats,
                              {"shardtrain": {"max_batch_seconds": args.max_batch_seconds, "seed": args.seed,
                                              "epochs": args.epochs},
                               "webdataset": {"batch_size": bs, "seed": args.seed, "epochs": args.epochs},
                               "decode-limit": {"epochs": args.epochs}}, jsonl, tool_workers={"shardtrain": [0]})
        finally:
            targets.close()
    table, summary = rows_for_table(runs, limit, ref_workers=0)
    md = common.markdown_table(table, COLUMNS)
    result = {"benchmark": "bench_loader", "git_sha": common.git_sha(), "machine": common.machine(),
              "config": {**vars(args), "webdataset_batch_size": bs}, "dataset": info,
              "decode_limit": {k: v for k, v in limit.items() if k != "runs"}, "rows": summary,
              "effective_cores": limit["effective_cores"], "total_wall_s": round(time.perf_counter() - t_all, 1)}
    common.write_json(out_dir / "bench_loader.json", result)
    (out_dir / "bench_loader.md").write_text(md + "\n")
    print(md)
    print(common.json_line({"git_sha": result["git_sha"], "config": result["config"],
                            "rows": [{k: r[k] for k in ("tool", "storage", "workers", "vs_shardtrain",
                                                        "of_decode_limit")} | {"audio_s_per_s": r["audio_s_per_s"]
                                                                               ["median"]} for r in summary]}))
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--utterances", type=int, default=4000, help="corpus size (>= 4,000 for the issue's figures)")
    ap.add_argument("--corpus", choices=["speech", "tone"], default="speech", help="espeak-ng speech or tones")
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2], help="DataLoader worker counts of webdataset (shardtrain: threads, 0 workers)")
    ap.add_argument("--storage", nargs="+", choices=["local", "s3"], default=["local", "s3"])
    ap.add_argument("--repeats", type=int, default=1, help="runs per configuration (median and min-max reported)")
    ap.add_argument("--epochs", type=int, default=1,
                    help="passes over the data per run, for every tool and the decode limit (start-up weighs less)")
    ap.add_argument("--max-batch-seconds", type=float, default=300.0, help="shardtrain budget; sets wds batch size")
    ap.add_argument("--shard-mb", type=float, default=16.0, help="pack target shard size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", default=str(common.DEFAULT_WORK_DIR), help="cache of corpus and packed data")
    ap.add_argument("--out-dir", default=None, help="JSON / Markdown output folder")
    ap.add_argument("--quick", action="store_true", help="smoke run: 400 utterances, 4 MB shards, workers 0 and 2")
    args = ap.parse_args(argv)
    if args.out_dir is None:  # a smoke run never overwrites the published results
        args.out_dir = str(common.BENCH_DIR / "results" / ("quick" if args.quick else ""))
    if args.quick:
        args.utterances, args.workers, args.shard_mb = min(args.utterances, 400), [0, 2], 4.0
    return args


if __name__ == "__main__":
    common.setup_logging()
    main(parse_args())
