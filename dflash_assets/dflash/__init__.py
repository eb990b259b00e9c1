"""DFlash drafter core: plain torch + transformers, no Dagster imports.

Modules: ``model`` (DFlashConfig, DFlashDraftModel), ``target_layers`` (the one resolution of
``target_layer_ids``), ``masks`` (anchors, block inputs, training attention mask), ``loss`` (decay-weighted
block CE), ``data`` (hidden-state shards, training batches), ``train`` (resumable single/multi-process
training loop), ``export`` (SGLang-loadable HF directory), ``speculative`` (speculative decoding) with
``hybrid_cache`` (rolling a hybrid target's linear-attention state back after a verify step),
``target_kernels`` (which linear-attention kernels a target runs). Import the submodules directly; this
package imports nothing so that light users (e.g. the shard writer) do not pay for the training stack.
"""
