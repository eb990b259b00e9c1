"""One module per pipeline stage."""
