"""The training run itself, as named steps: seeding, data, model, resume and DDP
(:mod:`~dflash_assets.dflash.training.setup`), then the loop (optimizer step, log record with held-out
evaluation, checkpoint) and the summary. :func:`dflash_assets.dflash.training.train.train` is its entry point."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from dflash_assets.dflash.model.loss import accuracy_per_position
from dflash_assets.dflash.shards.dataset import TrainingBatch
from dflash_assets.dflash.training.batches import Prefetcher, StepPlan, build_batch
from dflash_assets.dflash.training.checkpoints import save_checkpoint
from dflash_assets.dflash.training.config import LOG_FILE, SUMMARY_FILE, TrainConfig, TrainResult
from dflash_assets.dflash.training.distributed import node_name
from dflash_assets.dflash.training.held_out import batch_loss, evaluate
from dflash_assets.dflash.training.process_group import Distributed
from dflash_assets.dflash.training.setup import (
    build_model,
    build_optimizer,
    draft_config_and_head,
    resume,
    seed_everything,
    training_datasets,
    wrap_ddp,
)
from dflash_assets.storage.atomic import atomic_write_bytes


def param_checksum(model: torch.nn.Module) -> str:
    """SHA-256 of the model's parameters and buffers (every rank must hold the same weights)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def run_training(
    cfg: TrainConfig, dd: Distributed, draft_config, target_head, progress_callback, online_target=None
) -> TrainResult:
    """Train (or resume) on this rank; see :func:`dflash_assets.dflash.training.train.train`."""
    out = Path(cfg.out_dir)
    if dd.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.seed)
    dataset, eval_set, online = training_datasets(cfg, dd, draft_config, online_target)
    dc, target_head = draft_config_and_head(cfg, dataset, draft_config, target_head)
    model = build_model(cfg, dc, target_head, dd.device)
    plan = StepPlan(len(dataset), dd.world, cfg.batch_size, cfg.seed)
    total_steps = cfg.max_steps if cfg.max_steps is not None else cfg.epochs * plan.steps_per_epoch
    opt, sched = build_optimizer(cfg, model, total_steps)
    start_step, tokens_seen, records = resume(cfg, dd, out, model, opt, sched)
    train_model = wrap_ddp(model, dd)
    model.train()
    loop = _Loop(cfg, dd, model, train_model, opt, sched, plan, total_steps, dc, records, out / LOG_FILE)
    loop.run(dataset, eval_set, online, start_step, tokens_seen, progress_callback)
    summary = _summary(cfg, dd, model, dataset, eval_set, online, dc, loop, start_step, records)
    if dd.rank == 0:
        atomic_write_bytes(out / SUMMARY_FILE, json.dumps(summary, indent=2).encode())
    dd.barrier()
    return TrainResult(model=model, records=records, step=loop.done, tokens_per_s=loop.tokens_per_s, summary=summary)


