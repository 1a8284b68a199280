"""Running a pair tensor-sharded over MLX's distributed group (ranks started by ``mlx.launch``).

`group`: the group, the leader rank and the few collectives ranks agree
through; `loading`: the sharded load with its checks; `lockstep`: the proof
that ranks generated the same tokens. Every rank runs the same program with
the same arguments (as mlx-lm's sharded generation does): the target's
sharded layers exchange partial sums, every decision (acceptance, block
size, sampling) is computed alike on every rank, and only rank 0 prints.
"""
