"""The training data order: which rows and anchors each (step, rank) trains on, a pure function of the step
(so a resumed run sees the same batches), and a background thread building the next batches."""

from __future__ import annotations

import hashlib
import math
import queue
import threading
from collections.abc import Callable

import torch

from dflash_assets.dflash.model.masks import sample_anchors
from dflash_assets.dflash.shards.dataset import HiddenStateShards, TrainingBatch, collate_training_batch


def seed_for(*parts: int) -> int:
    """A 63-bit seed from integers (SHA-256): the same parts, the same seed on every rank and run."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


class StepPlan:
    """Which rows and anchors each (step, rank) trains on: a pure function of the step.

    Epoch ``e`` visits a permutation of the rows seeded by ``(seed, e)``, padded by wrapping to a
    multiple of ``world * batch_size`` so every rank runs the same number of steps.
    """

    def __init__(self, num_rows: int, world: int, batch_size: int, seed: int) -> None:
        if num_rows == 0:
            raise ValueError("no training rows (all held out, empty, or without room for a block)")
        self.num_rows, self.world, self.batch_size, self.seed = num_rows, world, batch_size, seed
        self.rows_per_step = world * batch_size
        self.steps_per_epoch = math.ceil(num_rows / self.rows_per_step)
        self._cache: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._cache:
            g = torch.Generator().manual_seed(seed_for(self.seed, epoch))
            perm = torch.randperm(self.num_rows, generator=g)
            need = self.steps_per_epoch * self.rows_per_step
            self._cache = {epoch: perm.repeat(math.ceil(need / self.num_rows))[:need]}
        return self._cache[epoch]

    def rows(self, step: int, rank: int) -> tuple[int, list[int]]:
        """(epoch, row indices) for ``rank`` at global ``step``."""
        epoch, s = divmod(step, self.steps_per_epoch)
        order = self._order(epoch)
        lo = s * self.rows_per_step + rank * self.batch_size
        return epoch, order[lo : lo + self.batch_size].tolist()


def build_batch(
    dataset: HiddenStateShards,
    rows: list[int],
    epoch: int,
    seed: int,
    block_size: int,
    max_anchors: int,
    mask_token_id: int,
) -> TrainingBatch:
    """Read ``rows``, sample anchors with generators seeded by ``(seed, epoch, row)``, collate."""
    samples, anchors = [], []
    for r in rows:
        s = dataset[r]
        g = torch.Generator().manual_seed(seed_for(seed, epoch, r, 1))
        samples.append(s)
        anchors.append(sample_anchors(s["loss_mask"], block_size, max_anchors, g))
    return collate_training_batch(samples, anchors, block_size, mask_token_id)


class Prefetcher:
    """Builds batches for steps [start, stop) in a background thread (bounded queue)."""

    def __init__(self, make: Callable[[int], TrainingBatch], start: int, stop: int, depth: int, pin: bool) -> None:
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()

        def run() -> None:
            try:
                for step in range(start, stop):
                    b = make(step)
                    if pin:
                        b = b.pin_memory()
                    while not self._stop.is_set():
                        try:
                            self._q.put((step, b), timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if self._stop.is_set():
                        return
            except BaseException as e:  # surfaced in the training thread
                self._q.put((None, e))

        self._thread = threading.Thread(target=run, daemon=True, name="dflash-prefetch")
        self._thread.start()

    def get(self) -> tuple[int, TrainingBatch]:
        step, item = self._q.get()
        if step is None:
            raise item
        return step, item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
