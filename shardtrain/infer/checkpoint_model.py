"""A trained model ready for inference, loaded from what `shardtrain train` wrote.

    Lightning: RUN_DIR/checkpoints/{last,step=N,best-step=N-val_loss=X}.ckpt or one .ckpt file (hyper_parameters:
    config + tokenizer; state_dict: the model under `model.`), as interop/lightning.build_trainer writes them.

    RUN_DIR/                      or   RUN_DIR/checkpoints/step_NNNNNN/
      checkpoints/step_NNNNNN/         model.pt   (state_dict)
        model.pt, meta.json            meta.json  (step, val_loss, the resolved RunConfig)
      vocab.json                       train_state.pt (tokenizer, when no RUN_DIR/vocab.json is beside it)
      (meta.json's own `tokenizer`, written with every checkpoint, comes first: RUN_DIR/vocab.json is the latest
       run's, and a run that started over in the folder rewrote it beside older steps of another vocabulary)
  -> TrainedModel(model in eval mode on the device, tokenizer, RunConfig, step)
  -> waves [B, T] float32 at any rate + lengths [B]
       -> resample to features.sample_rate_hz -> log-mel -> normalize   (exactly the validation features)
       -> model -> log_probs [B, T', V], out_lengths [B] -> greedy CTC -> texts

A run directory resolves to its newest committed checkpoint (`which="latest"`) or the one with the lowest
validation loss (`which="best"`). The config is rebuilt from the checkpoint's own meta.json (not the run's
config.json, which a later `--resume` with other flags may have rewritten), so the features and the model
are those the weights were trained with. Loading reads tensors only (`weights_only=True`).
A run written to an object store (`--out s3://bucket/run`) is read through shardtrain.storage: its committed steps
(meta.json present, train.checkpoint's protocol) are listed, and meta.json, vocab.json and model.pt are fetched
whole (one GET each; no local copy). Its path stays a URL string (never a Path, which would fold `s3://` to `s3:/`).
A model trained with `train.qat=true` is rebuilt with its fake-quant layers (PyTorch inference then matches
the int8 arithmetic it was trained for); `qat=False` loads the same weights into the float model.
"""
from __future__ import annotations

import io
import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch

from shardtrain import storage
from shardtrain.train import checkpoint as run_checkpoints
from shardtrain.train.augment import resample
from shardtrain.train.config import RunConfig
from shardtrain.train.features import log_mel, normalize
from shardtrain.train.model import SpeechModel, build_model
from shardtrain.train.overrides import from_dict
from shardtrain.train.qat import enable_qat
from shardtrain.train.text import Tokenizer, tokenizer_from_json

log = logging.getLogger(__name__)

_STEP = re.compile(r"step_(\d{6,})\Z")
_PL_STEP = re.compile(r"step=(\d+)")
_PL_LOSS = re.compile(r"val_loss=([0-9.]+?)(?:\.ckpt)?\Z")


class CheckpointError(ValueError):
    """A path that is not a run directory or a committed checkpoint; the message says what was expected."""


def _lightning_checkpoint(root: Path, which: str) -> Path | None:
    """A Lightning run's `.ckpt` (interop/lightning.build_trainer names them step=N.ckpt, best-step=N-val_loss=X.ckpt
    and last.ckpt): latest = last.ckpt, else the highest step; best = the lowest val_loss in a name."""
    ckpts = sorted(root.glob("*.ckpt")) if root.is_dir() else []
    if not ckpts:
        return None
    if which == "best":
        scored = [(float(m.group(1)), c.name, c) for c in ckpts if (m := _PL_LOSS.search(c.name))]
        if not scored:
            raise CheckpointError(f"{root}: no Lightning checkpoint names a val_loss; use which='latest'")
        return min(scored)[2]
    if (root / "last.ckpt").is_file():
        return root / "last.ckpt"
    def order(c: Path) -> tuple[int, float]:
        m = _PL_STEP.search(c.name)
        return (int(m.group(1)) if m else -1, c.stat().st_mtime)

    return max(ckpts, key=order)


def find_checkpoint(path: str | Path, which: str = "latest") -> Path:
    """A committed step directory (holding meta.json and model.pt) from a step dir or a run dir, or a Lightning
    `.ckpt` file (given, or found in the run dir's checkpoints/)."""
    p = Path(path)
    if which not in ("latest", "best"):
        raise CheckpointError(f"which must be 'latest' or 'best', got {which!r}")
    if p.suffix == ".ckpt" and p.is_file():
        return p
    if (p / "meta.json").is_file() and (p / "model.pt").is_file():
        return p
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    steps = sorted((int(m.group(1)), d) for d in (root.iterdir() if root.is_dir() else ())
                   if (m := _STEP.match(d.name)) and (d / "meta.json").is_file() and (d / "model.pt").is_file())
    if not steps and (pl := _lightning_checkpoint(root, which)) is not None:
        return pl
    if not steps:
        raise CheckpointError(f"{p}: no checkpoint here; pass a run directory (the --out of `shardtrain train`, "
                              "holding checkpoints/step_NNNNNN/, or of a Lightning run holding checkpoints/*.ckpt), "
                              "one step_NNNNNN directory or one .ckpt file")
    if which == "latest":
        return steps[-1][1]
    scored = [(m["val_loss"], s, d) for s, d in steps
              if (m := json.loads((d / "meta.json").read_text())).get("val_loss") is not None]
    return _lowest_val_loss(scored, str(p))


