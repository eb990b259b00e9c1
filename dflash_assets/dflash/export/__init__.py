"""The exported drafter (no Dagster): the HF directory SGLang and vLLM load, written, resolved and loaded
(``directory``), its files read without loading weights (``files``), and whether each engine would load it,
checked before any server starts (``sglang_check``, ``vllm_check``).

May import its own modules and ``dflash.model``, and the cores below ``dflash``."""
