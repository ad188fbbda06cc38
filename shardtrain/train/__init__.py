"""train: batches -> a trained CTC model under DDP. Imports `load`, `format`, `storage`.

    config.py      TrainConfig and RunConfig (composes stream, augment, feature and model configs)
    loop.py        train(): the process around a run: device, process group, signal handlers, lease
    trainer.py     Trainer: one rank's run and fit(), the step loop: batches, step, log, validate, checkpoint
    runstate.py    RunState: model, optimiser, schedule, counters; built fresh, restored, saved with checkpoints
    schedule.py    learning-rate schedule, augmentation seeds, the AdamW they drive (pure; shared with interop)
    step.py        what one batch needs on the device: to_device, augmenters, autocast, collectives
    evaluate.py    validation: loss, greedy CTC decoding, CER/WER per validation set and pooled
    valsets.py     the validation sets: names (given or derived from URLs, unique), start-up open check
    augment.py     device augmentation: speed, reverb, noise, gain
    features.py    log-mel, normalisation, SpecAugment
    model.py       the CTC baseline (Conformer / Transformer encoders) and the model protocol
    text.py        vocabularies, CTC targets, greedy decoding, edit distance
    checkpoint.py  atomic per-step checkpoints with the loader state (resumable on any world size)
    elastic.py     resuming on another world size: accumulation and learning rate for the new global batch
    keylog.py      `train.log_keys`: the keys every step trained on, per rank (audit)
    qat.py         quantization-aware training: fake-quantized Linear layers (`train.qat`)
    showcase.py    `shardtrain augment-demo`: augmented examples as WAV + spectrogram PNG
    metrics.py     metrics.jsonl + TensorBoard
    overrides.py   `--set a.b=v` and JSON round trips of the frozen config dataclasses
    budget.py      per-bucket batch budgets: budget.json (`shardtrain tune`) and the closed loop's moves
    closedloop.py  the trainer's side of per-bucket budgets: peaks per bucket, a new table between epochs
    ledger.py      what a run consumed: the index rows each rank trained on, written with every checkpoint
    ledger_report.py accounting of a ledger: per epoch, rows planned against rows trained (`shardtrain ledger`)
    memory.py      peak memory of a training step (CUDA and CPU) and what counts as out of memory
    normalize.py   transcript normalisation, applied the same way wherever text meets the model
    runfiles.py    the run folder's files (config.json, vocab.json, metrics.jsonl) and an s3:// --out's mirror
    tune.py        `shardtrain tune`: the largest batch per duration bucket that fits the memory target
    preempt.py     SIGTERM/SIGUSR1/Ctrl-C -> a flag every rank agrees on at a step boundary -> checkpoint, exit 75
    guards.py      what never reaches the weights: non-finite steps, CTC-impossible targets, NaN checkpoints
    update.py      one optimiser step over a step's micro-batches, surviving an out-of-memory error inside it
"""
