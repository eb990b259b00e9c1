"""DFlash drafter core: plain torch + transformers, no Dagster imports. Rooms by role, top to bottom: training
(``training/``: config, the ``torchrun`` entry point and its steps, checkpoints, online features); speculative
decoding and its measures (``decoding/``); the exported HF directory and the engines' loader checks
(``export/``); hidden-state shards, their extraction and dataset (``shards/``); the draft model, masks and loss
(``model/``); the target's layers, features, kernels and cache rollback (``target/``). A room imports its own
modules and the rooms below it in this order.

Import the submodules directly; the packages import nothing so that light users (e.g. the shard writer) do not pay
for the training stack.
"""
