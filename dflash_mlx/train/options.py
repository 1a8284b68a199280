"""Every setting of a drafter training run, checked, with the flag that sets it.

`TrainOptions` mirrors the `dflash-mlx train` flags one to one (field
`block_size` is `--block-size`), so errors name the flag. A few defaults
depend on the run: with `--init` the learning rate and warm-up default to
fine-tuning values (`FINETUNE_LR`, `FINETUNE_WARMUP`) and the block size to the
initial drafter's; `--max-length` defaults to the target's context capped at
`DEFAULT_MAX_LENGTH`. `resolved` fills them in. The options that shape the
training trajectory must not change between a run and its `--resume`;
`check_resumable` compares them with a checkpoint's.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

SAVE_DTYPES = ("float32", "bfloat16", "float16")
SCRATCH_LR, SCRATCH_WARMUP = 6e-4, 0.04  # the paper's recipe (spec section 7)
FINETUNE_LR, FINETUNE_WARMUP = 2e-4, 0.1  # with --init: a smaller step, a longer warm-up
DEFAULT_BLOCK_SIZE, DEFAULT_DRAFT_LAYERS, DEFAULT_MAX_LENGTH = 16, 5, 2048
TARGET_DTYPES = ("float32", "bfloat16", "float16")
ARCHES = ("dflash", "dspark", "mtp")  # what `--arch` trains: a drafter of those kinds, or the target's own MTP heads

# Options that determine which batches, targets and updates a run makes.
TRAJECTORY_OPTIONS = (
    "model",
    "steps",
    "block_size",
    "draft_layers",
    "max_tokens",
    "max_length",
    "lr",
    "warmup",
    "weight_decay",
    "grad_clip",
    "loss_decay",
    "batch_size",
    "anchors_per_seq",
    "seed",
    "holdout",
    "target_layers",
    "mask_token_id",
    "intermediate_size",
    "gen_temperature",
    "chat_template_kwargs",
    "target_dtype",
    "init",
    "replay",
    "replay_ratio",
    "loss_chunk_rows",
    "arch",
    "markov_rank",
)


class OptionError(ValueError):
    """A training option has a bad value (the message names the flag)."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class TrainOptions:
    model: str  # target: local mlx-lm directory or Hugging Face repo id
    data: str  # JSONL prompts
    out: str  # output drafter directory
    steps: int = 1000
    block_size: int | None = None  # None: the --init drafter's, else DEFAULT_BLOCK_SIZE
    draft_layers: int | None = None  # None: DEFAULT_DRAFT_LAYERS (refused with --init)
    max_tokens: int = 256  # response length when the target regenerates answers
    max_length: int | None = None  # prompt + response tokens per sequence; None: min(context, 2048)
    lr: float | None = None  # None: SCRATCH_LR, or FINETUNE_LR with --init
    warmup: float | None = None  # fraction of the steps; None: SCRATCH_WARMUP / FINETUNE_WARMUP
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    loss_decay: float | None = None  # c of w_k = exp(-(k-1)/c); None: by block size
    batch_size: int = 8
    anchors_per_seq: int = 32
    save_every: int = 200
    keep_checkpoints: int = 2
    seed: int = 0
    holdout: int = 16
    val_max_tokens: int | None = None  # None: max_tokens
    target_layers: list[int] | None = None  # None: derived from draft_layers
    mask_token_id: int | None = None  # None: the tokenizer's mask token
    intermediate_size: int | None = None  # None: the target's
    gen_batch_size: int = 32
    gen_temperature: float = 0.0
    chat_template_kwargs: dict[str, Any] | None = None
    work_dir: str | None = None  # None: <out>/work
    responses: str | None = None  # None: <work_dir>/responses.jsonl
    cache_features: bool = False
    save_dtype: str = "float32"
    target_dtype: str | None = None  # None: the loader's rule (float32 on a CPU, as stored on Metal)
    resume: bool = False
    stop_at: int | None = None  # stop (with a checkpoint) at this step; resume later
    init: str | None = None  # a published v1 drafter (directory or Hub repo id) to start from
    replay: str | None = None  # JSONL prompts of the original domain mixed into every batch
    replay_ratio: float = 0.25  # fraction of each batch taken from --replay
    loss_chunk_rows: int | None = None  # block rows per logits chunk; None: by vocabulary size
    feature_chunk: int = 512  # target tokens per forward when computing features
    anchor_chunk: int | None = None  # anchors per sequence in one forward/backward; None: by memory
    max_memory_gb: float | None = None  # smaller chunks, and a stop after step 1 if MLX's peak exceeds it
    arch: str | None = None  # ARCHES; None: the --init drafter's, else "dflash"
    markov_rank: int | None = None  # dspark: the Markov head's rank (None: 256, DeepSpec's)

    def resolved(
        self, *, init_block_size: int | None = None, target_context: int | None = None, init_arch: str | None = None
    ) -> "TrainOptions":
        """A copy with the run-dependent defaults filled in (see the module docstring)."""
        finetune = self.init is not None
        max_length = self.max_length
        if max_length is None:
            max_length = min(DEFAULT_MAX_LENGTH, target_context or DEFAULT_MAX_LENGTH)
        return replace(
            self,
            block_size=self.block_size or init_block_size or DEFAULT_BLOCK_SIZE,
            draft_layers=self.draft_layers or (None if finetune else DEFAULT_DRAFT_LAYERS),
            max_length=max_length,
            lr=self.lr if self.lr is not None else (FINETUNE_LR if finetune else SCRATCH_LR),
            warmup=self.warmup if self.warmup is not None else (FINETUNE_WARMUP if finetune else SCRATCH_WARMUP),
            arch=self.arch or init_arch or ARCHES[0],
        )

    def check(self) -> None:
        """Raise OptionError for the first bad value."""
        if self.arch is not None and self.arch not in ARCHES:
            raise OptionError(f"--arch must be one of {', '.join(ARCHES)}, got {self.arch!r}.")
        positive = (
            "steps",
            "block_size",
            "draft_layers",
            "max_tokens",
            "max_length",
            "batch_size",
            "anchors_per_seq",
            "save_every",
            "gen_batch_size",
            "loss_chunk_rows",
            "feature_chunk",
            "anchor_chunk",
        )
        optional = ("block_size", "draft_layers", "max_length", "loss_chunk_rows", "anchor_chunk")
        for name in positive:
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise OptionError(f"{flag(name)} must be an integer >= 1, got {value!r}.")
        if self.block_size is not None and self.block_size < 2:
            raise OptionError(f"--block-size must be >= 2 (the anchor plus drafted rows), got {self.block_size}.")
        if self.init is not None:
            given = [
                n
                for n in ("draft_layers", "target_layers", "mask_token_id", "intermediate_size")
                if getattr(self, n) is not None
            ]
            if given:
                raise OptionError(
                    f"{flag(given[0])} cannot be combined with --init: the drafter's layers, target "
                    "layer ids, mask token and widths come from the --init checkpoint's config.json."
                )
        self._check_arch()
        if self.replay is not None and isinstance(self.batch_size, int) and self.batch_size < 2:
            raise OptionError("--replay needs --batch-size >= 2 (each batch holds new and replayed sequences).")
        if self.max_memory_gb is not None and not (self.max_memory_gb > 0 and math.isfinite(self.max_memory_gb)):
            raise OptionError(f"--max-memory-gb must be a positive number, got {self.max_memory_gb!r}.")
        if not 0 < self.replay_ratio < 1:
            raise OptionError(f"--replay-ratio is a fraction of each batch in (0, 1), got {self.replay_ratio!r}.")
        for name in ("holdout", "keep_checkpoints", "seed"):
            if getattr(self, name) < 0:
                raise OptionError(f"{flag(name)} must be >= 0, got {getattr(self, name)}.")
        if self.lr is not None and not (self.lr > 0 and math.isfinite(self.lr)):
            raise OptionError(f"--lr must be a positive number, got {self.lr!r}.")
        if self.warmup is not None and not 0 <= self.warmup < 1:
            raise OptionError(f"--warmup is a fraction of the steps in [0, 1), got {self.warmup!r}.")
        if self.weight_decay < 0 or self.grad_clip <= 0 or self.gen_temperature < 0:
            name = (
                "weight_decay" if self.weight_decay < 0 else ("grad_clip" if self.grad_clip <= 0 else "gen_temperature")
            )
            raise OptionError(f"{flag(name)} has a bad value {getattr(self, name)!r}.")
        if self.loss_decay is not None and not self.loss_decay > 0:
            raise OptionError(f"--loss-decay must be > 0, got {self.loss_decay!r}.")
        if self.val_max_tokens is not None and self.val_max_tokens < 1:
            raise OptionError(f"--val-max-tokens must be >= 1, got {self.val_max_tokens}.")
        if self.stop_at is not None and not 1 <= self.stop_at:
            raise OptionError(f"--stop-at must be >= 1, got {self.stop_at}.")
        if self.save_dtype not in SAVE_DTYPES:
            raise OptionError(f"--save-dtype must be one of {', '.join(SAVE_DTYPES)}, got {self.save_dtype!r}.")
        if self.target_dtype is not None and self.target_dtype not in TARGET_DTYPES:
            raise OptionError(f"--target-dtype must be one of {', '.join(TARGET_DTYPES)}, got {self.target_dtype!r}.")
        layers = self.target_layers
        if layers is not None and (
            not layers or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers)
        ):
            raise OptionError(f"--target-layers must be layer indices >= 0, got {self.target_layers!r}.")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise OptionError(f"--mask-token-id must be >= 0, got {self.mask_token_id}.")
        if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs, dict):
            raise OptionError("--chat-template-kwargs must be a JSON object.")

    def _check_arch(self) -> None:
        if self.arch is not None and self.arch not in ARCHES:
            raise OptionError(f"--arch must be one of {', '.join(ARCHES)}, got {self.arch!r}.")
        if self.markov_rank is not None:
            if isinstance(self.markov_rank, bool) or not isinstance(self.markov_rank, int) or self.markov_rank < 0:
                raise OptionError(f"--markov-rank must be an integer >= 0, got {self.markov_rank!r}.")
            if self.arch != "dspark":
                raise OptionError(
                    f"--markov-rank sets a new DSpark drafter's Markov head: it needs --arch dspark, "
                    f"not --arch {self.arch or 'dflash'}."
                )
            if self.init is not None:
                raise OptionError("--markov-rank sets a new DSpark drafter's Markov head: --init brings its own.")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_resumable(saved: dict[str, Any], current: TrainOptions, checkpoint: str) -> None:
    """Refuse to resume with options that change the trajectory of the run."""
    known = {f.name for f in fields(TrainOptions)}
    for name in TRAJECTORY_OPTIONS:
        if name not in known or name not in saved:
            continue
        before, now = saved[name], getattr(current, name)
        if before != now:
            raise OptionError(
                f"{flag(name)} is {now!r} but the checkpoint {checkpoint} was trained with "
                f"{before!r}: pass the same value to --resume (or start a new run in a new --out)."
            )
