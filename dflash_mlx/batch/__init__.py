"""Batched DFlash decoding: several requests verified in one target forward (see `engine`)."""
