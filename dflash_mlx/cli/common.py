"""What the terminal commands share: the console, loading with clear errors, options.

Errors the user can fix (a bad model name, a missing file, a reasoning level
the template cannot take) are printed as one red line and exit with status 2;
nothing else is caught.

``--shard tensor`` (commands started on every rank by ``mlx.launch``): the
target is tensor-sharded over the ranks (`dflash_mlx.sharding`); every rank
runs the command in lockstep, rank 0 alone prints (the others' stdout goes
to /dev/null, their messages are quiet), so an error is one line from rank 0
while every rank exits with its status.
"""

from __future__ import annotations

import os
import sys
import warnings
from contextlib import contextmanager
from typing import Annotated

import typer
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START
from rich.console import Console

from ..models.chat_template import ReasoningError
from ..draft.config import DraftConfigError
from ..draft.dspark import DSparkDraftModel
from ..draft.load import DraftWeightsError
from ..draft.pairing import PairMismatchError
from ..mtp.scan import MTPWeightsError
from ..models.registry import RegistryError
from ..models.loading import load_choice
from ..models.resolve import ModelChoice, ModelChoiceError, choose_model
from ..sharding.group import ShardError, barrier, raised_everywhere
from ..targets.adapter import UnsupportedTargetError

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

USER_ERRORS = (
    ModelChoiceError,
    ReasoningError,
    DraftConfigError,
    DraftWeightsError,
    PairMismatchError,
    MTPWeightsError,
    RegistryError,
    UnsupportedTargetError,
    FileNotFoundError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    ShardError,
)

ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="Registry name, Hugging Face repo id or local mlx-lm directory (default: the bundled demo pair).",
    ),
]
DraftOpt = Annotated[
    str | None,
    typer.Option(
        "--draft",
        help="DFlash drafter (directory or repo id), or mtp: the target's own multi-token-prediction heads; "
        "overrides the registry.",
    ),
]
BlockOpt = Annotated[
    str | None,
    typer.Option(
        "--block-size",
        "-b",
        metavar="auto|N",
        help="Tokens per draft/verify cycle, anchor included: "
        "auto (default) chooses per cycle, up to the registry's or the drafter's block (at most 5 for "
        "<=4-bit models), plain decoding included; N fixes it.",
    ),
]
TemperatureOpt = Annotated[float, typer.Option("--temperature", "--temp", min=0.0, help="0: greedy.")]
TopPOpt = Annotated[float, typer.Option("--top-p", min=0.0, max=1.0)]
TopKOpt = Annotated[int, typer.Option("--top-k", min=0)]
SystemOpt = Annotated[str | None, typer.Option("--system", help="System prompt.")]
SeedOpt = Annotated[int | None, typer.Option("--seed", min=0, max=2**64 - 1, help="Seed for sampled runs.")]
ReasoningOpt = Annotated[
    str | None,
    typer.Option(
        "--reasoning",
        help="on|off|low|medium|high|xhigh, mapped onto the chat template's "
        "enable_thinking, reasoning_effort or reasoning_strength.",
    ),
]


LookupOpt = Annotated[
    str,
    typer.Option(
        "--lookup",
        metavar="on|off",
        help="Copy-aware drafting: a cycle may verify the tokens that "
        "followed the sequence's end where it occurred earlier in the prompt or reply (on by default).",
    ),
]


SuffixTokensOpt = Annotated[
    int,
    typer.Option(
        "--suffix-cache-tokens",
        min=0,
        help="Suffix drafting: tokens of what was generated kept (per suffix index; least recently used go first) "
        "so that what is generated again is drafted from it (0: none).",
    ),
]


def lookup_flag(value: str) -> bool:
    """--lookup's value as a bool (a usage error otherwise)."""
    if value not in ("on", "off"):
        fail(f"--lookup: expected on or off, got {value!r}.")
    return value == "on"


KVBitsOpt = Annotated[
    int | None,
    typer.Option(
        "--kv-bits",
        help="Quantize the target's KV cache to 2, 3, 4, 5, 6 or 8 bits, as mlx-lm's "
        "--kv-bits does (output equal to mlx-lm's with the same flags; not for sliding-window targets).",
    ),
]
KVGroupSizeOpt = Annotated[int, typer.Option("--kv-group-size", help="Group size of the quantized KV cache.")]
QuantizedKVStartOpt = Annotated[
    int, typer.Option("--quantized-kv-start", help="Quantize the KV cache once it holds this many tokens.")
]
KV_DEFAULTS = {"kv_bits": None, "kv_group_size": 64, "quantized_kv_start": DEFAULT_QUANTIZED_KV_START}  # mlx-lm's
KV_FLAGS = {"kv_bits": "--kv-bits", "kv_group_size": "--kv-group-size", "quantized_kv_start": "--quantized-kv-start"}


