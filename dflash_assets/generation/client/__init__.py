"""The async completion client (no Dagster): ``completion_client`` (:class:`CompletionClient`, one long run of
requests), its HTTP attempts with every failure classified (``attempts``), the routing state per server and the
choice of a server for an attempt (``routing``), one bounded HTTP exchange (``http_exchange``), what it delivers
(``results``), follow-up lanes of rows generated in parts (``follow_ups``), and a loop that stops cleanly on
SIGINT / SIGTERM (``interrupts``).

May import its own modules and ``generation.api`` (below it in ``generation``), and the cores below ``generation``."""
