"""Inference servers (no Dagster): the pool the client sends requests to and names every server shares
(``pool``), the group of servers an engine's launcher starts and its lifecycle, neutral to the engine
(``group``), the launchers (``sglang_servers``, ``vllm_servers``: each a ``ServerGroup``; ``transformers_server``),
SGLang's DFLASH flags and per-request acceptance (``sglang_dflash``), the pidfile registry and reaper
(``registry``), start-up probes (``probe``), what a long run may do about a faulty server (``supervision``),
secrets kept off command lines (``secret_args``) and the session leader that takes vLLM's children down with
the launcher (``group_guard``, run as a script).

May import its own modules and ``generation.engines``, ``generation.processes``, ``generation.api``, and the cores
below ``generation``."""
