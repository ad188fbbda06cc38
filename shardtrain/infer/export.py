"""ONNX export of a trained CTC model, int8 dynamic quantization, and an ONNX Runtime recogniser.

    TrainedModel (float; QAT fake-quant removed)
      -> AudioToLogProbs: waves [B, T] float32 at features.sample_rate_hz + lengths [B] int64
           -> log-mel (STFT as an ONNX op) -> normalisation -> encoder -> log_probs [B, T', V], out_lengths [B]
      -> torch.onnx.export(dynamo=True, opset 18), batch and time axes dynamic      -> OUT.onnx
      -> onnxruntime.quantization.quantize_dynamic(int8 weights, uint8 activations) -> OUT.int8.onnx
    OnnxRecognizer(OUT.onnx): infer/onnx_runtime.py, numpy + onnxruntime only (no torch): resample -> pad to
        >= MIN_SAMPLES -> session.run -> greedy CTC -> texts

The feature front end is inside the graph (`with_features=True`, the default): the ONNX model takes raw audio at
the model's rate, so a deployment needs no torchaudio. It exports cleanly (log-mel per utterance is the same
reflect-pad + STFT + mel matmul as training; tests compare it with PyTorch on real utterances).
`with_features=False` exports the encoder alone (input feats [B, F, n_mels] + feat_lengths), for runtimes that
compute features themselves. Resampling stays outside the graph.
The graph carries its own metadata (`metadata_props`): the tokenizer (JSON), the feature config, the input kind
and the training step, so `OnnxRecognizer` needs nothing but the .onnx file.

Numerics: float32 ONNX Runtime matches PyTorch log-probs to ~1e-5 (tests assert <= 1e-3 absolute on real
speech) and gives identical greedy transcripts. int8 dynamic quantization quantizes every MatMul/Gemm weight
(attention projections included) to int8 with per-call uint8 activation ranges; convolutions and the mel
filterbank stay float (see `mel_matmuls`).
Export cost: ~5-10 s for the tiny Conformer on 2 CPU cores (dynamo tracing); a BiLSTM takes longer (~1 min).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, cast

import torch

from shardtrain.infer.checkpoint_model import TrainedModel
from shardtrain.train.features import FeatureConfig, log_mel, normalize
from shardtrain.train.model import CTCModel
from shardtrain.train.overrides import from_dict
from shardtrain.train.qat import disable_qat
from shardtrain.infer.onnx_runtime import MIN_SAMPLES, OnnxRecognizer

__all__ = ["ExportResult", "OnnxRecognizer", "export_onnx", "mel_matmuls", "quantize_int8"]

log = logging.getLogger(__name__)

OPSET = 18
MIN_FRAMES = 32


class AudioToLogProbs(torch.nn.Module):
    """waves [B, T] + lengths [B] -> (log_probs [B, T', V], out_lengths [B]); features computed in the graph."""

    def __init__(self, model: CTCModel, fc: FeatureConfig) -> None:
        super().__init__()
        self.model, self.fc, self.mel = model, fc, fc.mel_module()

    def forward(self, waves: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        feats, feat_lengths = log_mel(self.mel, waves, lengths, self.fc)
        return self.model.encode(normalize(feats, feat_lengths, self.fc), feat_lengths)


class FeatsToLogProbs(torch.nn.Module):
    def __init__(self, model: CTCModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, feats: torch.Tensor, feat_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.encode(feats, feat_lengths)


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportResult:
    path: str
    quantized_path: str | None
    with_features: bool
    bytes: int
    quantized_bytes: int | None
    export_s: float


def export_onnx(tm: TrainedModel, out: str | os.PathLike, *, with_features: bool = True,
                quantize: str | None = None) -> ExportResult:
    """Write OUT (float32) and, with quantize="int8", OUT with suffix .int8.onnx beside it."""
    if quantize not in (None, "int8"):
        raise ValueError(f"--quantize must be int8, got {quantize!r}")
    if not hasattr(tm.model, "encode"):
        raise ValueError(f"{tm.path}: the model ({type(tm.model).__name__}) has no encode(feats, feat_lengths); "
                         "ONNX export supports the built-in CTC model (model.factory empty)")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model = cast(CTCModel, copy.deepcopy(tm.model).to("cpu").eval())  # tm stays usable (device, QAT) after the export
    disable_qat(model)  # the float graph; ONNX Runtime quantizes it for real
    fc = tm.config.features
    batch = torch.export.Dim("batch", min=1)
    t0 = time.perf_counter()
    if with_features:
        wrapper: torch.nn.Module = AudioToLogProbs(model, fc).eval()
        rate = fc.sample_rate_hz
        args = (torch.randn(2, rate) * 0.1, torch.tensor([rate, rate * 3 // 4]))
        names = ["waves", "lengths"]
        time_dim = torch.export.Dim("samples", min=MIN_SAMPLES)
    else:
        wrapper = FeatsToLogProbs(model).eval()
        args = (torch.randn(2, 200, fc.n_mels), torch.tensor([200, 150]))
        names = ["feats", "feat_lengths"]
        time_dim = torch.export.Dim("frames", min=MIN_FRAMES)
    shapes = {"waves" if with_features else "feats": {0: batch, 1: time_dim},
              "lengths" if with_features else "feat_lengths": {0: batch}}
    with torch.no_grad(), _benign_export_noise_filtered():
        torch.onnx.export(wrapper, args, str(out), input_names=names, output_names=["log_probs", "out_lengths"],
                          dynamic_shapes=shapes, dynamo=True, opset_version=OPSET, verbose=False)
    _write_metadata(out, tm, with_features)
    export_s = time.perf_counter() - t0
    qpath = None
    if quantize == "int8":
        qpath = out.with_suffix(".int8.onnx")
        quantize_int8(out, qpath)
    log.info("exported %s (%.1f MB, %.1f s)%s", out, out.stat().st_size / 1e6, export_s,
             f" and {qpath} ({qpath.stat().st_size / 1e6:.1f} MB)" if qpath else "")
    return ExportResult(path=str(out), quantized_path=str(qpath) if qpath else None, with_features=with_features,
                        bytes=out.stat().st_size, quantized_bytes=qpath.stat().st_size if qpath else None,
                        export_s=export_s)


BENIGN_LOGS = {"torch.onnx._internal.exporter._registration": "torchvision is not installed. Skipping torchvision::"}
"""Logger -> message prefix torch.onnx.export logs on every call that says nothing about this model (we export no
torchvision op)."""
BENIGN_WARNINGS = r"# The axis name: (\w+) will not be used, since it shares the same shape constraints with another axis"
"""A UserWarning for a Dim used on two inputs (waves and lengths share `batch`, on purpose)."""


class _DropPrefix(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


@contextlib.contextmanager
def _benign_export_noise_filtered() -> Iterator[None]:
    """Silence exactly the known-benign lines of torch.onnx.export (by logger + message prefix, and by warning
    category + message), for the duration of the call; any other warning or log line still shows."""
    filters = [(logging.getLogger(name), _DropPrefix(prefix)) for name, prefix in BENIGN_LOGS.items()]
    for logger, f in filters:
        logger.addFilter(f)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=BENIGN_WARNINGS, category=UserWarning)
            yield
    finally:
        for logger, f in filters:
            logger.removeFilter(f)


def _write_metadata(path: Path, tm: TrainedModel, with_features: bool) -> None:
    import onnx

    m = onnx.load(str(path))
    meta = {"shardtrain.tokenizer": json.dumps(tm.tokenizer.to_json()),
            "shardtrain.features": json.dumps(dataclasses.asdict(tm.config.features)),
            "shardtrain.input": "waves" if with_features else "feats",
            "shardtrain.step": str(tm.step), "shardtrain.encoder": tm.config.model.encoder}
    for k, v in meta.items():
        m.metadata_props.add(key=k, value=v)
    onnx.save(m, str(path))  # weights inline (the exporter's side file is folded in): one self-contained file
    side = path.with_name(path.name + ".data")
    if side.exists():
        side.unlink()


def mel_matmuls(model, fc: FeatureConfig) -> list[str]:
    """Names of the MatMul nodes applying the mel filterbank (constant [n_fft/2 + 1, n_mels] operand).

    They must stay float: their input is the power spectrum, whose dynamic range (~1e-10 to 1e3) one uint8
    scale per tensor cannot hold (quantizing it took the tiny model's CER from 0.00 to 0.55)."""
    shape = [fc.n_fft_samples // 2 + 1, fc.n_mels]
    inits = {i.name: list(i.dims) for i in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type == "MatMul" and any(inits.get(i) == shape for i in n.input)]


def quantize_int8(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """ONNX Runtime dynamic quantization: int8 symmetric weights for the model's MatMul/Gemm, uint8 activations
    per call; the feature front end (mel filterbank) stays float32."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(src))
    src_meta = {p.key: p.value for p in model.metadata_props}
    fc = from_dict(FeatureConfig, json.loads(src_meta["shardtrain.features"])) if "shardtrain.features" in src_meta \
        else None
    exclude = mel_matmuls(model, fc) if fc is not None and src_meta.get("shardtrain.input") == "waves" else []
    root = logging.getLogger()
    level = root.level
    root.setLevel(max(level, logging.ERROR))  # the quantizer logs an INFO line per tensor (and a pre-processing hint) on the root logger
    try:
        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul", "Gemm"],
                         nodes_to_exclude=exclude)
    finally:
        root.setLevel(level)
    m = onnx.load(str(dst))
    have = {p.key for p in m.metadata_props}
    for k, v in src_meta.items():
        if k not in have:
            m.metadata_props.add(key=k, value=v)
    onnx.save(m, str(dst))
