"""dflash-assets: a Dagster pipeline that regenerates completions with a target model and trains a
DFlash speculative-decoding drafter on them."""

__version__ = "0.1.0"
