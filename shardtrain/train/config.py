"""TrainConfig and RunConfig: what a training run is, as frozen dataclasses (no YAML, no registry).

RunConfig composes the configs of the stages it drives (StreamConfig, AugmentConfig, FeatureConfig, ModelConfig)
with TrainConfig; presets in pipelines/ return one, `--set section.field=value` edits it (overrides.py), and
the resolved config is written to DIR/config.json and into every checkpoint's meta.json.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field


from shardtrain.train.augment import AugmentConfig
from shardtrain.train.budget import BudgetConfig
from shardtrain.train.features import FeatureConfig
from shardtrain.train.model import ModelConfig
from shardtrain.train.normalize import TextNormConfig
from shardtrain.train.valsets import val_sets
from shardtrain.load.config import StreamConfig

log = logging.getLogger(__name__)
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    data_url: str = ""
    """Training dataset URL (path, file://, s3://); `--data`."""
    mix_urls: tuple[str, ...] = ()
    """More training datasets, mixed with data_url (repeated `--data`; load/mixplan.py)."""
    mix_weights: tuple[float, ...] = ()
    """Weights of data_url and mix_urls in order (`--weight`, once per `--data`); empty = equal weights. Per epoch
    dataset i contributes weight_i / sum(weights) of the audio; every sample once before any repeats."""
    val_data_url: str = ""
    """Validation dataset URL (the first `--val-data`); empty disables validation."""
    val_extra_urls: tuple[str, ...] = ()
    """More validation datasets (repeated `--val-data`); each is evaluated and reported on its own (valsets.py)."""
    val_names: tuple[str, ...] = ()
    """Names of val_data_url and val_extra_urls in order (`--val-data NAME=URL`); empty, or "" for one, derives
    it from the URL's last path component (made unique). Metric keys are val/<name>/{loss,cer,wer,...}."""
    out_dir: str = ""
    """Run directory: config.json, metrics.jsonl, tensorboard/, checkpoints/; `--out`."""
    max_steps: int = 1000
    """Optimiser steps to train for; `--max-steps`."""
    seed: int = 0
    """Seeds model init, loader plan, dropout and augmentation."""
    device: str = "auto"
    """"auto" (cuda:LOCAL_RANK when available, else cpu), "cpu" or "cuda"."""
    lr: float = 1e-3
    """Peak learning rate (after warm-up)."""
    min_lr_ratio: float = 0.05
    """Cosine decay ends at lr x min_lr_ratio at max_steps."""
    warmup_steps: int = 100
    """Linear warm-up from 0 to lr."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay on matrices (not on biases and norms)."""
    betas: tuple[float, float] = (0.9, 0.98)
    """AdamW betas."""
    grad_clip_norm: float = 5.0
    """Clip the global gradient norm to this; 0 disables."""
    grad_accum_steps: int = 1
    """Micro-batches per optimiser step (each is one loader batch per rank)."""
    precision: str = "fp32"
    """"fp32", "bf16" (autocast) or "fp16" (autocast + grad scaler)."""
    augment: bool = True
    """Apply the augmentation chain in training (features are always computed); False = features only."""
    tokenizer: str = "char"
    """"char" (vocabulary built from the training index) or "sentencepiece" (needs the package)."""
    sentencepiece_model: str = ""
    """Path of a trained SentencePiece model when tokenizer="sentencepiece"."""
    log_every_steps: int = 10
    """Training metrics line every N steps (one small all-reduce)."""
    val_every_steps: int = 200
    """Validate every N steps and at the end; 0 = only at the end."""
    val_max_batches: int | None = None
    """Cap validation batches per rank and validation set; None = every set whole."""
    val_examples: int = 3
    """Example transcripts (reference / hypothesis) logged per validation set at each validation."""
    ckpt_every_steps: int = 200
    """Checkpoint every N steps and at the end; 0 = only at the end."""
    keep_last: int = 3
    """Checkpoints kept besides the best by validation loss."""
    preempt_signals: str = "SIGTERM,SIGUSR1"
    """Signals that stop the run at the next step on every rank with a checkpoint, then exit 75 (train/preempt.py;
    SIGINT always does the same once). "" = off: the signals keep their default action (the process dies)."""
    lease_ttl_s: float = 300.0
    """The run folder's lease (--out/_train.lease) expires this long after its last renewal (every ttl/3 while
    training): a job killed without a chance to release it blocks a requeued one for at most this long."""
    tensorboard: bool = True
    """Also write TensorBoard events under out_dir/tensorboard."""
    progress: bool = True
    """tqdm progress bar on rank 0 (only when stderr is a terminal)."""
    elastic_batch: str = "accumulate"
    """How a resume on another world size answers the changed global batch (train/elastic.py): "accumulate" keeps
    world size x grad_accum_steps near the checkpoint's and scales lr by what remains, "scale_lr" scales lr
    linearly with the global batch, "none" changes neither."""
    ledger: bool = True
    """Record the index rows each rank trains on, written with every checkpoint to out_dir/ledger/ (~5 MB per
    million utterances; `shardtrain ledger RUN` reports what the run consumed; train/ledger.py)."""
    log_keys: bool = False
    """Write the utterance keys of every micro-batch to out_dir/keys/rank{R}.jsonl (audit; train/keylog.py)."""
    qat: bool = False
    """Quantization-aware training: every nn.Linear fake-quantizes its input (uint8) and weight (int8) the way
    ONNX Runtime's dynamic int8 quantization will (see train/qat.py); `shardtrain export --quantize int8`."""
    cpu_threads: int = 0
    """torch intra-op threads when training on the CPU; 0 keeps torch's default. On a busy machine (or beside the
    loader's decode threads) 1 can be several times faster for small models: OpenMP threads spin-wait on each
    other when a core is taken (measured: 8.5 s vs 54 s for 30 tiny steps on 2 loaded cores)."""
    max_nonfinite_steps: int = 5
    """Stop the run (one line, exit 1) after this many optimiser steps in a row skipped for a NaN/Inf loss or
    gradient (train/guards.py); a single one is skipped and counted. fp16's GradScaler backoff (an overflowing
    gradient with a finite loss) is counted apart and never stops a run."""
    max_impossible_share: float = 0.5
    """Stop the run when more than this share of the utterances of the last `guards.WINDOW_STEPS` steps had
    targets CTC cannot align (more labels, counting repeats, than output frames); below it they are skipped and
    counted (train/guards.py). 1.0 never stops."""

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ValueError("train.max_steps (--max-steps) must be >= 1")
        if self.grad_accum_steps < 1:
            raise ValueError("train.grad_accum_steps must be >= 1")
        if self.precision not in PRECISIONS:
            raise ValueError(f"train.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.tokenizer not in ("char", "sentencepiece"):
            raise ValueError("train.tokenizer must be 'char' or 'sentencepiece'")
        if self.tokenizer == "sentencepiece" and not self.sentencepiece_model:
            raise ValueError("train.tokenizer=sentencepiece needs train.sentencepiece_model=PATH")
        if self.lr <= 0 or self.warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("train.lr must be > 0, train.warmup_steps >= 0, train.min_lr_ratio in [0, 1]")
        if self.mix_weights and len(self.mix_weights) != 1 + len(self.mix_urls):
            raise ValueError(f"{len(self.mix_weights)} --weight values for {1 + len(self.mix_urls)} --data datasets; "
                             "give one --weight per --data, or none for equal weights")
        if any(not w > 0 for w in self.mix_weights):
            raise ValueError(f"--weight values must be > 0, got {list(self.mix_weights)}")
        if self.elastic_batch not in ("accumulate", "scale_lr", "none"):
            raise ValueError(f"train.elastic_batch must be 'accumulate', 'scale_lr' or 'none', got {self.elastic_batch!r}")
        if self.cpu_threads < 0:
            raise ValueError("train.cpu_threads must be >= 0 (0 = torch default)")
        if self.max_nonfinite_steps < 1 or not 0.0 < self.max_impossible_share <= 1.0:
            raise ValueError("train.max_nonfinite_steps must be >= 1 and train.max_impossible_share in (0, 1]")
        if self.lease_ttl_s < 10:
            raise ValueError(f"train.lease_ttl_s must be >= 10 (seconds), got {self.lease_ttl_s}")
        if self.log_every_steps < 1 or self.keep_last < 0:
            raise ValueError("train.log_every_steps must be >= 1 and train.keep_last >= 0")
        val_sets(self)  # names unique and well-formed, no URL twice: refused here, not at the first validation


def data_sources(tc: TrainConfig) -> str | list[tuple[str, float]]:
    """What build_loader takes: the one URL, or [(url, weight), ...] for a mixture."""
    if not tc.mix_urls and not tc.mix_weights:
        return tc.data_url
    urls = (tc.data_url, *tc.mix_urls)
    return list(zip(urls, tc.mix_weights or (1.0,) * len(urls)))


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """Everything a run needs; presets in pipelines/<name>.py return one, `--set a.b=v` edits any leaf."""

    stream: StreamConfig = field(default_factory=StreamConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    features: FeatureConfig = field(default_factory=FeatureConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    text: TextNormConfig = field(default_factory=TextNormConfig)
    """Transcript normaliser for targets, validation and scoring (train/normalize.py); the default is whitespace
    only (what a stored config without this section meant), the shipped pipelines use normalize.SPEECH."""
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    """Per-bucket batch budgets (`--batch-budget`), their closed loop, and OOM splitting (train/budget.py)."""
