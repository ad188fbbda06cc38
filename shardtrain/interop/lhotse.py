"""lhotse: a shardtrain dataset as a lazy CutSet, without re-packing.

    dataset URL -> index.parquet (key, shard, codec, num_samples, rate, channels, text, speaker, language)
      -> open_cutset(url) -> CutSet over _IndexCuts (lazy: read in record batches on each iteration)
           -> MonoCut(id=key, duration, supervision(text, speaker, language),
                      recording: AudioSource(type="url", source="<dataset>/shard-NNNNNN.tar/<key>.<codec>"))
      -> DynamicBucketingSampler / K2SpeechRecognitionDataset(AudioSamples()) as with any lazy CutSet
      -> cut.load_audio(): lhotse opens the source through its IO backend:
           ShardMemberIOBackend (installed by open_cutset): one ranged read of the member's bytes, located through
             the index's audio_offset/audio_size (local paths and s3:// alike);
           without it (another process that never called open_cutset, e.g. a spawn-started worker): lhotse's own
             TarAsDirBackend opens the same local path by scanning the tar headers (slower, local files only).

Measured (benchmarks/interop/bench_interop.py, 400 x 1-3 s FLAC samples in one local shard, 2 busy cores): 1.4 ms per
`cut.load_audio()` through ShardMemberIOBackend, 39 ms through TarAsDirBackend (~28x; it grows with samples per shard).

Everything is public lhotse API (Recording, AudioSource, SupervisionSegment, MonoCut, CutSet, IOBackend,
set_current_io_backend). Costs: iterating the CutSet reads the index's metadata columns (never audio); the IO
backend keeps, per opened dataset, a key -> row map and three numpy columns (~100 B per sample) in each process
that reads audio.

Use it from lhotse:

    from shardtrain.interop.lhotse import open_cutset
    cuts = open_cutset("shards/train")                          # lazy CutSet, nothing decoded
    sampler = DynamicBucketingSampler(cuts, max_duration=200, num_buckets=30, shuffle=True)
    dataset = K2SpeechRecognitionDataset(input_strategy=AudioSamples(), return_cuts=True)
    loader = DataLoader(dataset, sampler=sampler, batch_size=None, num_workers=2)  # fork-started workers
"""
from __future__ import annotations

import io
import logging
import threading
from typing import Any, Iterator

from lhotse import CutSet, MonoCut, Recording, SupervisionSegment
from lhotse.audio import AudioSource
from lhotse.serialization import (CompositeIOBackend, IOBackend, get_current_io_backend,
                                  set_current_io_backend)

from shardtrain import storage
from shardtrain.format.manifest import Dataset, open_dataset

log = logging.getLogger(__name__)

CUT_COLUMNS = ("key", "shard", "codec", "num_samples", "sample_rate_hz", "channels", "text", "speaker", "language")
_MEMBER_COLUMNS = ("key", "shard", "audio_offset", "audio_size")


class _Members:
    """Where each audio member of one dataset lies: key -> (shard url, offset, size)."""

    def __init__(self, ds: Dataset) -> None:
        t = ds.read_index(columns=list(_MEMBER_COLUMNS))
        self.ds = ds
        self.row = {k: i for i, k in enumerate(t.column("key").to_pylist())}
        self.shard = t.column("shard").to_numpy()
        self.offset = t.column("audio_offset").to_numpy()
        self.size = t.column("audio_size").to_numpy()
        self.local = storage.is_local(ds.url)
        self.checked: set[int] = set()
        """Remote shards whose first read found the dataset still the one opened (the loader's check, reader.py)."""

    def locate(self, key: str) -> tuple[str, int, int]:
        """Where `key`'s audio lies, after a check that the dataset was not re-packed in place since it was
        opened (its offsets would then point into other samples' bytes): before every read of a local dataset
        (one stat of manifest.json), before a shard's first read of a remote one (one small request)."""
        i = self.row[key]
        shard = int(self.shard[i])
        if self.local or shard not in self.checked:
            if not self.ds.still_same():
                raise RuntimeError(f"{self.ds.url} changed since open_cutset opened it (re-packed in place?): "
                                   "call open_cutset again")
            if not self.local:
                self.checked.add(shard)
        return self.ds.shard_url(shard), int(self.offset[i]), int(self.size[i])


_DATASETS: dict[str, Dataset] = {}
"""Datasets opened by open_cutset in this process (by URL), so the IO backend knows their members."""
_MEMBERS: dict[str, _Members] = {}
_LOCK = threading.Lock()


