"""The quick estimates of tau without decoding, on held-out rows with stored (or online) target features:
along the decoder's own chain of anchors, and on uniform anchors (definitions:
:mod:`dflash_assets.dflash.decoding.evaluation`)."""

from __future__ import annotations

import torch
from torch import nn

from dflash_assets.dflash.decoding.acceptance import acceptance_histogram, acceptance_length, tau_statistics
from dflash_assets.dflash.model.loss import accuracy_per_position, expected_acceptance_length


@torch.no_grad()
def teacher_forced_acceptance(
    drafter: nn.Module,
    dataset,
    *,
    max_anchors: int = 64,
    max_rows: int | None = None,
    seed: int = 0,
    device: torch.device | str | None = None,
    logits_chunk: int = 1024,
    return_blocks: bool = False,
) -> dict:
    """Teacher-forced acceptance length of ``drafter`` on stored features (no target needed).

    For each row, up to ``max_anchors`` anchors are drawn (``sample_anchors``, generator seeded by
    ``(seed, row)``); every block ``[x_a, MASK..]`` sees the stored features of positions ``< a`` (the
    training layout, :func:`collate_training_batch`), and its accepted length is
    ``1 + (number of leading positions k = 1.. whose argmax equals the stored token x_{a+k})``; a
    position whose label has ``loss_mask == 0`` ends the run. This equals the real greedy acceptance
    length at that anchor when the stored text is the target's own greedy output (up to the features'
    bf16 rounding), and is a proxy otherwise (e.g. sampled completions).

    Args:
        drafter: :class:`DFlashDraftModel` with the target head attached.
        dataset: :class:`HiddenStateShards` (its ``block_size`` should equal the drafter's) or a list of
            shard paths (read with ``split="all"``).
        max_anchors: blocks per row; max_rows: rows evaluated (first ones); device: default the
            drafter's; logits_chunk: block positions whose logits are built at once (memory bound
            ``logits_chunk * vocab_size * 4`` bytes).
        return_blocks: also return the per-block accepted lengths and anchors.

    Returns:
        dict: ``tau`` (mean accepted length over blocks; NaN with no block), ``tau_independent``
        (``expected_acceptance_length`` of the per-position accuracies, which assumes independent
        positions), ``acc_per_position`` (block_size floats, NaN at 0), ``histogram``
        (:func:`acceptance_histogram`), ``num_blocks``, ``num_rows``; with ``return_blocks``,
        ``blocks``: list of ``(row, anchor, accepted_length)``.
    """
    from dflash_assets.dflash.model.masks import sample_anchors
    from dflash_assets.dflash.shards.dataset import HiddenStateShards, collate_training_batch

    bs = int(drafter.config.block_size)
    mask_id = int(drafter.config.mask_token_id)
    if isinstance(dataset, (list, tuple)):  # shard paths (a dataset object, e.g. online TokenizedRows, is used as is)
        dataset = HiddenStateShards(list(dataset), split="all", block_size=bs)
    was_training = drafter.training
    drafter.eval()
    device = torch.device(device) if device is not None else drafter.fc.weight.device
    n_rows = len(dataset) if max_rows is None else min(len(dataset), max_rows)
    correct = torch.zeros(bs)
    count = torch.zeros(bs)
    lengths: list[int] = []
    blocks: list[tuple[int, int, int]] = []
    head = drafter.target_lm_head_weight
    for r in range(n_rows):
        sample = dataset[r]
        g = torch.Generator().manual_seed(seed * 1_000_003 + r)
        anchors = sample_anchors(sample["loss_mask"], bs, max_anchors, g)
        m = anchors.numel()
        if m == 0:
            continue
        batch = collate_training_batch([sample], [anchors], bs, mask_id).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            hidden = drafter(
                batch.block_input_ids,
                target_hidden=batch.context_hidden,
                position_ids=batch.position_ids,
                attention_mask=batch.attention_mask,
            )
        hidden = hidden[0, : m * bs]
        preds = torch.cat(
            [
                torch.nn.functional.linear(hidden[i : i + logits_chunk].float(), head.float()).argmax(-1)
                for i in range(0, hidden.shape[0], logits_chunk)
            ]
        )
        hit = ((preds == batch.labels[0, : m * bs]) & batch.label_mask[0, : m * bs]).view(m, bs).cpu()
        valid = batch.label_mask[0, : m * bs].view(m, bs).cpu()
        correct += hit.float().sum(0)
        count += valid.float().sum(0)
        run = hit[:, 1:].to(torch.int64).cumprod(1).sum(1) + 1  # leading correct drafts + the bonus
        lengths.extend(run.tolist())
        if return_blocks:
            blocks.extend((r, int(a), int(v)) for a, v in zip(anchors.tolist(), run.tolist()))
    drafter.train(was_training)
    acc = accuracy_per_position(correct, count)
    out = {
        "tau": acceptance_length(lengths),
        "tau_independent": expected_acceptance_length(acc),
        "acc_per_position": acc,
        "histogram": acceptance_histogram(lengths, bs),
        "num_blocks": len(lengths),
        "num_rows": n_rows,
    }
    if return_blocks:
        out["blocks"] = blocks
    return out