def kv_settings(model, kv_bits: int | None, kv_group_size: int, quantized_kv_start: int) -> dict:
    """`stream_generate`'s KV-cache arguments for the flags, checked against the loaded target (an error names
    the flag and exits 2)."""
    from mlx_lm.models.cache import make_prompt_cache

    from ..targets.quantized_kv import kv_quantization

    try:
        kv = kv_quantization(kv_bits, kv_group_size, quantized_kv_start)
        problem = kv.problem(make_prompt_cache(model)) if kv is not None else None
        if problem is not None:
            raise ValueError(problem + ".")
    except ValueError as e:
        message = str(e)
        for name, flag in KV_FLAGS.items():
            message = message.replace(name, flag)
        fail(message)
    return {} if kv is None else {"kv_bits": kv.bits, "kv_group_size": kv.group_size, "quantized_kv_start": kv.start}


ShardOpt = Annotated[
    str | None,
    typer.Option(
        "--shard",
        metavar="tensor",
        help="Tensor-shard the target over the ranks mlx.launch started "
        "(`mlx.launch --hosts ... -- dflash-mlx COMMAND --shard tensor ...`); the drafter is replicated.",
    ),
]


def fail(message: str, code: int = 2, group=None) -> None:
    """Print one red line and exit; `group`: every rank of it fails alike, so the others wait for
    rank 0 to print it (mlx.launch stops the ranks left once one exits)."""
    err_console.print(f"[bold red]error:[/] {message}", markup=True, soft_wrap=True)
    barrier(group)
    raise typer.Exit(code)


@contextmanager
def user_errors():
    """Turn the errors a user can fix into one clear line and exit status 2."""
    try:
        yield
    except USER_ERRORS as e:
        fail(str(e).strip("'\""), group=raised_everywhere(e))


def sharding_group(shard: str | None):
    """The group for ``--shard`` (None: one process); followers are silenced from here on."""
    if shard is None:
        return None
    from ..sharding.loading import check_shard_mode
    from ..sharding.group import world

    try:
        check_shard_mode(shard)
    except ValueError as e:
        fail(f"--shard {shard}: {str(e).removeprefix('shard: ')}")
    group = world()
    if group.size() == 1:
        err_console.print(
            "[yellow]--shard: this is a single process (start every rank with `mlx.launch -n 2 -- "
            "dflash-mlx ...` or `mlx.launch --hosts ...`); the target is not split.[/]"
        )
        return None
    if group.rank() != 0:
        quiet_follower()
    return group


def quiet_follower() -> None:
    """Rank > 0 prints nothing: stdout to /dev/null, no console messages, warnings or progress bars."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    sys.stdout.flush()
    os.dup2(devnull, 1)
    os.close(devnull)
    err_console.quiet = True
    console.quiet = True
    warnings.simplefilter("ignore")
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()


def load_models(
    model: str | None, draft: str | None, use_draft: bool = True, draft_bits: int | None = None, group=None
):
    """(choice, model, tokenizer, drafter) with a status line while loading (`group`: sharded over it)."""
    with user_errors():
        choice: ModelChoice = choose_model(model, draft, use_draft=use_draft)
        if choice.is_default:
            err_console.print(
                "[dim]Using the bundled demo pair (a small GSM8K model); a real pair is one "
                "--model away (`dflash-mlx models`).[/]"
            )
        with err_console.status(f"Loading {choice.label}…", spinner="dots") if sys.stderr.isatty() else _null():
            shard = {"shard": "tensor", "group": group} if group is not None else {}
            model_, tokenizer, drafter = load_choice(choice, draft_bits=draft_bits, **shard)
    return choice, model_, tokenizer, drafter


@contextmanager
def _null():
    yield


DRAFTER_LABELS = {"dflash": "DFlash", "dspark": "DSpark", "mtp": "MTP"}


def drafter_label(drafter) -> str:
    """How tables and headers name a drafter's kind: DFlash, DFlash 2, DSpark, MTP (a target's own heads), or a
    proposer's own name."""
    if getattr(getattr(drafter, "config", None), "is_dflash2", False):
        return "DFlash 2"
    if isinstance(drafter, DSparkDraftModel):
        return "DSpark"
    name = getattr(drafter, "name", None)
    return DRAFTER_LABELS.get(name, name) if isinstance(name, str) else "DFlash"
