"""StreamConfig: everything the loader does, in one frozen dataclass owned by the `load` room.

Planning (BucketConfig from plan.py), reading (piece size, retries and the retry budget, direct S3 HTTP, the
local shard cache), decoding (threads, int16 or float32 PCM) and the error policy (strict,
the share of an epoch that may be skipped as bad data). Each field's docstring gives its unit and cost.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from shardtrain.load.plan import BucketConfig

BLOCKS_IGNORE = ("padded_budget", "bins_s", "run_mb", "min_run_mb")
"""BucketConfig fields the block planner does not implement (it buckets blocks by audio, cuts chunks from whole
blocks and budgets summed seconds): set away from their defaults they are refused, never silently ignored."""


def refuse_ignored_fields(bucket: BucketConfig, why: str) -> None:
    """ValueError naming the first bucket field set away from its default that the block planner ignores."""
    defaults = BucketConfig()
    for f in fields(BucketConfig):
        if f.name in BLOCKS_IGNORE and getattr(bucket, f.name) != getattr(defaults, f.name):
            raise ValueError(f"stream.bucket.{f.name}={getattr(bucket, f.name)!r} is ignored by the block planner "
                             f"({why}): leave it at its default, or set stream.planner=rows")


NUM_WORKERS_REMOVED = (
    "stream.num_workers={n}: DataLoader worker processes were removed (they ran at 0.66-0.83x the in-process decode "
    "threads with twice the memory); the loader decodes in threads of the training process: set "
    "stream.decode_threads (default 3: one more than the cores it should use) and leave num_workers at 0, and "
    "wrap the loader in a DataLoader only with num_workers=0 (or not at all)")


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamConfig:
    bucket: BucketConfig = field(default_factory=BucketConfig)
    """Batch budget and bucketing (see plan.BucketConfig)."""
    epochs: int | None = 1
    """Stop after this many epochs (default one: a loader built with defaults ends, like any Python iterable).
    None streams endlessly, which a trainer asks for explicitly and stops on its own step count (max_steps)."""
    num_workers: int = 0
    """Removed: only 0 is accepted (kept so a config or checkpoint that says 0 still loads). DataLoader worker
    processes measured 0.66-0.83x the in-process decode threads at twice the peak RSS (benchmarks/load/compare.py:
    decoding releases the GIL, and workers add an int16 copy through shared memory plus a float32 conversion in
    the trainer); decode parallelism is `decode_threads`."""
    decode_threads: int = 3
    """Decode threads of the training process. Decoding runs without the GIL (audio.decode_into), so threads scale with cores;
    one more thread than cores fills the short GIL-held gaps (2 cores: 3 threads ~+5% over 2)."""
    prefetch_chunks: int = 2
    """Chunks in flight, the one being taken included: read, their rows queued for the decode threads (batch by
    batch, oldest first; reader.ChunkReader.start). Memory: their shard bytes (released row by row as decoded)
    plus ~3 decoded batches when the trainer keeps up, up to prefetch_chunks x batches_per_chunk when it does not."""
    decode_ahead: int = 1
    """How far the decode threads run ahead (load/pool.py's gate): a batch starts only when it is at most
    decode_ahead past the one the trainer waits for. 1: the next batch decodes during the trainer's step (and
    while this one's last rows finish), and peak memory holds 3 decoded batches (the trainer's, the awaited one,
    the next) instead of up to prefetch_chunks x batches_per_chunk; each more absorbs more step jitter for one
    batch's memory (~19 MB float32 at 300 s, 16 kHz)."""
    retries: int | None = None
    """Cap on failed tries in a row of one read (None: only `retry_budget_s` limits them)."""
    retry_budget_s: float = 120.0
    """Seconds a read (shard, manifest or index) may go without progress, waiting or retrying transient errors
    (connection refused/reset, timeouts, 5xx, throttling) alike, resuming at the byte reached; a silent or
    trickling server is cut at this budget while it is being waited on (storage.clock). Long enough to ride out
    a server restart or a short partition; past it the loader raises StreamError naming the URL and the cause
    (the job stops, and resumes from its last checkpoint). Costs ~6 us per MB read (bench_progress_clock.py)."""
    retry_backoff_s: float = 0.2
    """First backoff delay; doubles per consecutive failure (jittered, capped at 5 s)."""
    piece_mb: float = 8.0
    """Bytes per storage request inside a chunk read."""
    s3_direct_http: bool = True
    """Read s3:// shards through presigned URLs over plain HTTP connections (about a quarter of s3fs's CPU per
    byte, and no event loop competing with the decode threads); False reads through s3fs."""
    map_local: bool = True
    """Read local shards through a read-only memory map (storage.map_range): the decoder reads the page cache
    itself, without a copy into fresh memory (~9% of the loader's CPU on the benchmark corpora). False copies them
    with reads: for a dataset whose shards may be truncated in place while a run reads them (a mapped file cut
    short ends the process with SIGBUS; a read reports the rows as truncated_shard skips), or a filesystem whose
    mmap is slow."""
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
    planner: str = "auto"
    """"rows": plan_epoch over the whole index in every rank (~70 B a row per rank, plus keys and transcripts;
    batches ~90% of the budget). "blocks": the block planner (load/blockplan.py) over an index memory-mapped once
    per node (load/mapped.py): memory and plan time per rank independent of corpus size, batches a little less
    full (0.88 against 0.92 of the budget on 200k synthetic rows). "auto": blocks from `block_plan_min_rows` rows on
    (a mixture: its datasets' rows together), logged. The block planner does not implement the bucket fields
    in BLOCKS_IGNORE: a config that sets them is refused when it plans by blocks."""
    block_plan_min_rows: int = 4_000_000
    """Where "auto" switches to blocks: at 4M rows plan_epoch holds ~400 MB in each rank (3 GB on an 8-GPU node)."""
    block_s: float | None = None
    """Audio seconds per block of the block planner, the unit dealt to ranks (smaller: more variety and fuller
    batches, a larger table). None: the smallest the table allows, at least 30 s (blockplan.block_shape: 30 s at
    4M rows, ~790 s at 100M); blocks also end every max(batches_per_chunk, rows / 600k) rows."""
    index_cache_dir: str | None = None
    """Node-local folder for the block planner's memory-mapped index (~70 B a row plus keys and transcripts on
    disk; built by the first rank of a node); None: `<tempdir>/shardtrain-<uid>/index` (private to the user).
    A folder given here must be this user's and not writable by others (storage.private), else it is refused."""
    pcm_dtype: str = "float32"
    """Batch.waves dtype: "float32" in [-1, 1), or "int16" (raw PCM; half the host memory and copy to the device;
    the trainer converts there). Decoded straight to this dtype (no conversion pass)."""

    min_duration_s: float | None = None
    """Load-time filter: leave out utterances shorter than this (seconds; None: no lower bound). Filters are one
    row mask over the index before planning (load/rowfilter.py), counted (`filtered`), never silently dropped;
    changing them mid-epoch is refused on resume like a changed budget. Rows planner only (and mixtures by rows)."""
    max_duration_s: float | None = None
    """Load-time filter: leave out utterances longer than this (seconds; None: no upper bound)."""
    speakers: tuple[str, ...] = ()
    """Load-time filter: keep only these speakers (the index's `speaker` column, read only when set; empty: all)."""
    exclude_speakers: tuple[str, ...] = ()
    """Load-time filter: leave out these speakers."""

    def __post_init__(self) -> None:
        if self.num_workers != 0:
            raise ValueError(NUM_WORKERS_REMOVED.format(n=self.num_workers))
        if self.decode_threads < 1:
            raise ValueError("stream.decode_threads must be >= 1")
        if self.decode_ahead < 0:
            raise ValueError("stream.decode_ahead must be >= 0")
        if self.prefetch_chunks < 1:
            raise ValueError("stream.prefetch_chunks must be >= 1")
        if self.epochs is not None and self.epochs < 1:
            raise ValueError("stream.epochs must be >= 1 or None")
        if self.retry_budget_s < 0 or (self.retries is not None and self.retries < 0):
            raise ValueError("stream.retry_budget_s and stream.retries must be >= 0")
        if not 0.0 <= self.max_skipped_share <= 1.0:
            raise ValueError(f"stream.max_skipped_share must be in [0, 1], got {self.max_skipped_share}")
        if self.planner not in ("auto", "rows", "blocks"):
            raise ValueError(f"stream.planner must be 'auto', 'rows' or 'blocks', got {self.planner!r}")
        if self.planner == "blocks":
            refuse_ignored_fields(self.bucket, "stream.planner=blocks")
        if (self.block_s is not None and self.block_s <= 0) or self.block_plan_min_rows < 0:
            raise ValueError("stream.block_s must be > 0 and stream.block_plan_min_rows >= 0")
        if any(v is not None and v < 0 for v in (self.min_duration_s, self.max_duration_s)) or (
                self.min_duration_s is not None and self.max_duration_s is not None
                and self.min_duration_s > self.max_duration_s):
            raise ValueError(f"stream.min_duration_s/max_duration_s must be >= 0 and min <= max, got "
                             f"{self.min_duration_s}/{self.max_duration_s}")
        if self.pcm_dtype not in ("float32", "int16"):
            raise ValueError(f"stream.pcm_dtype must be 'float32' or 'int16', got {self.pcm_dtype!r}")
