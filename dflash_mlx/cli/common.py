"""What the terminal commands share: the console, loading with clear errors, options.

Errors the user can fix (a bad model name, a missing file, a reasoning level
the template cannot take) are printed as one red line and exit with status 2;
nothing else is caught.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Annotated

import typer
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
from rich.console import Console

from .chat_template import ReasoningError
from ..draft.config import DraftConfigError
from ..draft.load import DraftWeightsError
from ..draft.pairing import PairMismatchError
from ..models.registry import RegistryError
from ..models.loading import load_choice
from ..models.resolve import ModelChoice, ModelChoiceError, choose_model
from ..targets.adapter import UnsupportedTargetError

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

USER_ERRORS = (
    ModelChoiceError, ReasoningError, DraftConfigError, DraftWeightsError, PairMismatchError,
    RegistryError, UnsupportedTargetError, FileNotFoundError, HfHubHTTPError, LocalEntryNotFoundError,
)

ModelOpt = Annotated[
    str | None,
    typer.Option("--model", "-m", help="Registry name, Hugging Face repo id or local mlx-lm directory "
                 "(default: the bundled demo pair)."),
]
DraftOpt = Annotated[
    str | None, typer.Option("--draft", help="DFlash drafter (directory or repo id); overrides the registry.")
]
BlockOpt = Annotated[
    str | None,
    typer.Option("--block-size", "-b", metavar="auto|N", help="Tokens per draft/verify cycle, anchor included: "
                 "auto (default) chooses per cycle, up to the registry's or the drafter's block (at most 5 for "
                 "<=4-bit models), plain decoding included; N fixes it."),
]
TemperatureOpt = Annotated[float, typer.Option("--temperature", "--temp", min=0.0, help="0: greedy.")]
TopPOpt = Annotated[float, typer.Option("--top-p", min=0.0, max=1.0)]
TopKOpt = Annotated[int, typer.Option("--top-k", min=0)]
SystemOpt = Annotated[str | None, typer.Option("--system", help="System prompt.")]
SeedOpt = Annotated[int | None, typer.Option("--seed", help="Seed for sampled runs.")]
ReasoningOpt = Annotated[
    str | None,
    typer.Option("--reasoning", help="on|off|low|medium|high|xhigh, mapped onto the chat template's "
                 "enable_thinking, reasoning_effort or reasoning_strength."),
]


def fail(message: str, code: int = 2) -> None:
    err_console.print(f"[bold red]error:[/] {message}", markup=True, soft_wrap=True)
    raise typer.Exit(code)


@contextmanager
def user_errors():
    """Turn the errors a user can fix into one clear line and exit status 2."""
    try:
        yield
    except USER_ERRORS as e:
        fail(str(e).strip("'\""))


def load_models(model: str | None, draft: str | None, use_draft: bool = True, draft_bits: int | None = None):
    """(choice, model, tokenizer, drafter) with a status line while loading."""
    with user_errors():
        choice: ModelChoice = choose_model(model, draft, use_draft=use_draft)
        if choice.is_default:
            err_console.print(
                "[dim]Using the bundled demo pair (a small GSM8K model); a real pair is one "
                "--model away (`dflash-mlx models`).[/]"
            )
        with err_console.status(f"Loading {choice.label}…", spinner="dots") if sys.stderr.isatty() else _null():
            model_, tokenizer, drafter = load_choice(choice, draft_bits=draft_bits)
    return choice, model_, tokenizer, drafter


@contextmanager
def _null():
    yield
