"""Proposers draft the tokens a verify checks: the interface (`base`), the drafters' context (`context`),
DFlash drafters (`dflash`), DSpark drafters (`dspark`) and an oracle with a chosen acceptance pattern
(`oracle`, tests and benchmarks)."""

from .base import Proposal, Proposer
from .dflash import DFlash2Proposer, DFlashProposer, as_proposer, proposer_for
from .dspark import DSparkProposer

__all__ = [
    "DFlash2Proposer",
    "DFlashProposer",
    "DSparkProposer",
    "Proposal",
    "Proposer",
    "as_proposer",
    "proposer_for",
]
