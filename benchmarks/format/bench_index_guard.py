"""What the issue-21 index checks cost at open (footer bounds, strings read dictionary-encoded and length-checked
before decoding, num_samples vs duration x rate), per row, next to decoding one row.

    synthetic index of N rows (bench_validate._dataset: LibriSpeech-like keys, ~90-char transcripts)
      -> peer: pyarrow reads the columns, no checks
      -> Dataset.read_index: check_footer + read_bounded + check_index (what every reader now pays)
    packed tone corpus -> one FLAC decode per row (the peer of every per-row figure)

Prints one JSON object: seconds per read, microseconds per row, and the per-row check cost as a share of one decode.
Run: python -m benchmarks.format.bench_index_guard --rows 1000000
Figures are noisy on a shared machine: the ratios (same process, interleaved, best of --repeats) are what to quote.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import pyarrow.parquet as pq

from benchmarks.load.bench_validate import _best, _dataset, row_check_cost

from shardtrain.format.indexread import check_footer  # noqa: E402
from shardtrain.load.plan import PLAN_COLUMNS  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--utterances", type=int, default=20, help="packed utterances for the decode peer")
    args = ap.parse_args()
    out: dict = {"rows": args.rows}
    with tempfile.TemporaryDirectory() as root:
        ds = _dataset(root, args.rows)
        path = os.path.join(root, "index.parquet")
        plan = list(PLAN_COLUMNS) + ["sample_rate_hz"]
        for name, cols in (("plan", plan), ("key_text", ["key", "text"])):
            raw = _best(lambda: pq.ParquetFile(path).read(columns=cols), args.repeats)
            checked = _best(lambda: ds.read_index(cols), args.repeats)
            out[f"{name}_unchecked_s"], out[f"{name}_checked_s"] = round(raw, 4), round(checked, 4)
            out[f"{name}_checks_us_per_row"] = round((checked - raw) / args.rows * 1e6, 3)
            out[f"{name}_checked_vs_unchecked_x"] = round(checked / raw, 2)
        pf = pq.ParquetFile(path)
        out["footer_check_s"] = round(_best(lambda: check_footer(pf, args.rows, pf.schema_arrow.names, path),
                                            args.repeats), 5)
    decode_us = row_check_cost(args.utterances, args.repeats)["row_decode_us"]
    out["row_decode_us"] = decode_us
    per_row = out["plan_checks_us_per_row"] + out["key_text_checks_us_per_row"]
    out["open_checks_vs_one_decode_per_row"] = round(per_row / decode_us, 5)
    print(json.dumps(out))
    for k, v in out.items():
        print(f"{k:<36} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
