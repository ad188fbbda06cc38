"""infer: use what was trained. Transcribe, score, export to ONNX, quantize. Imports `train`, `load`, `format`, `storage`.

    checkpoint_model.py  run dir, step dir or Lightning .ckpt -> TrainedModel (model + tokenizer + RunConfig); raw waves -> features
                         (as validation computes them) -> log-probs -> greedy CTC transcripts
    audio_in.py          Utterance (audio ref, segment, reference) -> header probe, block-wise bounded decode,
                         windows for long audio (memory bounded by a window, never by what a header claims)
    transcribe.py        audio files, folders, UtteranceSources (Kaldi/Common Voice/HF/manifests, built by the CLI
                         with pack's readers), datasets (local or s3://) -> duration-sorted batches or windows -> one
                         row per utterance {key, text, duration_s, source, reference, cer} or {key, source, error}
    score.py             CER/WER, normalised (the model's normaliser) and raw, with substitution/insertion/deletion
                         counts and the worst utterances; Markdown table with escaped cells
    export.py            ONNX export (feature front end inside the graph, dynamic batch and time), int8 dynamic
                         quantization (ONNX Runtime)
    onnx_runtime.py      OnnxRecognizer: runs the exported .onnx file with onnxruntime + numpy alone (no torch)

Quantization-aware training itself lives in train/qat.py (it changes the model the trainer builds).
"""
