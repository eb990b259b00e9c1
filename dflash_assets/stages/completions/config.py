"""``ops.completions.config``: how the ``completions`` stage makes its rows, in either mode (``regenerate``: a
range run, :mod:`~dflash_assets.stages.completions.range_run`; ``on_policy``:
:mod:`~dflash_assets.stages.completions.on_policy`)."""

from typing import Literal

import dagster as dg
from pydantic import Field

from dflash_assets.data.on_policy import DEFAULT_MAX_ROUNDS, DEFAULT_MAX_TURNS, TURN_STRIDE
from dflash_assets.data.tool_sandbox import DEFAULT_TIMEOUT_S

__all__ = ["MODES", "CompletionsConfig"]

MODES = ("regenerate", "on_policy")


class CompletionsConfig(dg.Config):
    """How ``completions`` makes its rows."""

    mode: Literal["regenerate", "on_policy"] = Field(
        default="regenerate",
        description="'regenerate' (default): one reply per corpus row, given the row's own context. 'on_policy': "
        "the target runs each BFCL task of the corpus as the assistant, its tool calls executed and answered, "
        "one row per assistant turn, written to completions/<pk>.on_policy.parquet (docs/configuration.md).",
    )
    max_rounds_per_user_turn: int = Field(
        default=DEFAULT_MAX_ROUNDS,
        ge=1,
        description="on_policy: replies to one user turn after which the task's next user turn is asked, even if "
        "the last one called a tool (its calls are still executed and answered).",
    )
    max_turns_per_conversation: int = Field(
        default=DEFAULT_MAX_TURNS,
        ge=1,
        lt=TURN_STRIDE,
        description="on_policy: assistant turns after which a conversation ends, whatever is left of the task.",
    )
    tool_timeout_s: float = Field(
        default=DEFAULT_TIMEOUT_S,
        gt=0,
        le=3600,
        description="on_policy: seconds one tool call may run (in a child process) before it is stopped and "
        "answered with an error result.",
    )
    max_tool_result_kb: int = Field(
        default=64,
        ge=1,
        le=1 << 20,
        description="on_policy: the largest tool result sent back to the model, KiB; a larger one (or one that is "
        "not valid Unicode) is answered with an error result.",
    )
