"""From what a user typed (`--model`, `--draft`, `--block-size`) to loaded models.

`choose_model` turns a registry name, a target repo id or a local directory
into a `ModelChoice` (what to load, which drafter, the registry entry), with
errors that say what to do: close registry names for a typo, `--draft` for a
target the registry does not know, a missing config.json, a family this
version cannot run. `load_choice` loads it (huggingface_hub shows download
progress) and, on MLX's CPU backend, computes in float32 (bfloat16 matmuls
have no fast CPU path). `choose_block_size` applies the precedence
`--block-size` > registry default > drafter config, capping only defaults at
5 for targets or drafters of 4 bits or fewer.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx import nn

from .block_size import capped_block_size
from .families import FAMILIES
from .registry import RegistryEntry, lookup, registry_entries

DEFAULT_MODEL = "demo"


class ModelChoiceError(ValueError):
    """The model / drafter the user asked for cannot be used (the message says why and what to do)."""


@dataclass
class ModelChoice:
    target: str  # a local directory or a Hugging Face repo id
    draft: str | None  # None: plain decoding
    entry: RegistryEntry | None
    label: str  # how messages name it
    is_default: bool = False


def supported(entry: RegistryEntry) -> bool:
    """Whether this version can run the entry's target family (unknown family: assume yes)."""
    return entry.family is None or entry.family in FAMILIES


def entry_for_directory(path: Path) -> RegistryEntry | None:
    """The registry entry a local model directory is a copy of, judged by its name.

    `~/models/Qwen3-4B-4bit` matches `mlx-community/Qwen3-4B-4bit`; a name that
    matches no alias (or several entries) gives None.
    """
    name = path.absolute().name.lower()
    matches = {
        e.name for e in registry_entries() if not e.bundled and any(a.split("/")[-1].lower() == name for a in e.aliases)
    }
    return lookup(matches.pop()) if len(matches) == 1 else None


def entry_for_target(target: str | Path) -> RegistryEntry | None:
    """The registry entry for what a user passed as a target, or None.

    A registry name or repo id matches its entry; a local directory matches the
    bundled pair whose packaged directory it is, else an entry by its name
    (`entry_for_directory`).
    """
    path = Path(target).expanduser()
    if not path.exists():
        return lookup(str(target))
    for entry in registry_entries():
        if entry.bundled and Path(entry.target_path()).resolve() == path.resolve():
            return entry
    return entry_for_directory(path) if path.is_dir() else None


def default_available() -> bool:
    entry = lookup(DEFAULT_MODEL)
    return entry is not None and (Path(entry.target_path()) / "config.json").exists()


def choose_model(model: str | None, draft: str | None = None, *, use_draft: bool = True) -> ModelChoice:
    is_default = model is None
    if model is None:
        if not default_available():
            raise ModelChoiceError(
                "No --model given and the bundled demo pair is not installed: pass --model NAME "
                "(see `dflash-mlx models`), a Hugging Face repo id or a local mlx-lm directory."
            )
        model = DEFAULT_MODEL
    path = Path(model).expanduser()
    entry = None if path.exists() else lookup(model)
    if path.exists():
        if not path.is_dir():
            raise ModelChoiceError(f"--model {model}: {path} is a file, not a model directory.")
        if not (path / "config.json").is_file():
            raise ModelChoiceError(
                f"--model {model}: {path} has no config.json, so it is not an mlx-lm model directory."
            )
        target = str(path)
        entry = entry_for_directory(path)
    elif entry is not None:
        if not supported(entry):
            families = ", ".join(sorted(FAMILIES))
            raise ModelChoiceError(
                f"--model {model}: the registry lists {entry.name} (family {entry.family}), but this "
                f"version of dflash-mlx cannot run that family yet (supported: {families})."
            )
        target = entry.target_path() if entry.bundled else (model if "/" in model else entry.target)
    elif "/" in model and model.count("/") == 1 and not model.startswith((".", "/", "~")):
        target = model  # a repo id the registry does not know
    else:
        names = [e.name for e in registry_entries()]
        close = difflib.get_close_matches(model.lower(), names, n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ModelChoiceError(
            f"--model {model}: not a registry name, a local directory or a Hugging Face repo id "
            f"('owner/name').{hint} `dflash-mlx models` lists the registry."
        )
    if not use_draft:
        return ModelChoice(target, None, entry, model, is_default)
    if draft is None:
        if entry is None:
            raise ModelChoiceError(
                f"--model {model}: no drafter is registered for this target in models.toml (a local "
                "directory is matched by its name, e.g. Qwen3-4B-4bit). Pass "
                "--draft PATH_OR_REPO (a DFlash drafter for it), or --no-dflash for plain decoding."
            )
        draft = entry.draft_path()
    return ModelChoice(target, draft, entry, entry.name if entry else model, is_default)


def on_cpu() -> bool:
    return not mx.metal.is_available()


def as_float32(module: nn.Module | None) -> None:
    """Cast floating-point parameters to float32 (quantized weights stay as they are).

    The cast is evaluated at once: a lazy cast would belong to this thread's
    stream, and MLX streams are per thread, so a model loaded here and used from
    another thread (a server's worker, a GUI) would fail.
    """
    if module is not None:
        module.set_dtype(mx.float32)
        mx.eval(module.parameters())


def load_choice(choice: ModelChoice, *, draft_bits: int | None = None):
    """(model, tokenizer, drafter or None), in float32 on the CPU backend."""
    from mlx_lm import load as mlx_lm_load

    from .draft.load import load_draft
    from .loading import target_float_dtype

    model, tokenizer = mlx_lm_load(choice.target)[:2]
    if on_cpu():
        as_float32(model)
    drafter = None
    if choice.draft is not None:
        drafter = load_draft(
            choice.draft, model, bits=draft_bits, dtype=target_float_dtype(model), target_name=choice.label
        )
    return model, tokenizer, drafter


def choose_block_size(flag: int | None, entry: RegistryEntry | None, model, drafter) -> int | None:
    """Block size for a run: the flag as is; else the registry's or the drafter's, capped when low-bit."""
    if drafter is None:
        return None
    if flag is not None:
        if flag < 1:
            raise ModelChoiceError(f"--block-size: expected an integer >= 1, got {flag}.")
        return flag
    return capped_block_size(entry.block_size if entry is not None else drafter.config.block_size, model, drafter)