def _lowest_val_loss(scored: list, where: str):
    """train.checkpoint.lowest_val_loss (a NaN val_loss is no score), with a warning naming the checkpoints left
    out for it, and CheckpointError when none is left."""
    nan = [str(c) for v, _, c in scored if math.isnan(float(v))]
    if nan:
        log.warning("which='best': left out %d checkpoint(s) whose val_loss is NaN: %s", len(nan), ", ".join(nan))
    best = run_checkpoints.lowest_val_loss(scored)
    if best is None:
        raise CheckpointError(f"{where}: no checkpoint has a (non-NaN) validation loss; use which='latest'")
    return best


def find_remote_checkpoint(url: str, which: str = "latest", storage_options: dict | None = None) -> str:
    """`find_checkpoint` for an object-store URL (a run's --out, its checkpoints/ or one step_NNNNNN): the URL of a
    committed step. Costs a listing per step folder (train.checkpoint.list_checkpoints) and, for `best`, a
    meta.json per step."""
    if which not in ("latest", "best"):
        raise CheckpointError(f"which must be 'latest' or 'best', got {which!r}")
    url = url.rstrip("/")
    names = storage.ls_names(url, storage_options)
    if "meta.json" in names and "model.pt" in names:
        return url
    root = storage.join(url, "checkpoints") if "checkpoints" in names else url
    steps = run_checkpoints.list_checkpoints(root, storage_options)
    if not steps:
        raise CheckpointError(f"{url}: no committed checkpoint here (no checkpoints/step_NNNNNN/meta.json); pass the "
                              "--out of `shardtrain train` or one of its step_NNNNNN folders")
    if which == "latest":
        return str(steps[-1][1])
    scored = [(m["val_loss"], s, str(d)) for s, d in steps
              if (m := run_checkpoints.read_meta(d, storage_options)).get("val_loss") is not None]
    return _lowest_val_loss(scored, url)


def _remote_parts(step: str, storage_options: dict | None) -> tuple[dict, Tokenizer, dict]:
    """(meta, tokenizer, model state_dict) of a committed step on an object store."""
    def load(url: str) -> dict:
        return torch.load(io.BytesIO(storage.read_bytes(url, storage_options)), map_location="cpu", weights_only=True)

    meta = run_checkpoints.read_meta(step, storage_options)  # type: ignore[arg-type]
    run = step.rstrip("/").rsplit("/", 2)[0]
    vocab = storage.join(run, "vocab.json")
    if isinstance(meta.get("tokenizer"), dict):  # the step's own (module docstring)
        tok = tokenizer_from_json(meta["tokenizer"])
    elif storage.exists(vocab, storage_options):
        tok = tokenizer_from_json(json.loads(storage.read_bytes(vocab, storage_options)))
    else:
        tok = tokenizer_from_json(load(storage.join(step, "train_state.pt"))["tokenizer"])
    return meta, tok, load(storage.join(step, "model.pt"))


def _tokenizer(step_dir: Path, meta: dict) -> Tokenizer:
    """The step's own tokenizer (meta.json's, module docstring), else RUN_DIR/vocab.json, else train_state.pt's."""
    if isinstance(meta.get("tokenizer"), dict):
        return tokenizer_from_json(meta["tokenizer"])
    vocab = step_dir.parent.parent / "vocab.json"
    if vocab.is_file():
        return tokenizer_from_json(json.loads(vocab.read_text()))
    main = torch.load(step_dir / "train_state.pt", map_location="cpu", weights_only=True)
    return tokenizer_from_json(main["tokenizer"])


def _lightning_parts(ckpt: Path) -> tuple[dict, Tokenizer, dict]:
    """(meta with step and config, tokenizer, model state_dict) of a CTCLightningModule checkpoint: its
    hyper_parameters hold the RunConfig and the tokenizer, its state_dict the model under `model.`."""
    d = torch.load(ckpt, map_location="cpu", weights_only=True)
    hp = d.get("hyper_parameters") if isinstance(d, dict) else None
    if not isinstance(hp, dict) or "config" not in hp or "tokenizer" not in hp:
        raise CheckpointError(f"{ckpt}: not a shardtrain Lightning checkpoint (no config/tokenizer in its "
                              "hyper_parameters; train with interop.lightning.CTCLightningModule)")
    state = {k[len("model."):]: v for k, v in d["state_dict"].items() if k.startswith("model.")}
    return {"step": int(d.get("global_step", 0)), "config": hp["config"]}, tokenizer_from_json(hp["tokenizer"]), state


