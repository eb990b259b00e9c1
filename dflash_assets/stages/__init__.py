"""Each stage's work outside any Dagster run, one module or package per asset and named as its module in
``assets/``: ``prompts``, ``completions/``, ``tokenized``, ``hidden_states``, ``drafter/``, ``evaluation/``;
beside them the Dagster resources (``resources/``) and what several stages share: the hidden-state storage
plan, stored-shard access and the run forecast.

Below ``assets/``: may import ``orchestration`` and the cores, never ``assets`` or ``app``; Dagster types allowed."""