class _Window:
    """Sums over the steps since the last log record (reduced across ranks when a record is made)."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.start = time.perf_counter()
        self.correct = torch.zeros(block_size, device=device)
        self.count = torch.zeros(block_size, device=device)
        self.loss = torch.zeros(2, device=device)  # sum of loss, number of steps
        self.tokens = torch.zeros(2, device=device, dtype=torch.float64)  # block tokens, context tokens

    def add(self, res: dict, step_loss: torch.Tensor, batch: TrainingBatch, world: int) -> None:
        self.loss += torch.stack([step_loss, torch.ones((), device=self.loss.device) / world])
        self.correct += res["correct"]
        self.count += res["count"]
        self.tokens[0] += batch.num_block_tokens
        self.tokens[1] += batch.num_context_tokens

    def reduced(self, dd: Distributed) -> torch.Tensor:
        """``[loss sum, steps, correct per position, count per position, block tokens, context tokens]``
        summed over ranks."""
        stats = torch.cat([self.loss.double(), self.correct.double(), self.count.double(), self.tokens])
        return dd.all_reduce_sum(stats)

    def reset(self) -> None:
        for t in (self.loss, self.correct, self.count, self.tokens):
            t.zero_()
        self.start = time.perf_counter()  # eval/log time stays out of the next window


@dataclass
class _Loop:
    """The optimizer steps from ``start_step`` to ``total_steps`` (or an early stop), with log records,
    held-out evaluation and checkpoints; afterwards ``done``, ``stopped``, ``tokens_seen``, ``tokens_per_s``."""

    cfg: TrainConfig
    dd: Distributed
    model: torch.nn.Module
    train_model: torch.nn.Module
    opt: torch.optim.Optimizer
    sched: object
    plan: StepPlan
    total_steps: int
    dc: object
    records: list[dict]
    log_path: Path
    done: int = 0
    stopped: bool = False
    tokens_seen: int = 0
    tokens_per_s: float = 0.0

    def run(
        self,
        dataset,
        eval_set,
        online,
        start_step: int,
        tokens_seen: int,
        progress_callback: Callable[[dict], None] | None,
    ) -> None:
        cfg, dd, device = self.cfg, self.dd, self.dd.device
        use_cuda = device.type == "cuda"

        def make(step: int) -> TrainingBatch:
            epoch, rows = self.plan.rows(step, dd.rank)
            return build_batch(dataset, rows, epoch, cfg.seed, cfg.block_size, cfg.max_anchors, self.dc.mask_token_id)

        prefetch = Prefetcher(make, start_step, self.total_steps, cfg.prefetch, pin=use_cuda)
        window = _Window(cfg.block_size, device)
        loop_start, loop_tokens = window.start, 0
        stop = torch.zeros(1, device=device)  # set when the progress callback asks to stop early
        self.done, self.tokens_seen = start_step, tokens_seen
        try:
            for step in range(start_step, self.total_steps):
                got, batch = prefetch.get()
                assert got == step
                batch = batch.to(device, non_blocking=True)
                if online is not None:  # the frozen target computes this batch's context features
                    batch.context_hidden = online(batch.context_input_ids, batch.context_lengths)
                res, step_loss, grad_norm, lr = self._optimizer_step(batch)
                window.add(res, step_loss, batch, dd.world)
                loop_tokens += batch.num_block_tokens
                self.done = done = step + 1
                self.tokens_seen += batch.num_block_tokens * dd.world
                if done % cfg.log_every == 0 or done == self.total_steps:
                    rec = self._record(window, eval_set, step, lr, grad_norm, loop_start)
                    if dd.rank == 0:
                        self.records.append(rec)
                        with open(self.log_path, "a") as f:
                            f.write(json.dumps(rec) + "\n")
                        if progress_callback is not None and progress_callback(rec) is True:
                            stop[0] = 1.0
                    if dd.enabled:
                        dd.all_reduce_sum(stop)  # every rank stops at the same step
                stopping = bool(stop[0] > 0)
                if (cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or done == self.total_steps or stopping:
                    if dd.rank == 0:
                        save_checkpoint(
                            cfg, self.dc, self.model, self.opt, self.sched, done, self.tokens_seen, self.plan, dd.world
                        )
                    dd.barrier()
                if stopping:
                    break
        finally:
            prefetch.close()
        loop_s = time.perf_counter() - loop_start
        self.tokens_per_s = loop_tokens * dd.world / loop_s if loop_s > 0 and loop_tokens else 0.0
        self.stopped = bool(stop[0] > 0)

    def _optimizer_step(self, batch: TrainingBatch):
        """Forward, backward, clip and step on one batch: ``(loss parts, step loss, grad norm, lr used)``."""
        cfg, dd, device = self.cfg, self.dd, self.dd.device
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            res = batch_loss(
                self.train_model, self.model, batch, cfg.loss_gamma, cfg.distill_weight, cfg.loss_positions == "all"
            )
        loss, step_loss = res["loss"], res["loss"].detach().float()
        if dd.enabled:
            # DDP averages gradients over ranks; scale so the result is the gradient of the global
            # weighted mean (what one process with the whole global batch computes)
            totals = dd.all_reduce_sum(
                torch.stack([step_loss * res["weight_sum"].float(), res["weight_sum"].float().detach()])
            )
            global_w = totals[1].clamp(min=1e-12)
            loss = loss * (res["weight_sum"].float().detach() * dd.world / global_w)
            step_loss = totals[0] / global_w / dd.world  # summed over ranks at log time
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return res, step_loss, grad_norm, lr

    def _record(self, window: _Window, eval_set, step: int, lr: float, grad_norm, loop_start: float) -> dict:
        """The log record of the window ending at ``step`` (held-out figures every ``eval_every`` steps)."""
        cfg, done = self.cfg, self.done
        stats = window.reduced(self.dd)
        now = time.perf_counter()
        nb = cfg.block_size
        rec = {
            "step": done,
            "total_steps": self.total_steps,
            "epoch": step // self.plan.steps_per_epoch,
            "loss": float(stats[0] / stats[1]),
            "acc_per_position": accuracy_per_position(stats[2 : 2 + nb], stats[2 + nb : 2 + 2 * nb]),
            "lr": lr,
            "grad_norm": float(grad_norm),
            "block_tokens": int(stats[-2]),
            "context_tokens": int(stats[-1]),
            "tokens_per_s": float(stats[-2]) / max(now - window.start, 1e-9),
            "elapsed_s": now - loop_start,
        }
        if (
            eval_set is not None
            and len(eval_set)
            and cfg.eval_every
            and (done % cfg.eval_every == 0 or done == self.total_steps)
        ):
            ev = evaluate(
                self.model,
                eval_set,
                max_anchors=cfg.max_anchors,
                seed=cfg.seed,
                gamma=cfg.loss_gamma,
                max_rows=cfg.eval_max_rows,
                distill_weight=cfg.distill_weight,
                target_labels=cfg.loss_positions == "all",
            )
            rec.update(
                {
                    "eval_loss": ev["loss"],
                    "eval_acc_per_position": ev["acc_per_position"],
                    "eval_tau_estimate": ev["tau_estimate"],
                }
            )
        window.reset()
        return rec


def _summary(
    cfg: TrainConfig,
    dd: Distributed,
    model,
    dataset,
    eval_set,
    online,
    dc,
    loop: _Loop,
    start_step: int,
    records: list[dict],
) -> dict:
    """What ``summary.json`` says of the run (the held-out evaluation at the end included); the parameter
    checksums and node names are gathered from every rank."""
    mine = (param_checksum(model), node_name())
    gathered = [mine]
    if dd.enabled:
        gathered = [None] * dd.world
        dist.all_gather_object(gathered, mine)
    checksums, nodes = [g[0] for g in gathered], [g[1] for g in gathered]
    summary = {
        "step": loop.done,
        "total_steps": loop.total_steps,
        "stopped_early": loop.stopped,
        "resumed_from_step": start_step,
        "world_size": dd.world,
        "features": cfg.features,
        "target_forwards": online.forwards if online is not None else 0,
        "target_kernels": getattr(online, "kernels", None),
        "train_rows": len(dataset),
        "dropped_rows": dataset.dropped_rows,
        "train_tokens": dataset.num_tokens,
        "tokens_seen": loop.tokens_seen,
        "tokens_per_s": loop.tokens_per_s,
        "final_loss": records[-1]["loss"] if records else None,
        "rank_param_checksums": checksums,
        "rank_nodes": nodes,  # the node each global rank ran on (DFLASH_NODE_NAME, else the host name)
        "draft_config": dc.to_dict(),
    }
    if eval_set is not None and len(eval_set):
        summary["eval"] = evaluate(
            model,
            eval_set,
            max_anchors=cfg.max_anchors,
            seed=cfg.seed,
            gamma=cfg.loss_gamma,
            max_rows=cfg.eval_max_rows,
            distill_weight=cfg.distill_weight,
            target_labels=cfg.loss_positions == "all",
        )
    return summary
