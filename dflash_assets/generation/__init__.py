"""Generation machinery: local model preparation, server launchers, async client, row journal."""
