"""`shardtrain ledger RUN`: what a run actually trained on, per epoch, from its ledger (train/ledger.py)."""
from __future__ import annotations

import json
import sys

from shardtrain.cli.common import _CREDS_HELP, _parse_storage_options, missing_local_path, report_error


def _add_ledger(sub) -> None:
    p = sub.add_parser(
        "ledger", help="what a run trained on: per epoch, utterances seen once / never / more than once",
        description="Read RUN/ledger (written with every checkpoint) and account for each epoch: utterances trained "
                    "once, never, and more than once per dataset, those delivered but dropped before the loss "
                    "(targets CTC cannot align, a skipped step), each dataset's audio share against its weight, "
                    "across restarts, resumes and world-size changes. Exit status 1 when a row was trained more "
                    "often than the epoch's plan holds it (exactly-once broken), naming the keys.")
    p.add_argument("run", metavar="RUN", help="the run folder or URL given to `shardtrain train --out`")
    p.add_argument("--epoch", type=int, action="append", default=None, help="only this epoch (repeatable)")
    p.add_argument("--key", action="append", default=[], help="when and on which rank this utterance was trained "
                                                                "(repeatable)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="fsspec storage option for s3:// URLs. " + _CREDS_HELP)
    p.set_defaults(func=_cmd_ledger)


def _facts(datasets: list[tuple[str, float]], storage_options: dict | None):
    """Per dataset of the run: durations and keys, from its index (two columns)."""
    import numpy as np

    from shardtrain.format.manifest import open_dataset
    from shardtrain.train.ledger_report import DatasetFacts

    out = []
    for url, weight in datasets:
        ds = open_dataset(url, storage_options)
        table = ds.read_index(columns=["key", "duration_s"])
        out.append(DatasetFacts(content=ds.content_id, name=url, weight=float(weight),
                                durations_s=table.column("duration_s").to_numpy().astype(np.float64),
                                keys=np.asarray(table.column("key").to_pylist(), dtype=object)))
    return out


def _changed_since(history, facts) -> str | None:
    """Why the ledger cannot be read against today's datasets, or None: its rows are index positions, so a
    dataset re-packed with other audio (same row count) would have them name the wrong utterances."""
    for a in history.attempts:
        for recorded in a.datasets:
            now = next((f.content for f in facts if f.name == recorded.get("url")), None)
            if recorded.get("content") and now and recorded["content"] != now:
                return (f"{recorded['url']} changed since attempt {a.attempt} (shard sha256 differ: re-packed); the "
                        "ledger's rows would name other utterances. Account the run against the dataset it trained on")
    return None


def _cmd_ledger(args) -> int:
    if missing_local_path(args.run):  # before numpy's and fsspec's imports: a typo answers at once
        return report_error("ledger", FileNotFoundError(f"{args.run}: nothing is there; pass a run folder (the --out "
                                                        "of `shardtrain train`)"))
    from shardtrain import storage
    from shardtrain.train.ledger import read_history

    so = _parse_storage_options(args.storage_option) or None
    history = read_history(args.run, so)  # a wrong RUN is refused here, before the config imports torch
    if not history.attempts:
        print(f"{args.run}: the ledger holds no attempt yet (no step was checkpointed)", file=sys.stderr)
        return 1
    from shardtrain.load.mixplan import make_planner
    from shardtrain.train.config import RunConfig, data_sources
    from shardtrain.train.ledger_report import account, counts_from_selection, where_seen
    from shardtrain.train.overrides import from_dict

    cfg = from_dict(RunConfig, json.loads(storage.read_bytes(storage.join(args.run, "config.json"), so)))
    sources = data_sources(cfg.train)
    datasets = [(sources, 1.0)] if isinstance(sources, str) else list(sources)
    facts = _facts(datasets, so)
    changed = _changed_since(history, facts)
    if changed:
        print(f"ledger: error: {changed}", file=sys.stderr)
        return 1
    # the run's own planner says what each epoch holds (metadata only; a mixture's repeats are planned ones)
    planner = make_planner(sources, seed=cfg.train.seed, cfg=cfg.stream, storage_options=so)
    sizes = [len(f.durations_s) for f in facts]
    epochs = account(history, facts, lambda e: counts_from_selection(*planner.selection(e), sizes),
                     epochs=args.epoch)
    seen = {}
    for key in args.key:
        hits = []
        for i, f in enumerate(facts):
            rows = [j for j, k in enumerate(f.keys) if k == key] if f.keys is not None else []
            hits += [{"dataset": f.name, **h} for r in rows for h in where_seen(history, i, r)]
        seen[key] = hits
    report = {
        "run": args.run, "attempts": [{"attempt": a.attempt, "start_step": a.start_step, "world_size": a.world_size}
                                      for a in history.attempts],
        "steps": int(history.step.max()) if len(history.step) else 0, "replaced": history.cut,
        "redone": {k: round(sum(float(a.redone.get(k, 0)) for a in history.attempts), 2) for k in ("steps", "audio_s")},
        "epochs": [{"epoch": e.epoch, "complete": e.complete, "steps": e.steps, "exactly_once": not e.broken,
                    "datasets": [vars(d) for d in e.datasets]} for e in epochs],
        "keys": seen}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print_report(report)
    broken = [e for e in epochs if e.broken]
    for e in broken:
        for d in e.datasets:
            if d.over_plan_count:
                print(f"exactly-once broken in epoch {e.epoch}: {d.over_plan_count} rows of {d.name} trained more "
                      f"often than planned, e.g. {', '.join(d.over_plan[:5])}", file=sys.stderr)
    return 1 if broken else 0


def _print_report(r: dict) -> None:
    from shardtrain.format.safe import printable

    print(f"run {printable(r['run'])}: {r['steps']} steps in {len(r['attempts'])} attempt(s): " +
          ", ".join(f"from step {a['start_step']} on {a['world_size']} rank(s)" for a in r["attempts"]))
    for line in r["replaced"]:
        print(f"  {line}")
    print(f"wasted by interruptions: {r['redone']['steps']:.0f} steps, {r['redone']['audio_s']:.1f} audio-s trained "
          "again (a preemption that saved its step wastes none)")
    print(f"{'epoch':>5} {'state':>10} {'steps':>6}  {'dataset':<32} {'planned':>8} {'trained':>8} {'once':>8} "
          f"{'never':>7} {'>1':>6} {'dropped':>7} {'over plan':>9} {'share':>6} {'weight':>6}")
    for e in r["epochs"]:
        state = "complete" if e["complete"] else "partial"
        for d in e["datasets"]:
            name = printable(d["name"])
            name = name if len(name) <= 32 else "..." + name[-29:]
            print(f"{e['epoch']:>5} {state:>10} {e['steps']:>6}  {name:<32} {d['planned']:>8} {d['trained']:>8} "
                  f"{d['once']:>8} {d['never']:>7} {d['more_than_once']:>6} {d['not_trained']:>7} "
                  f"{d['over_plan_count']:>9} "
                  f"{d['share']:>6.3f} {d['weight_share']:>6.3f}")
    for key, hits in r["keys"].items():
        if not hits:
            print(f"key {printable(key)}: never trained")
        for h in hits:
            print(f"key {printable(key)}: epoch {h['epoch']} step {h['step']} rank {h['rank']} batch {h['batch']} "
                  f"(attempt {h['attempt']})" + ("" if h["trained"] else ": delivered, dropped before the loss"))
