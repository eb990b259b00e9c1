"""Each stage's work outside any Dagster run, one module or package per asset and named as its module in
``assets/``: ``prompts``, ``completions/``, ``tokenized``, ``hidden_states``, ``drafter/``, ``evaluation/``;
beside them the Dagster resources (``resources/``) and what several stages share: the hidden-state storage
plan, stored-shard access, the run forecast, and the config file's root schema (``config_schema``).

Below ``assets/``: may import ``orchestration`` and the cores, never ``assets`` or ``app``; Dagster types allowed."""
