"""What to load, from what a user typed (`--model`, `--draft`, `--block-size`, or `load()`'s arguments).

`choose_model` turns a registry name, a target repo id or a local directory
into a `ModelChoice` (what to load, which drafter, the registry entry), with
errors that say what to do: close registry names for a typo, `--draft` (or
``draft=``) for a target the registry does not know, a missing config.json.
`models.loading` loads a choice (and refuses a target DFlash cannot run).
`choose_block_size` applies the one precedence: an explicit block size (fixed)
> registry default > drafter config (the adaptive policy's largest block),
capping only defaults at 5 for targets or drafters of 4 bits or fewer.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from .block_size import capped_block_size, widest_block
from ..mtp.scan import has_mtp_weights
from .registry import RegistryEntry, is_repo_id, lookup, registry_entries

DEFAULT_MODEL = "demo"
MTP = "mtp"  # `--draft mtp` / `draft="mtp"`: the target's own multi-token-prediction heads
# ModelChoice.mtp: whether the target's MTP heads are loaded (`models.loading`)
MTP_REQUIRED = "required"  # asked for, or found with no drafter registered: a checkpoint without them is an error
MTP_ALSO = "also"  # beside the registered drafter, where the checkpoint has them (chosen per generation)


class ModelChoiceError(ValueError):
    """The model / drafter the user asked for cannot be used (the message says why and what to do)."""


@dataclass
class ModelChoice:
    target: str  # a local directory or a Hugging Face repo id
    draft: str | None  # None: plain decoding
    entry: RegistryEntry | None
    label: str  # how messages name it
    is_default: bool = False
    mtp: str | None = None  # MTP_REQUIRED, MTP_ALSO or None (no MTP heads)


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


def choose_model(
    model: str | None, draft: str | None = None, *, use_draft: bool = True, api: bool = False
) -> ModelChoice:
    """What to load for a target (registry name, repo id, local directory; None: the bundled default).

    Errors name what to change: command-line flags (``--model``, ``--draft``,
    ``--no-dflash``), or with `api=True` the Python arguments (``draft=``).
    """
    is_default = model is None
    if model is None:
        if not default_available():
            raise ModelChoiceError(
                "No --model given and the bundled demo pair is not installed: pass --model NAME "
                "(see `dflash-mlx models`), a Hugging Face repo id or a local mlx-lm directory."
            )
        model = DEFAULT_MODEL
    model = str(model)
    where = model if api else f"--model {model}"
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelChoiceError(f"{where}: {path} is a file, not a model directory.")
        if not (path / "config.json").is_file():
            raise ModelChoiceError(f"{where}: {path} has no config.json, so it is not an mlx-lm model directory.")
        target, entry = str(path), entry_for_target(path)
    elif (entry := lookup(model)) is not None:
        target = entry.target_path() if entry.bundled else (model if "/" in model else entry.target)
    elif is_repo_id(model):
        target = model  # a repo id the registry does not know
    elif model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ModelChoiceError(f"{where}: no such directory {path} (and not a Hugging Face repo id 'owner/name').")
    else:
        names = [e.name for e in registry_entries()]
        close = difflib.get_close_matches(model.lower(), names, n=3, cutoff=0.5)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ModelChoiceError(
            f"{where}: not a registry name, a local directory or a Hugging Face repo id "
            f"('owner/name').{hint} `dflash-mlx models` lists the registry."
        )
    label = entry.name if entry else model
    if not use_draft:
        return ModelChoice(target, None, entry, model, is_default)
    if draft is not None and str(draft).lower() == MTP:
        return ModelChoice(target, None, entry, label, is_default, mtp=MTP_REQUIRED)
    if draft is None and entry is None:
        if has_mtp_weights(target):  # the target drafts with its own heads
            return ModelChoice(target, None, None, label, is_default, mtp=MTP_REQUIRED)
        todo = (
            'pass draft=<path or repo id of a DFlash drafter> (or draft="mtp" for a checkpoint that keeps its '
            "MTP weights)"
            if api
            else "Pass --draft PATH_OR_REPO (a DFlash drafter for it; --draft mtp for a checkpoint that keeps its "
            "MTP weights), or --no-dflash for plain decoding"
        )
        raise ModelChoiceError(
            f"{where}: no drafter is registered for this target in models.toml (a local directory is matched "
            f"by its name, e.g. Qwen3-4B-4bit) and no MTP weights were found in its checkpoint. {todo}."
        )
    if draft is None:
        return ModelChoice(target, entry.draft_path(), entry, label, is_default, mtp=MTP_ALSO)
    return ModelChoice(target, str(draft), entry, label, is_default)


@dataclass(frozen=True)
class BlockChoice:
    """A run's block: adaptive up to `size`, or fixed at `size` (None: no drafter, plain decoding)."""

    size: int | None
    adaptive: bool = False

    @property
    def label(self) -> str:
        if self.size is None:
            return "plain decoding"
        return f"adaptive block (at most {self.size})" if self.adaptive else f"block {self.size}"

    @property
    def flag(self) -> str | int | None:
        """As reports give it: "auto", the fixed block, or None."""
        return "auto" if self.adaptive and self.size is not None else self.size

    def generation_kwargs(self) -> dict:
        """`stream_generate`'s block arguments."""
        if self.adaptive:
            return {"block_size": None, "max_block_size": self.size}
        return {"block_size": self.size}


def parse_block_flag(flag: int | str | None, name: str = "--block-size") -> int | None:
    """ "auto" or None -> None (adaptive); an integer >= 1 (or its text) -> that integer."""
    if flag is None or (isinstance(flag, str) and flag.strip().lower() == "auto"):
        return None
    try:
        value = int(flag)
    except (TypeError, ValueError):
        value = None
    if value is None or value < 1 or isinstance(flag, bool):
        raise ModelChoiceError(f"{name}: expected 'auto' or an integer >= 1, got {flag!r}.")
    return value


def choose_block_size(flag: int | str | None, entry: RegistryEntry | None, model, drafter) -> BlockChoice:
    """A run's block: a fixed flag as is; else adaptive up to the registry's or the drafter's block,
    capped when low-bit."""
    if drafter is None:
        return BlockChoice(None)
    fixed = parse_block_flag(flag)
    widest = widest_block(drafter)
    if fixed is not None:
        if fixed > widest:
            raise ModelChoiceError(
                f"--block-size: at most {widest}, the drafter's block (it drafts at most "
                f"{widest - 1} tokens per cycle), got {fixed}."
            )
        return BlockChoice(fixed)
    largest = min(entry.block_size, widest) if entry is not None else widest
    return BlockChoice(capped_block_size(largest, model, drafter), adaptive=True)
