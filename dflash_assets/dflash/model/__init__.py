"""The draft model (plain torch + transformers, no Dagster): its configuration derived from the target's
(``draft_config``), the model (``draft_model``), the anchors, block inputs and attention mask it trains on
(``masks``), its decay-weighted block loss (``loss``, with an optional distillation term) and its optional
initialisation from the target's last layers (``target_init``).

May import its own modules and ``dflash.target``, and the cores below ``dflash``."""
