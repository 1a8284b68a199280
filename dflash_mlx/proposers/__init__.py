"""Proposers draft the tokens a verify checks: the interface (`base`), DFlash drafters
(`dflash`) and an oracle with a chosen acceptance pattern (`oracle`, tests and benchmarks)."""

from .base import Proposal, Proposer
from .dflash import DFlash2Proposer, DFlashProposer, as_proposer, proposer_for

__all__ = ["DFlash2Proposer", "DFlashProposer", "Proposal", "Proposer", "as_proposer", "proposer_for"]
