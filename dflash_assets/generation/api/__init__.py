"""The OpenAI-compatible API as both sides of ``generation`` speak it (no Dagster): one URL rule for every request
to an inference server and redaction of what servers send back (``urls``), and the fields of a server's reply
(``replies``).

The bottom of ``generation``: imports nothing of the package."""
