"""Processes on this machine (no Dagster): started in their own session and stopped by process group
(``sessions``), ports free before launch and listeners trusted once proven (``ports``), ``/proc`` read
(``proc_info``), and which machine, boot and pid namespace a recorded pid belongs to (``machine``).

May import its own modules and the cores below ``generation``; nothing else of ``generation``."""
