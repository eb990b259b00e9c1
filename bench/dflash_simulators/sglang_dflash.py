"""The GPU-node simulator's DFLASH part: SGLang's speculative-decoding flags, its refusals, its per-request fields.

:mod:`~dflash_simulators.sglang_stub` takes the flags SGLang 0.5.23 takes for a DFlash drafter
(``--speculative-algorithm DFLASH --speculative-draft-model-path --speculative-num-draft-tokens``
/ ``--speculative-dflash-block-size``, ``--speculative-draft-attention-backend``,
``--mamba-radix-cache-strategy``, ``--speculative-draft-window-size``, ``--tp-size``, ``--pp-size``) and,
at start-up, does what SGLang's loader would: reads the target's and the export's ``config.json`` and the
export's safetensors header and refuses, exiting before the port opens, what SGLang would refuse or load
wrongly. The rules are :func:`dflash_assets.dflash.export.sglang_check.check_dflash_export`, the same the
evaluation applies before it starts anything (stricter than SGLang's loader in places: a missing
``mask_token_id``, which SGLang looks up, or tensor names it skips, are refused here). The draft attention
backend is resolved as SGLang does (:func:`draft_backend`: a free string, an unsupported one warned about and
replaced by ``flashinfer``; unset, the target's). Flags SGLang dropped (``--mamba-scheduler-strategy``,
``--speculative-dflash-draft-window-size``; gone in 0.5.20) are refused as SGLang's argparse refuses them.

Its acceptance lengths are **simulated**, not measured: per verify step the accepted drafts are a run of
independent successes of probability ``--sim-accept-p`` (default 0.6), capped by the block, drawn from a
generator seeded by the request's token ids and ``--sim-seed``; the fields are computed from them as SGLang
computes its own (``spec_accept_length = completion_tokens / spec_verify_ct``, the prefill's token
included; ``spec_accept_rate = correct drafts / (spec_verify_ct x (N - 1))``). ``/server_info`` says
``"simulated": true`` so that a report never takes them for a measurement.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Any

from dflash_assets.dflash.export.sglang_check import check_dflash_export, is_hybrid_target
from dflash_assets.generation.servers.sglang_dflash import MAMBA_STRATEGIES, SGLANG_DRAFT_ATTENTION_BACKENDS

REMOVED_FLAGS = ("--mamba-scheduler-strategy", "--speculative-dflash-draft-window-size")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """SGLang's DFLASH flags (names and choices as in 0.5.23) and the simulator's ``--sim-accept-*``."""
    p.add_argument("--speculative-algorithm", default=None)
    p.add_argument("--speculative-draft-model-path", "--speculative-draft-model", default=None)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    p.add_argument("--speculative-dflash-block-size", type=int, default=None)
    p.add_argument("--speculative-num-steps", type=int, default=None)
    p.add_argument("--speculative-eagle-topk", type=int, default=None)
    # a free string in SGLang: an unsupported one warns and falls back (draft_backend below)
    p.add_argument("--speculative-draft-attention-backend", default=None)
    p.add_argument("--speculative-draft-window-size", type=int, default=None)
    p.add_argument("--mamba-radix-cache-strategy", choices=MAMBA_STRATEGIES, default="auto")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--pp-size", type=int, default=1)
    p.add_argument(
        "--sim-accept-p",
        type=float,
        default=0.6,
        help="simulated: probability that each next draft token is accepted (DFLASH only)",
    )


class DFlashSim:
    """A loaded (checked) DFlash drafter of the simulated server and its simulated acceptance."""

    def __init__(self, args: argparse.Namespace, block: int, draft_config: dict, target_config: dict) -> None:
        self.args, self.block = args, block
        self.draft_config, self.target_config = draft_config, target_config
        self.seed = str(args.sim_seed)

    @classmethod
    def from_args(cls, args: argparse.Namespace, argv: list[str]) -> DFlashSim | None:
        """None without ``--speculative-algorithm``; else the checked drafter.

        Raises:
            SystemExit: what SGLang refuses at start-up (message on stderr, exit code 1).
        """
        for flag in REMOVED_FLAGS:
            if any(a == flag or a.startswith(flag + "=") for a in argv):
                _die(
                    f"sglang serve: error: unrecognized arguments: {flag} (removed in SGLang 0.5.20; "
                    f"{'--mamba-radix-cache-strategy' if 'mamba' in flag else '--speculative-draft-window-size'} "
                    "replaces it)"
                )
        if args.speculative_algorithm is None:
            return None
        if args.speculative_algorithm != "DFLASH":
            _die(f"the simulator serves --speculative-algorithm DFLASH only, got {args.speculative_algorithm!r}")
        if args.pp_size != 1:
            _die("Currently DFLASH speculative decoding only supports pp_size == 1.")
        if not args.speculative_draft_model_path:
            _die("DFLASH speculative decoding requires setting --speculative-draft-model-path.")
        target_dir, draft_dir = Path(args.model_path), Path(args.speculative_draft_model_path)
        if not (target_dir / "config.json").is_file():
            _die(f"--model-path {target_dir}: no config.json (SGLang cannot load the target)")
        n, alias = args.speculative_num_draft_tokens, args.speculative_dflash_block_size
        if alias is not None and n is not None and n != alias:
            _die(
                "Both --speculative-num-draft-tokens and --speculative-dflash-block-size are set but they differ. "
                f"For DFLASH they must match. speculative_num_draft_tokens={n}, speculative_dflash_block_size={alias}."
            )
        n = n if n is not None else alias
        check = check_dflash_export(
            draft_dir,
            target_dir=target_dir,
            tp_size=args.tp_size,
            num_draft_tokens=n,
            draft_window_size=args.speculative_draft_window_size,
        )
        for line in check.warnings:
            print(f"WARNING: DFLASH: {line}", flush=True)
        if not check.ok:
            _die("DFLASH draft model refused:\n" + "\n".join(f"  - {r}" for r in check.refusals))
        draft = json.loads((draft_dir / "config.json").read_text())
        target = json.loads((target_dir / "config.json").read_text())
        if n is None:
            n = int((draft.get("dflash_config") or {}).get("block_size") or draft.get("block_size") or 16)
        backend = draft_backend(args)
        if backend != (args.speculative_draft_attention_backend or backend):
            print(
                f"WARNING: DFLASH draft worker only supports attention_backend in {SGLANG_DRAFT_ATTENTION_BACKENDS} "
                f"for now, but got {args.speculative_draft_attention_backend!r}. Falling back to '{backend}'.",
                flush=True,
            )
        print(
            f"DFLASH draft runner ready (simulated acceptance, p={args.sim_accept_p}): block_size={n}, "
            f"attention_backend={backend}, "
            f"mamba_radix_cache_strategy={resolved_mamba(args, target)}",
            flush=True,
        )
        return cls(args, n, draft, target)

    def spec_fields(self, input_ids: list[int], completion_tokens: int) -> dict[str, Any]:
        """SGLang's per-request speculative fields for a request that generated ``completion_tokens``
        (the first from the prefill, the rest from verify steps); none when no verify step ran."""
        if completion_tokens <= 1:
            return {}
        rng = random.Random(hashlib.sha256((self.seed + json.dumps(input_ids)).encode()).digest())
        left, steps, correct = completion_tokens - 1, 0, 0
        histogram = [0] * self.block
        while left > 0:
            drafts = 0
            while drafts < self.block - 1 and rng.random() < self.args.sim_accept_p:
                drafts += 1
            made = min(drafts + 1, left)  # accepted drafts + the bonus token, cut at the token limit
            steps, correct, left = steps + 1, correct + made - 1, left - made
            histogram[made - 1] += 1
        proposed = steps * (self.block - 1)
        return {
            "spec_accept_length": completion_tokens / steps,
            "spec_verify_ct": steps,
            "spec_accept_rate": correct / proposed if proposed else 0.0,
            "spec_num_correct_drafts": correct,
            "spec_num_proposed_drafts": proposed,
            "spec_correct_drafts_histogram": histogram,
        }

    def server_info(self) -> dict[str, Any]:
        """``/server_info`` fields about speculative decoding, with ``simulated: true``."""
        a = self.args
        return {
            "speculative_algorithm": "DFLASH",
            "speculative_draft_model_path": a.speculative_draft_model_path,
            "speculative_num_draft_tokens": self.block,
            "speculative_num_steps": 1,
            "speculative_eagle_topk": 1,
            "speculative_draft_attention_backend": draft_backend(a),
            "mamba_radix_cache_strategy": resolved_mamba(a, self.target_config),
        }


def draft_backend(args: argparse.Namespace) -> str:
    """The draft worker's attention backend as SGLang 0.5.23 resolves it (``resolve_draft_worker_attention_backend``):
    the one named, else the target's (``--attention-backend``; SGLang picks one per GPU when it is unset, the
    simulator says ``flashinfer``), and ``flashinfer`` (CUDA's fallback) for one the draft worker does not take."""
    named = args.speculative_draft_attention_backend or args.attention_backend or "flashinfer"
    return named if named in SGLANG_DRAFT_ATTENTION_BACKENDS else "flashinfer"


def resolved_mamba(args: argparse.Namespace, target_config: dict) -> str | None:
    """What ``auto`` resolves to (SGLang: extra_buffer for a hybrid target on CUDA with overlap scheduling)."""
    if not is_hybrid_target(target_config):
        return None
    return "extra_buffer" if args.mamba_radix_cache_strategy == "auto" else args.mamba_radix_cache_strategy


def _die(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(1)


__all__ = ["DFlashSim", "add_arguments", "resolved_mamba"]
