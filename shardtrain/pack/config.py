"""The options of a pack: `PackConfig` (what `shardtrain pack` takes, one field per flag), validated when built.

A frozen dataclass with no I/O and light imports (format.codecs only), so every pack module can name it (the
scan, plan and shard tasks read it) without importing the packer. `dataset_options` is what the manifest records
and the dataset fingerprint hashes: a field added there changes every fingerprint.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from shardtrain.format.codecs import CODECS

DEFAULT_MAX_CHARS_PER_S = 50.0
"""Default of PackConfig.max_chars_per_s (`--max-chars-per-s`): pack/itemcheck.py says why 50."""
DEFAULT_MIN_DURATION_S = 0.2
ENGINES = ("local", "ray")


@dataclass(frozen=True, kw_only=True, slots=True)
class PackConfig:
    input: str
    """Corpus: folder, TSV/CSV/JSONL manifest, LibriSpeech folder or Lhotse CutSet (any fsspec URL)."""
    output: str
    """Dataset folder or prefix (local path, file://, s3://bucket/prefix)."""
    source_format: str = "auto"
    """Input format (`--source-format`): auto, or one of sources.SOURCE_FORMATS."""
    text_column: str | None = None
    """Transcript column of a Hugging Face dataset or csv/tsv/jsonl input (`--text-column`); None tries text,
    sentence, ..."""
    audio_column: str | None = None
    """Audio path column of a csv/tsv/jsonl input (`--audio-column`); None tries path, audio, file_name, ..."""
    delimiter: str | None = None
    """Field separator of a csv/tsv input (`--delimiter`); None: "," for .csv, tab for .tsv."""
    storage_options: dict | None = field(default=None, repr=False)
    """fsspec options for INPUT and OUTPUT (`--storage-option k=v`), e.g. endpoint_url for S3."""
    codec: str = "flac"
    """Stored audio codec (`--codec`): flac, wav, opus or mp3."""
    sample_rate_hz: int = 16000
    """Stored sample rate (`--sample-rate`)."""
    channels: int = 1
    """Stored channel count (`--channels`)."""
    keep_original: bool = False
    """Store the input bytes unchanged, whatever their codec/rate/channels (`--keep-original`)."""
    decode_check: bool = True
    """Fully decode audio that is kept byte for byte, so a truncated file is rejected at pack time instead of
    failing in the training loader (`--no-decode-check` skips it: ~2 ms per 10 s of FLAC, most of a kept-FLAC
    pack's CPU time). Transcoded audio is always decoded anyway."""
    target_shard_mb: float = 256.0
    """Target shard size in MiB, estimated from headers before encoding (`--target-shard-mb`)."""
    max_samples_per_shard: int | None = None
    """Also cut a shard after this many samples (`--max-samples-per-shard`)."""
    channels_policy: str = "mix"
    """Multi-channel input to a mono target (`--channels-policy`): "mix" averages the channels, "first" keeps
    channel 0, "<index>" keeps that one (transcode.AudioTarget.channel_policy)."""
    min_duration_s: float | None = DEFAULT_MIN_DURATION_S
    """Reject utterances shorter than this, reason `too_short` (`--min-duration-s`; 0 or None keeps all). A clip
    under 0.2 s holds at most a phone or two: with a CTC model it is mostly a target longer than its frames or
    noise, so it is left out by default, and counted in rejects.jsonl."""
    max_duration_s: float | None = None
    """Reject utterances longer than this, reason `too_long` (`--max-duration-s`)."""
    max_chars_per_s: float | None = DEFAULT_MAX_CHARS_PER_S
    """Reject transcripts with more characters than this x duration + 20, reason `impossible_target`
    (`--max-chars-per-s`; 0 or None turns it off): a target no CTC model can align. 50 is ~3x read speech
    (~15 a second) and far above fast speech (~25-30); pack/itemcheck.py says why."""
    split: str | None = None
    """Split of a Hugging Face DatasetDict folder (`--split`, e.g. train); required for one, else unused."""
    workers: int = 1
    """Processes writing shards (`--workers`); 1 writes in this process. Output does not depend on it.
    Local engine only: Ray runs as many tasks as the cluster has CPUs."""
    engine: str = "local"
    """Where tasks run (`--engine`): "local" (this process, probe threads, a process pool) or "ray" (Ray tasks on
    a cluster, `pip install 'shardtrain[ray]'`). Output does not depend on it."""
    ray_address: str | None = None
    """Ray cluster to join (`--ray-address`): None starts a local one, "auto", or "ray://head:10001"."""
    part_items: int = 256
    """Items per listing/probe task (LibriSpeech: ~part_items/64 chapters). Output does not depend on it. Small
    enough that a few thousand files make several parts per worker (the scan runs in the pool)."""
    probe_threads: int = 8
    """Threads reading audio headers (I/O-bound; more helps on S3)."""
    strict: bool = False
    """Fail at the first bad item instead of rejecting it (`--strict`)."""
    overwrite: bool = False
    """Replace a different dataset already at OUTPUT (`--overwrite`)."""
    progress: bool = True
    """tqdm progress bars on stderr (`--no-progress` to disable; off anyway when stderr is not a TTY)."""

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise ValueError(f"--codec must be one of {CODECS}, got {self.codec!r}")
        if self.sample_rate_hz <= 0:
            raise ValueError(f"--sample-rate must be > 0, got {self.sample_rate_hz}")
        if self.channels < 1:
            raise ValueError(f"--channels must be >= 1, got {self.channels}")
        if not self.target_shard_mb > 0:
            raise ValueError(f"--target-shard-mb must be > 0, got {self.target_shard_mb}")
        if self.max_samples_per_shard is not None and self.max_samples_per_shard < 1:
            raise ValueError(f"--max-samples-per-shard must be >= 1, got {self.max_samples_per_shard}")
        if self.max_chars_per_s is not None and not self.max_chars_per_s >= 0:
            raise ValueError(f"--max-chars-per-s must be >= 0 (0 turns the check off), got {self.max_chars_per_s}")
        if self.min_duration_s is not None and self.max_duration_s is not None:
            if self.min_duration_s > self.max_duration_s:
                raise ValueError("--min-duration-s must be <= --max-duration-s")
        from shardtrain.pack.transcode import channel_index

        channel_index(self.channels_policy)
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.probe_threads < 1:
            raise ValueError(f"probe_threads must be >= 1, got {self.probe_threads}")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {ENGINES}, got {self.engine!r}")
        if self.part_items < 1:
            raise ValueError(f"part_items must be >= 1, got {self.part_items}")

    def dataset_options(self) -> dict:
        """Options that shape the output (recorded in the manifest, part of the fingerprint)."""
        return {
            "codec": self.codec,
            "sample_rate_hz": self.sample_rate_hz,
            "channels": self.channels,
            "keep_original": self.keep_original,
            "target_shard_mb": self.target_shard_mb,
            "max_samples_per_shard": self.max_samples_per_shard,
            "min_duration_s": self.min_duration_s,
            "max_duration_s": self.max_duration_s,
            "source_format": self.source_format,
            **({"text_column": self.text_column} if self.text_column else {}),
            **({"split": self.split} if self.split else {}),
            **({"audio_column": self.audio_column} if self.audio_column else {}),
            **({"delimiter": self.delimiter} if self.delimiter else {}),
            **({"channels_policy": self.channels_policy} if self.channels_policy != "mix" else {}),
            **({"max_chars_per_s": self.max_chars_per_s} if self.max_chars_per_s != DEFAULT_MAX_CHARS_PER_S else {}),
        }
