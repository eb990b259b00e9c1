"""The ``prompt_corpus`` stage without Dagster: where the corpus is stored."""

CORPUS_FILE = ("prompt_corpus", "corpus.parquet")
REJECTED_FILE = ("prompt_corpus", "rejected.parquet")