@torch.no_grad()
def teacher_forced_chain(
    drafter: nn.Module,
    dataset,
    *,
    max_rows: int | None = None,
    max_new_tokens: int | None = None,
    anchors_per_forward: int = 256,
    device: torch.device | str | None = None,
) -> dict:
    """Quick tau estimate on stored features along the decoder's own chain of anchors (no target forward).

    For each row the first anchor is the first generated token (the first ``loss_mask == 1`` position,
    which greedy decoding gets from the prefill); the block ``[x_a, MASK..]`` sees the stored features of
    positions ``< a``; its accepted length ``L`` is ``1 + (leading drafts equal to the stored x_{a+k})``,
    counting only positions inside the row (and the first ``max_new_tokens`` generated tokens, if given);
    the next anchor is ``a + L`` (previous anchor + accepted drafts + 1, the bonus token). Exactly the
    blocks greedy speculative decoding visits when the stored text is the target's greedy output (up to the
    features' bf16 rounding); with sampled completions it is an estimate.

    Blocks at every generated position are predicted in packed forwards of ``anchors_per_forward`` anchors
    (the same layout as training, :func:`collate_training_batch`), then the chain is walked; the cost is
    about ``block_size`` times a pass over the row.

    Args:
        drafter: :class:`DFlashDraftModel` with the target head attached.
        dataset: :class:`HiddenStateShards` or a list of shard paths (read with ``split="all"``).
        max_rows: first rows only; max_new_tokens: stop each chain after this many generated tokens
            (to match a decoding limit); device: default the drafter's.

    Returns:
        dict: the :func:`tau_statistics` fields over rows (``tau`` per-row mean, ``tau_pooled``, standard
        errors, ``histogram``, ``acceptance_per_position``), ``accepted_lengths`` (per row lists),
        ``num_rows``, ``num_blocks``.
    """
    from dflash_assets.dflash.shards.dataset import HiddenStateShards, collate_training_batch

    bs = int(drafter.config.block_size)
    mask_id = int(drafter.config.mask_token_id)
    if isinstance(dataset, (list, tuple)):  # shard paths (a dataset object, e.g. online TokenizedRows, is used as is)
        dataset = HiddenStateShards(list(dataset), split="all", block_size=bs)
    was_training = drafter.training
    drafter.eval()
    device = torch.device(device) if device is not None else drafter.fc.weight.device
    head = drafter.target_lm_head_weight
    n_rows = len(dataset) if max_rows is None else min(len(dataset), max_rows)
    per_row: list[list[int]] = []
    for r in range(n_rows):
        sample = dataset[r]
        ids, lm = sample["input_ids"], sample["loss_mask"].bool()
        t = ids.shape[0]
        generated = torch.nonzero(lm, as_tuple=False).flatten()
        if generated.numel() < 2:
            per_row.append([])
            continue
        first = int(generated[0])
        end = t if max_new_tokens is None else min(t, first + max_new_tokens)
        # hits[a, k]: draft k of the block anchored at a equals the stored token (k = 1..bs-1)
        positions = torch.arange(first, end - 1)
        hits = torch.zeros(end, bs, dtype=torch.bool)
        for lo in range(0, positions.numel(), anchors_per_forward):
            anchors = positions[lo : lo + anchors_per_forward]
            pad = max(0, int(anchors.max()) + bs - t)  # blocks near the end run past the row: pad with masked labels
            s = (
                sample
                if not pad
                else {
                    "input_ids": torch.cat([ids, torch.full((pad,), mask_id, dtype=ids.dtype)]),
                    "loss_mask": torch.cat([sample["loss_mask"], torch.zeros(pad, dtype=sample["loss_mask"].dtype)]),
                    "hidden_states": torch.cat([sample["hidden_states"], sample["hidden_states"][-1:].expand(pad, -1)]),
                }
            )
            batch = collate_training_batch([s], [anchors], bs, mask_id).to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                hidden = drafter(
                    batch.block_input_ids,
                    target_hidden=batch.context_hidden,
                    position_ids=batch.position_ids,
                    attention_mask=batch.attention_mask,
                )
            m = anchors.numel()
            pred = torch.nn.functional.linear(hidden[0, : m * bs].float(), head.float()).argmax(-1).view(m, bs).cpu()
            label_pos = anchors[:, None] + torch.arange(bs)[None, :]
            inside = label_pos < end
            labels = torch.where(inside, s["input_ids"][label_pos.clamp(max=s["input_ids"].shape[0] - 1)], -1)
            hits[anchors] = (pred == labels) & inside
        lengths, a = [], first
        while a < end - 1:
            run = int(hits[a, 1:].to(torch.int64).cumprod(0).sum())
            n = min(1 + run, end - 1 - a)  # the bonus token must lie inside the row
            lengths.append(n)
            a += n
        per_row.append(lengths)
    drafter.train(was_training)
    return {
        **tau_statistics(per_row, bs),
        "accepted_lengths": per_row,
        "num_rows": n_rows,
        "num_blocks": sum(len(v) for v in per_row),
    }
