"""Streaming loader: planned batches read from shards on disk or S3, with exact resume.

    manifest.json + index.parquet (numeric columns only)            -> PlanIndex (~40 B/row, shared by workers)
      -> plan_epoch(seed, epoch, world_size, BucketConfig)          -> groups of chunks, batches fixed per chunk
      -> this rank's chunks; DataLoader worker w takes chunk j when (j + chunks before) % num_workers == w
      -> read_chunk: one ranged read per byte run (retry + resume at byte reached; optional local shard cache)
      -> decode: libsndfile in a thread pool straight into batch rows (no GIL: audio.decode_into)
      -> ChunkBatches: per batch int16 [B, T] + lengths + keys/texts (half the bytes of float32 across IPC)
      -> Loader (main process): float32 [B, T] zero-padded (pinned when CUDA exists) -> (Batch, state)

Why threads, and why whole chunks per worker item: decoding in a thread pool inside one process reaches the
decode-only limit without the inter-process copy (stack.md), so `num_workers=0` with `decode_threads=3` is the
default; with worker processes, each DataLoader item is one chunk's batches, so DataLoader's round-robin over
workers yields chunks in plan order whatever `num_workers` is. The state is a cursor (epoch, step) kept by the
main process, never by workers, so a checkpoint cannot run ahead of the trainer.

A resume with a different world size re-plans only the rest of the epoch: rows consumed under the old world
size are recomputed from the (pure) plan and excluded (`chain` in the state).
"""
from __future__ import annotations

from dataclasses import dataclass, field


from shardtrain.load.plan import BucketConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamConfig:
    bucket: BucketConfig = field(default_factory=BucketConfig)
    """Batch budget and bucketing (see plan.BucketConfig)."""
    epochs: int | None = None
    """Stop after this many epochs; None repeats forever (the trainer stops on max_steps)."""
    num_workers: int = 0
    """DataLoader worker processes. 0 decodes in threads of the main process (fastest on few cores)."""
    decode_threads: int = 3
    """Decode threads per process. Decoding runs without the GIL (audio.decode_into), so threads scale with cores;
    one more thread than cores fills the short GIL-held gaps (2 cores: 3 threads ~+5% over 2)."""
    prefetch_chunks: int = 2
    """Chunks read and decoded ahead per process; memory ~ prefetch_chunks x batches_per_chunk decoded batches."""
    retries: int | None = None
    """Cap on failed tries in a row of one read (None: only `retry_budget_s` limits them)."""
    retry_budget_s: float = 120.0
    """Seconds a read keeps retrying transient errors (connection refused/reset, timeouts, 5xx, throttling)
    without receiving a byte, resuming at the byte reached. Long enough to ride out a server restart or a short
    partition; past it the loader raises StreamError naming the URL (the job stops, and resumes from its last
    checkpoint). Costs nothing while storage answers."""
    retry_backoff_s: float = 0.2
    """First backoff delay; doubles per consecutive failure (jittered, capped at 5 s)."""
    piece_mb: float = 8.0
    """Bytes per storage request inside a chunk read."""
    s3_direct_http: bool = True
    """Read s3:// shards through presigned URLs over plain HTTP connections (about a quarter of s3fs's CPU per
    byte, and no event loop competing with the decode threads); False reads through s3fs."""
    strict: bool = False
    """Raise on the first corrupt sample or failed shard instead of skipping and recording it."""
    cache_dir: str | None = None
    """Local folder caching whole remote shards across epochs (LRU); None disables."""
    cache_max_gb: float = 50.0
    """Size cap of `cache_dir`; least recently used shards are evicted past it."""
    max_skipped_share: float = 0.01
    """Stop (StreamError) once more than this share of an epoch's samples (this rank's) were skipped as bad data:
    a few corrupt members are skipped and counted, a broken dataset stops the job instead of training on little."""
    check_transcripts: bool = True
    """Hold the index's transcripts (Arrow, ~100 bytes a row) and skip a sample whose `<key>.json` text differs
    (a flipped byte in a shard). False saves that memory; the header checksum, name and size checks remain."""
    max_error_keys: int = 1000
    """Skipped keys kept in stats/state (counts are always exact)."""
    pcm_dtype: str = "float32"
    """Batch.waves dtype: "float32" in [-1, 1), or "int16" (raw PCM; half the host memory traffic, ~10% more
    throughput on 2 cores; the trainer converts on the device)."""

    def __post_init__(self) -> None:
        if self.num_workers < 0:
            raise ValueError("stream.num_workers must be >= 0")
        if self.decode_threads < 1:
            raise ValueError("stream.decode_threads must be >= 1")
        if self.prefetch_chunks < 1:
            raise ValueError("stream.prefetch_chunks must be >= 1")
        if self.epochs is not None and self.epochs < 1:
            raise ValueError("stream.epochs must be >= 1 or None")
        if self.retry_budget_s < 0 or (self.retries is not None and self.retries < 0):
            raise ValueError("stream.retry_budget_s and stream.retries must be >= 0")
        if not 0.0 <= self.max_skipped_share <= 1.0:
            raise ValueError(f"stream.max_skipped_share must be in [0, 1], got {self.max_skipped_share}")
        if self.pcm_dtype not in ("float32", "int16"):
            raise ValueError(f"stream.pcm_dtype must be 'float32' or 'int16', got {self.pcm_dtype!r}")
