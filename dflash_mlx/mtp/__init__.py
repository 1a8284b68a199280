"""A target's own multi-token-prediction (MTP) heads, read from its checkpoint.

`layouts` (where each family keeps the tensors, how its heads run), `head`
(`MTPHead`: the stages as one module), `checkpoint` (reading them through the
family's own sanitize). `proposers.mtp` drafts with them; `train.mtp` trains
them.
"""
