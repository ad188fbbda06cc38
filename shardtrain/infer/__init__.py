"""infer: use what was trained. Transcribe, score, export to ONNX, quantize. Imports `train`, `load`, `format`, `storage`.

    checkpoint_model.py  run dir, step dir or Lightning .ckpt -> TrainedModel (model + tokenizer + RunConfig); raw waves -> features
                         (as validation computes them) -> log-probs -> greedy CTC transcripts
    transcribe.py        audio files, folders, datasets (local or s3://) -> duration-sorted batches -> one row per
                         utterance {key, text, duration_s, source, reference, cer}
    score.py             CER/WER with substitution/insertion/deletion counts and the worst utterances; Markdown table
    export.py            ONNX export (feature front end inside the graph, dynamic batch and time), int8 dynamic
                         quantization (ONNX Runtime)
    onnx_runtime.py      OnnxRecognizer: runs the exported .onnx file with onnxruntime + numpy alone (no torch)

Quantization-aware training itself lives in train/qat.py (it changes the model the trainer builds).
"""
