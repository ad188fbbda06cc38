"""The options of a pack: `PackConfig` (what `shardtrain pack` takes, one field per flag) and the `AudioTarget` it
holds (what shards store), each validated once, when built.

Frozen dataclasses with no I/O and light imports (format.codecs only), so every pack module can name them (the
scan, layout and shard tasks read them) without importing the packer or soundfile. `dataset_options` is what the
manifest records and the dataset fingerprint hashes: a field added there changes every fingerprint.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from shardtrain.format.codecs import CODECS

DEFAULT_MAX_CHARS_PER_S = 50.0
"""Default of PackConfig.max_chars_per_s (`--max-chars-per-s`): pack/itemcheck.py says why 50."""
DEFAULT_MIN_DURATION_S = 0.2
ENGINES = ("local", "ray")

OPUS_RATES_HZ = (8000, 12000, 16000, 24000, 48000)
"""Sample rates Opus encodes (a target outside them is refused)."""
MP3_RATES_HZ = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)
"""Sample rates MPEG-1/2 layer III encodes."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AudioTarget:
    """How audio is stored in shards (`PackConfig.audio`; transcode.py applies it). Validated here, once."""

    codec: str = "flac"
    """Stored codec: flac (16-bit), wav (PCM_16), opus (Ogg/Opus) or mp3."""
    sample_rate_hz: int = 16000
    """Stored sample rate; opus needs 8000/12000/16000/24000/48000."""
    channels: int = 1
    """Stored channels; 1 downmixes by averaging."""
    keep_original: bool = False
    """Keep whole files in any shard codec byte for byte, whatever their rate and channels (segments and other
    codecs are still transcoded to this target)."""
    verify_decode: bool = True
    """Decode kept-original files fully so a truncated file is rejected here, not in the training loader
    (FLAC: ~2 ms per 10 s of audio; `--no-decode-check` turns it off). False still checks that the content reaches
    the length the header claims (tailcheck: ~0.05 ms)."""
    channel_policy: str = "mix"
    """How a multi-channel input becomes the mono a 1-channel target stores (`--channels-policy`): "mix" averages
    the channels (a recording with speech on one side only loses 6 dB; channels in opposite polarity, whose mean
    is 30 dB or more below them, are rejected: `cancelled_downmix`), "first" keeps channel 0, "<index>" keeps
    that channel (an input with fewer channels is rejected, `missing_channel`). Picking a channel copies its
    16-bit samples exactly when no resampling is needed."""
    max_clipped_share: float = 0.01
    """A float source with more than this share of its samples beyond full scale (|x| > 1.0) is rejected
    (`clipped_audio`); fewer are clipped with a warning. 1%: a normalised file's overs (resampling, a limiter) are
    far rarer; integer-scaled floats put nearly every sample over."""

    def __post_init__(self) -> None:
        if self.codec not in CODECS:
            raise ValueError(f"--codec must be one of {CODECS}, got {self.codec!r}")
        if self.sample_rate_hz <= 0:
            raise ValueError(f"--sample-rate must be > 0, got {self.sample_rate_hz}")
        if not 0.0 <= self.max_clipped_share <= 1.0:
            raise ValueError(f"max_clipped_share must be in [0, 1], got {self.max_clipped_share}")
        if self.codec == "opus" and self.sample_rate_hz not in OPUS_RATES_HZ:
            raise ValueError(f"--sample-rate {self.sample_rate_hz} is not allowed with opus; use one of "
                             f"{OPUS_RATES_HZ}")
        if self.codec == "mp3" and self.sample_rate_hz not in MP3_RATES_HZ:
            raise ValueError(f"--sample-rate {self.sample_rate_hz} is not allowed with mp3; use one of "
                             f"{MP3_RATES_HZ}")
        if not 1 <= self.channels <= (2 if self.codec in ("opus", "mp3") else 8):
            raise ValueError(f"--channels must be 1..{2 if self.codec in ('opus', 'mp3') else 8} for "
                             f"{self.codec}, got {self.channels}")
        channel_index(self.channel_policy)  # validates


def channel_index(policy: str) -> int | None:
    """None for "mix", else the channel a policy keeps ("first" = 0, "<index>"); ValueError names the flag."""
    if policy == "mix":
        return None
    if policy == "first":
        return 0
    if policy.isdigit() and policy.isascii():
        return int(policy)
    raise ValueError(f"--channels-policy must be mix, first or a channel index (0, 1, ...), got {policy!r}")


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
    audio: AudioTarget = field(default_factory=AudioTarget)
    """What shards store (`--codec`, `--sample-rate`, `--channels`, `--keep-original`, `--no-decode-check`,
    `--channels-policy`): see AudioTarget."""
    target_shard_mb: float = 256.0
    """Target shard size in MiB, estimated from headers before encoding (`--target-shard-mb`)."""
    max_samples_per_shard: int | None = None
    """Also cut a shard after this many samples (`--max-samples-per-shard`)."""
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
        if not self.target_shard_mb > 0:
            raise ValueError(f"--target-shard-mb must be > 0, got {self.target_shard_mb}")
        if self.max_samples_per_shard is not None and self.max_samples_per_shard < 1:
            raise ValueError(f"--max-samples-per-shard must be >= 1, got {self.max_samples_per_shard}")
        if self.max_chars_per_s is not None and not self.max_chars_per_s >= 0:
            raise ValueError(f"--max-chars-per-s must be >= 0 (0 turns the check off), got {self.max_chars_per_s}")
        if self.min_duration_s is not None and self.max_duration_s is not None:
            if self.min_duration_s > self.max_duration_s:
                raise ValueError("--min-duration-s must be <= --max-duration-s")
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
            "codec": self.audio.codec,
            "sample_rate_hz": self.audio.sample_rate_hz,
            "channels": self.audio.channels,
            "keep_original": self.audio.keep_original,
            "target_shard_mb": self.target_shard_mb,
            "max_samples_per_shard": self.max_samples_per_shard,
            "min_duration_s": self.min_duration_s,
            "max_duration_s": self.max_duration_s,
            "source_format": self.source_format,
            **({"text_column": self.text_column} if self.text_column else {}),
            **({"split": self.split} if self.split else {}),
            **({"audio_column": self.audio_column} if self.audio_column else {}),
            **({"delimiter": self.delimiter} if self.delimiter else {}),
            **({"channels_policy": self.audio.channel_policy} if self.audio.channel_policy != "mix" else {}),
            **({"max_chars_per_s": self.max_chars_per_s} if self.max_chars_per_s != DEFAULT_MAX_CHARS_PER_S else {}),
        }
