"""`shardtrain plan` at scale and the ledger's cost.

    plan: a simulated blocks planner (the real BlocksEpoch over a synthetic duration-sorted index of N rows,
          LibriSpeech-like durations, 256 MB shards; no files) -> load/preflight.py's figures for 1,024 ranks on
          128 nodes, timed; peak RSS of the fresh interpreter per size (the index arrays themselves included:
          what a node's page cache holds of the map; columns the planner never reads are zero-copy stand-ins, but
          counted at full size in the memory figures)
    ledger: LedgerWriter.add per micro-batch of 100 utterances (against a tiny_cpu training step on this machine,
          measured in the same run), flush size per million utterances, read_history + account of 1M utterances

Run: .venv/bin/python -m benchmarks.load.bench_preflight [--rows 1000000 10000000 100000000] [--out results/]
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import common

SHARD_BYTES = 256 << 20


def simulated_planner(n: int, max_batch_seconds: float, seed: int = 0):
    """A BlocksPlanner over a synthetic index of n rows (same seam, same block planner, no dataset files)."""
    from shardtrain.format.manifest import ShardInfo
    from shardtrain.load.blockplan import block_shape, make_blocks
    from shardtrain.load.plan import BucketConfig, PlanIndex, cost_s
    from shardtrain.load.planner import Shards, blocks_epoch

    rng = np.random.default_rng(seed)
    dur = np.sort(np.clip(rng.lognormal(np.log(8.0), 0.6, n), 0.5, 35.0))
    audio = (dur * 16000 * 2 * 0.55).astype(np.int64)
    size = 512 + (audio + 511) // 512 * 512 + 1024
    end = np.cumsum(size)
    shard = ((end - size) // SHARD_BYTES).astype(np.int32)
    first = np.searchsorted(shard, np.arange(int(shard[-1]) + 1))
    offset = end - size - (end - size)[first][shard]
    del end, audio
    zero = lambda dtype: np.broadcast_to(np.zeros(1, dtype), (n,))  # noqa: E731 - columns planning never reads
    idx = PlanIndex(shard=shard, offset=offset, size=size, audio_offset=zero(np.int64), audio_size=zero(np.int64),
                    json_offset=zero(np.int64), json_size=zero(np.int64), duration_s=dur,
                    num_samples=zero(np.int64), channels=zero(np.int16), key=None, text=None)
    bucket = BucketConfig(max_batch_seconds=max_batch_seconds)
    block_s, block_rows = block_shape(float(dur.sum()), n, bucket.batches_per_chunk, None)
    blocks = make_blocks(dur, size, block_s, max_batch_seconds, block_rows=block_rows)
    per_shard = np.bincount(shard)
    secs = np.bincount(shard, weights=dur)
    byts = np.bincount(shard, weights=size)
    infos = [ShardInfo(name=f"shard-{i:06d}.tar", samples=int(c), seconds=float(s), min_duration_s=0.0,
                       max_duration_s=0.0, bytes=int(b), sha256="0" * 64)
             for i, (c, s, b) in enumerate(zip(per_shard, secs, byts))]

    class Sim:
        name = "blocks"
        fingerprint = "simulated"
        datasets = [f"simulated-{n}"]
        sample_rate_hz = 16000

        def __init__(self):
            self.idx, self.blocks, self.bucket, self.seed = idx, blocks, bucket, seed
            self.data = Shards(url="sim", parts=(), shards=infos, base=np.zeros(1, np.int64))
            self.too_long = int(blocks.rows[blocks.too_long].sum())

        def cost_of(self, rows):
            return cost_s(np.asarray(idx.duration_s[rows]), bucket)

        def epoch(self, epoch, world_size, chain=()):
            return blocks_epoch(blocks, self.cost_of, seed, epoch, world_size, bucket, chain, index=idx)

    return Sim()


def plan_one(n: int, world_size: int, nodes: int, max_batch_seconds: float) -> dict:
    """In a fresh interpreter: build the simulated planner, then time the preflight figures."""
    from shardtrain.load.preflight import PreflightConfig, batch_figures, io_figures, memory_figures

    t0 = time.perf_counter()
    planner = simulated_planner(n, max_batch_seconds)
    build_s = time.perf_counter() - t0
    pc = PreflightConfig(world_size=world_size, nodes=nodes)
    t0 = time.perf_counter()
    fig = batch_figures(planner, pc, planner.bucket)
    fig.pop("batch_durations")
    mem = memory_figures(planner, pc)
    io = io_figures(planner, pc, fig, 3)
    plan_s = time.perf_counter() - t0
    return {"rows": n, "world_size": world_size, "blocks": len(planner.blocks), "simulate_index_s": round(build_s, 2),
            "plan_report_s": round(plan_s, 2), "steps_per_epoch": fig["steps_per_epoch"], "fill": round(fig["fill"], 3),
            "padding": round(fig["padding_efficiency"], 3), "per_rank_mb": round(mem["per_rank_bytes"] / 1e6, 1),
            "index_mb_per_node": round(mem["mapped_index_bytes"] / 1e6, 1),
            "node_read_mb_s": round(io["node_read_mb_s"], 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 0)}


def ledger_one(utterances: int = 1_000_000, per_batch: int = 100) -> dict:
    """LedgerWriter.add per micro-batch, bytes per million utterances, and the accounting of them."""
    from dataclasses import dataclass

    import torch

    from shardtrain.train.ledger import LedgerWriter, attempt_id, read_history
    from shardtrain.train.ledger_report import DatasetFacts, account, counts_from_selection

    @dataclass
    class B:
        rows: np.ndarray
        sources: np.ndarray
        epoch: int
        step: int

    rows = np.random.default_rng(0).permutation(utterances)
    src = np.zeros(per_batch, np.int16)
    with tempfile.TemporaryDirectory() as tmp:
        w = LedgerWriter(Path(tmp), rank=0, attempt=attempt_id(0, 1))
        w.start(start_step=0, world_size=1, datasets=[{"url": "sim", "weight": 1.0}])
        batches = [B(rows[i:i + per_batch], src, 0, i // per_batch) for i in range(0, utterances, per_batch)]
        t0 = time.perf_counter()
        for j, b in enumerate(batches):
            w.add(j + 1, [(b, {})])
        add_us = (time.perf_counter() - t0) / len(batches) * 1e6
        t0 = time.perf_counter()
        w.flush(len(batches))
        flush_s = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in (Path(tmp) / "ledger").iterdir())
        t0 = time.perf_counter()
        h = read_history(tmp)
        facts = [DatasetFacts(name="sim", weight=1.0, durations_s=np.full(utterances, 5.0))]
        account(h, facts, lambda e: counts_from_selection(np.zeros(utterances, np.int16), np.arange(utterances),
                                                          [utterances]))
        report_s = time.perf_counter() - t0
    # a tiny_cpu-sized step on this machine, for scale (forward + backward + step of a small conformer)
    from pipelines.tiny_cpu import config
    from shardtrain.train.model import build_model

    torch.set_num_threads(1)
    cfg = config()
    model = build_model(cfg.model, vocab_size=32, n_mels=cfg.features.n_mels)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 400, cfg.features.n_mels)
    lengths = torch.full((8,), 400)
    targets, target_lengths = torch.randint(1, 32, (8 * 20,)), torch.full((8,), 20)
    step_s = []
    for _ in range(3):
        t0 = time.perf_counter()
        loss, _, _ = model(x, lengths, targets, target_lengths)
        loss.backward()
        opt.step()
        opt.zero_grad()
        step_s.append(time.perf_counter() - t0)
    step = float(np.median(step_s))
    return {"utterances": utterances, "per_batch": per_batch, "add_us_per_micro_batch": round(add_us, 2),
            "flush_s": round(flush_s, 3), "mb_per_million_utterances": round(size / 1e6 * 1e6 / utterances, 2),
            "report_s_per_million": round(report_s * 1e6 / utterances, 2), "tiny_step_s": round(step, 3),
            "share_of_step": round(add_us / 1e6 / step, 6)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000, 100_000_000])
    ap.add_argument("--world-size", type=int, default=1024)
    ap.add_argument("--nodes", type=int, default=128)
    ap.add_argument("--max-batch-seconds", type=float, default=600.0)
    ap.add_argument("--out", type=Path, default=common.BENCH_DIR / "results")
    args = ap.parse_args(argv)
    rows = [common.run_isolated("bench_preflight", "plan_one", {"n": n, "world_size": args.world_size, "nodes": args.nodes,
                                                       "max_batch_seconds": args.max_batch_seconds}, timeout_s=3600)
            for n in args.rows]
    ledger = common.run_isolated("bench_preflight", "ledger_one", {})
    result = {"benchmark": "bench_preflight", "git_sha": common.git_sha(), "machine": common.machine(),
              "date": time.strftime("%Y-%m-%d"), "command": "python -m benchmarks.load.bench_preflight " + " ".join(argv or []),
              "rows": rows, "ledger": ledger}
    print(common.markdown_table(rows, [("rows", "rows"), ("blocks", "blocks"), ("plan_report_s", "plan report s"),
                                       ("steps_per_epoch", "steps"), ("fill", "fill"), ("padding", "padding"),
                                       ("per_rank_mb", "MB per rank"), ("index_mb_per_node", "index MB per node"),
                                       ("peak_rss_mb", "peak RSS MB")]))
    print(json.dumps(ledger))
    common.write_json(args.out / "bench_preflight.json", result)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
