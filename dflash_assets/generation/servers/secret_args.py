"""Secrets never go on a server's command line: a flag that carries one in an ``extra_args`` list is refused.

A value given as ``--api-key VALUE`` (or ``--api-key=VALUE``) in ``inference.sglang.extra_args`` (or another mode's) or
``drafter_evaluation.engine_extra_args`` would land in the server's argv (``ps`` shows it to every local
user), the config file, the Dagster UI and the ``# launch:`` log line. The key comes from the
environment instead (``DFLASH_SERVER_API_KEY``), which the launcher hands to SGLang in a private file.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["SECRET_FLAGS", "SecretArgError", "refuse_secret_args"]

#: flag -> the environment variable to set instead (SGLang's argparse also takes unambiguous prefixes)
SECRET_FLAGS = {"--api-key": "DFLASH_SERVER_API_KEY"}
_SHORTEST_PREFIX = len("--api-k")  # "--api-" alone could be another flag


class SecretArgError(ValueError):
    """An extra-args list holds a flag that carries a secret; the message names the setting, the flag
    and the variable to use (never the value)."""


def _secret_flag(arg: str) -> str | None:
    name = arg.split("=", 1)[0].replace("_", "-")
    for flag in SECRET_FLAGS:
        if len(name) >= _SHORTEST_PREFIX and flag.startswith(name):
            return flag
    return None


def refuse_secret_args(args: Sequence[str], setting: str) -> None:
    """Raise unless ``args`` (server flags) hold no secret-carrying flag (:data:`SECRET_FLAGS`, as
    ``--api-key VALUE``, ``--api-key=VALUE``, ``--api_key`` or an argparse prefix such as ``--api-ke``).

    Args:
        args: the flags, e.g. ``inference.sglang.extra_args``.
        setting: where they were set, for the message (e.g. ``"inference.sglang.extra_args"``).

    Raises:
        SecretArgError: naming ``setting``, the flag and the environment variable to set instead.
    """
    for arg in args:
        if isinstance(arg, str) and (flag := _secret_flag(arg)):
            raise SecretArgError(
                f"{setting}: {flag} puts the API key on the server's command line (visible in ps, the config "
                f"file, the Dagster UI and the launch log); remove it from {setting} and set the environment "
                f"variable {SECRET_FLAGS[flag]} instead (the launcher passes it to the server in a private file)"
            )
