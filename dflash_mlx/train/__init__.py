"""Training a DFlash 2 drafter for a target, on this machine.

``prompts``: offline instruction prompts (the standard library's functions and docstrings,
chat templates x topics) with a fixed held-out split. ``distill``: the target's own greedy
answers to them, with the target features the drafter reads, in resumable shards.
``data``: training batches of blocks from the shards. ``drafter``: the training loop (the
DFlash recipe plus the DFlash 2 conv and selector), checkpoints and ``--resume``.
``evaluate``: held-out teacher-forced tau. ``common``: what they share.
"""
