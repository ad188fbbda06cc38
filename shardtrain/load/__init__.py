"""load: a packed dataset -> planned, bucketed batches on every rank, with exact resume. Imports `format`, `storage`.

    config.py   StreamConfig (what the loader does; owns BucketConfig through plan.py)
    plan.py     the epoch plan: a pure function from index metadata to every rank's chunks and batches
    rowfilter.py load-time row filters (duration, speakers): one row mask every rows planner leaves out
    pool.py     the decode thread pool that serves the oldest batch first, gated by how far ahead it may run
    reader.py   one chunk: ranged reads by index offsets -> decode into batch rows -> a Future per batch;
                read_members: any index rows through the same path (the noise bank's reads)
    batch.py    Batch (padded waves + lengths + keys/texts) and pcm_to_float
    planner.py  the planner seam (Planner, EpochView, RankChunk, Shards) with the rows and blocks planners
    loader.py   Loader / build_loader: any planner -> reader -> (Batch, state) with resume and elastic re-stripe
    mixture.py  weighted mixtures, pure: which rows of each dataset an epoch holds -> one gathered PlanIndex
    mixplan.py  MixturePlanner: a weighted mixture (local and s3:// mixed) planned by rows or by blocks;
                make_planner (one URL or a mixture)
    blockplan.py the epoch plan at block granularity for 100M-row corpora (stream.planner=blocks; auto from 4M rows)
    mapped.py   the index as a node-shared memory map (built once per node) for the block planner
    bench.py    the loader timed per stage (`shardtrain bench`)
    errors.py   StreamError, importable without torch (the CLI classifies errors with it)
    buffers.py  recycled memory for decoded batches, returned when the trainer drops a batch
    mapfiles.py the files of a memory-mapped index copy, written plainly and checked when opened
    padding.py  padding-aware bucket edges and deals shared by every planner that buckets
    preflight.py a run seen before launch from metadata only (`shardtrain plan`)

Nothing here is imported by `shardtrain/__init__` eagerly, so `shardtrain pack` never loads torch.
"""