def _split(identifier: Any) -> tuple[str, str, str] | None:
    """`<dataset>/shard-NNNNNN.tar/<key>.<ext>` of an opened dataset -> (dataset url, shard name, key)."""
    s = str(identifier)
    head, sep, member = s.rpartition(".tar/")
    if not sep or "/" in member:
        return None
    ds_url, _, shard = (head + ".tar").rpartition("/")
    if ds_url not in _DATASETS or not shard.startswith("shard-"):
        return None
    return ds_url, shard, member.rpartition(".")[0]


class ShardMemberIOBackend(IOBackend):
    """Opens `<dataset>/shard-NNNNNN.tar/<key>.<ext>` of a dataset opened by `open_cutset` with one ranged read."""

    def open(self, identifier: Any, mode: str) -> io.BytesIO:
        parts = _split(identifier)
        if parts is None or "r" not in mode:
            raise ValueError(f"{identifier}: not an audio member of a dataset opened with open_cutset (read-only)")
        ds_url, shard, key = parts
        with _LOCK:
            members = _MEMBERS.get(ds_url) or _MEMBERS.setdefault(ds_url, _Members(_DATASETS[ds_url]))
        try:
            shard_url, offset, size = members.locate(key)
        except KeyError:
            raise FileNotFoundError(f"{identifier}: no sample {key!r} in {ds_url}/index.parquet") from None
        if not shard_url.endswith("/" + shard):
            raise FileNotFoundError(f"{identifier}: sample {key!r} lies in {shard_url}, not in {shard}")
        return io.BytesIO(storage.read_range(shard_url, offset, offset + size, members.ds.storage_options))

    def handles_special_case(self, identifier: Any) -> bool:
        return _split(identifier) is not None

    def is_applicable(self, identifier: Any) -> bool:
        return _split(identifier) is not None


def install_io_backend() -> None:
    """Put ShardMemberIOBackend in front of lhotse's current IO backend (once per process; forked DataLoader
    workers inherit it)."""
    current = get_current_io_backend()
    subs = current.backends if isinstance(current, CompositeIOBackend) else [current]
    if not any(isinstance(b, ShardMemberIOBackend) for b in subs):
        set_current_io_backend(CompositeIOBackend([ShardMemberIOBackend(), current]))


class _IndexCuts:
    """Re-iterable source of cuts read from index.parquet in record batches (what makes the CutSet lazy)."""

    def __init__(self, ds: Dataset, batch_rows: int = 8192) -> None:
        self.ds, self.batch_rows = ds, batch_rows

    def __iter__(self) -> Iterator[MonoCut]:
        import pyarrow.parquet as pq  # noqa: PLC0415

        with self.ds.open_index() as f:
            for rb in pq.ParquetFile(f).iter_batches(batch_size=self.batch_rows, columns=list(CUT_COLUMNS)):
                for row in rb.to_pylist():
                    yield _cut(self.ds, row)

    def __len__(self) -> int:
        return int(self.ds.totals["samples"])


def _cut(ds: Dataset, row: dict) -> MonoCut:
    key, rate, n = row["key"], int(row["sample_rate_hz"]), int(row["num_samples"])
    source = f"{ds.shard_url(int(row['shard']))}/{key}.{row['codec']}"
    channels = list(range(int(row["channels"] or 1)))
    rec = Recording(id=key, sources=[AudioSource(type="url", channels=channels, source=source)],
                    sampling_rate=rate, num_samples=n, duration=n / rate)
    sup = SupervisionSegment(id=key, recording_id=key, start=0.0, duration=rec.duration, channel=0,
                             text=row["text"], speaker=row["speaker"], language=row["language"])
    return MonoCut(id=key, start=0.0, duration=rec.duration, channel=0, supervisions=[sup], recording=rec)


def open_cutset(url: str, storage_options: dict | None = None, *, install_backend: bool = True) -> CutSet:
    """A lazy CutSet over the dataset at `url` (one MonoCut per sample, in index order: shard, then position).

    Multi-channel samples keep all channels in the recording; the cut reads channel 0 (lhotse's MonoCut rule).
    `install_backend=False` leaves lhotse's IO backend alone (then audio is read through TarAsDirBackend,
    local datasets only).
    """
    ds = open_dataset(url, storage_options)
    with _LOCK:
        members = _MEMBERS.get(ds.url)
        if members is not None and members.ds.content_id != ds.content_id:
            log.info("open_cutset: %s was re-packed since it was last opened: re-reading its index", ds.url)
            del _MEMBERS[ds.url]  # the old offsets would read other samples' bytes
        _DATASETS[ds.url] = ds
    if install_backend:
        install_io_backend()
    return CutSet(_IndexCuts(ds))
