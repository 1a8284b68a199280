"""Training DFlash drafters in MLX (spec section 7), for any target mlx-lm loads.

- `train_drafter(TrainOptions(...))`: a whole run (regenerated responses,
  training, checkpoints, export, validation); `dflash_mlx.train.command.train`
  is the same as a Typer command.
- Building blocks: `batches` (stratified anchors, packed blocks, replay
  mixing), `masks` (block-diagonal visibility), `model_forward` (the drafter's
  training forward), `loss` (weighted block cross-entropy), `chunked_loss`
  (the same loss in chunks of rows, memory flat in vocabulary x rows), `step`
  (one optimisation step, the optimizer), `features` (frozen target features,
  computed in chunks of tokens), `data` / `regenerate` (prompts, target
  responses), `new_drafter` (config of a fresh drafter), `init_drafter`
  (`--init`: a published drafter to fine-tune), `checkpoint`, `validate`
  (mean acceptance length).

Nothing heavy is imported until used.
"""

from __future__ import annotations

__all__ = ["TrainOptions", "train_drafter"]


def __getattr__(name):
    if name == "TrainOptions":
        from .options import TrainOptions

        return TrainOptions
    if name == "train_drafter":
        from .trainer import train_drafter

        return train_drafter
    raise AttributeError(name)
