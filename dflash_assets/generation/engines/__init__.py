"""What the servers run and serve (no Dagster): pinned Python environments of the serving engines and how one is
installed (``environments``, ``install``), the local CPU targets by name (``local_model``) and the hybrid CPU
stand-in of the user's target (``hybrid_standin``), the target's chat template and the checks that a row's
context tokens are the server's (``chat_render``).

May import its own modules and ``generation.processes``, ``generation.api``, and the cores below ``generation``."""
