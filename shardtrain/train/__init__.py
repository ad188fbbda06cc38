"""train: batches -> a trained CTC model under DDP. Imports `load`, `format`, `storage`.

    config.py      TrainConfig and RunConfig (composes stream, augment, feature and model configs)
    loop.py        train(): process group, model, optimiser, the step loop, validation and checkpoints
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
"""
