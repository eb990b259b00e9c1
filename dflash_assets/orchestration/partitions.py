"""The dynamic partitions of every per-prompt stage: index ranges keyed as :mod:`dflash_assets.data.ranges` says.

``prompt_corpus`` registers the keys in the instance when it materializes.
"""

from __future__ import annotations

import dagster as dg

prompt_ranges = dg.DynamicPartitionsDefinition(name="prompt_index_ranges")