@dataclass(slots=True)
class TrainedModel:
    """A model, its tokenizer and its config; `log_probs`/`transcribe` take raw padded waves."""

    model: torch.nn.Module
    tokenizer: Tokenizer
    config: RunConfig
    step: int
    path: Path | str
    """The step folder or .ckpt file; a URL string for a run on an object store."""
    device: torch.device
    _mel: dict = field(default_factory=dict, repr=False)

    @property
    def sample_rate_hz(self) -> int:
        return self.config.features.sample_rate_hz

    def features(self, waves: torch.Tensor, lengths: torch.Tensor,
                 rate_hz: int) -> tuple[torch.Tensor, torch.Tensor]:
        """waves [B, T] float32 at `rate_hz` -> (feats [B, F, n_mels], feat_lengths [B]) on the model's device,
        computed as validation computes them (resample, log-mel, normalisation; no augmentation)."""
        fc = self.config.features
        waves = waves.to(self.device, torch.float32)
        lengths = lengths.to(self.device, torch.long)
        waves, lengths = resample(waves, lengths, rate_hz, fc.sample_rate_hz)
        if self.device not in self._mel:
            self._mel[self.device] = fc.mel_module().to(self.device)
        feats, feat_lengths = log_mel(self._mel[self.device], waves, lengths, fc)
        return normalize(feats, feat_lengths, fc), feat_lengths

    @torch.inference_mode()
    def log_probs(self, waves: torch.Tensor, lengths: torch.Tensor,
                  rate_hz: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (log_probs [B, T', V] float32, out_lengths [B]); works for any `SpeechModel` (empty targets)."""
        feats, feat_lengths = self.features(waves, lengths, rate_hz)
        bsz = feats.shape[0]
        empty = torch.zeros(0, dtype=torch.long, device=self.device)
        _, outputs, out_lengths = self.model(feats, feat_lengths, empty, torch.zeros(bsz, dtype=torch.long,
                                                                                      device=self.device))
        return outputs, out_lengths

    def decode(self, log_probs: torch.Tensor, out_lengths: torch.Tensor) -> list[str]:
        model = cast(SpeechModel, self.model)
        return [self.tokenizer.decode(ids) for ids in model.decode(log_probs, out_lengths)]

    def transcribe(self, waves: torch.Tensor, lengths: torch.Tensor, rate_hz: int) -> list[str]:
        """Greedy CTC transcripts of a padded batch."""
        return self.decode(*self.log_probs(waves, lengths, rate_hz))


def resolve_device(device: str) -> torch.device:
    """"auto" = cuda when available, else cpu; anything else as torch spells it."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_trained(path: str | Path, *, device: str = "cpu", which: str = "latest",
                 qat: bool | None = None, storage_options: dict | None = None) -> TrainedModel:
    """Load a checkpoint (step dir) or a run dir's latest/best one, local or on an object store (`storage_options`
    for it). `qat`: None = as trained (`train.qat`), False = the float model (what ONNX export wants), True = force
    fake-quant layers. Cost: one torch.load (plus the GETs of a remote run)."""
    step_dir: Path | str
    if not storage.is_local(str(path)):
        step_dir = find_remote_checkpoint(str(path), which, storage_options)
        meta, tok, state = _remote_parts(step_dir, storage_options)
    elif (step_dir := find_checkpoint(path, which)).suffix == ".ckpt":
        meta, tok, state = _lightning_parts(step_dir)
    else:
        meta = json.loads((step_dir / "meta.json").read_text())
        if "config" not in meta:
            raise CheckpointError(f"{step_dir}/meta.json holds no config; it was not written by `shardtrain train`")
        tok = _tokenizer(step_dir, meta)
        state = torch.load(step_dir / "model.pt", map_location="cpu", weights_only=True)
    cfg: RunConfig = from_dict(RunConfig, meta["config"])
    dev = resolve_device(device)
    model = build_model(cfg.model, len(tok), cfg.features.n_mels)
    if cfg.train.qat if qat is None else qat:
        enable_qat(model)
    model.load_state_dict(state)
    model.to(dev).eval()
    log.info("loaded %s (step %s, %s encoder, vocabulary %d) on %s", step_dir, meta.get("step"),
             cfg.model.encoder, len(tok), dev)
    return TrainedModel(model=model, tokenizer=tok, config=cfg, step=int(meta.get("step", 0)), path=step_dir,
                        device=dev)
