"""What a stage's materialization cost: device-seconds, tokens in and out, throughput per device.

Every costed asset adds :func:`cost_metadata`'s keys (all prefixed ``cost_``) to its materialization, so the
per-stage table (:mod:`dflash_assets.app.cost_table`) and the forecast (:mod:`dflash_assets.stages.forecast`) read one
shape whatever the stage. The device and how its seconds were counted are recorded beside the figure
(``cost_device``, ``cost_basis``), never guessed later:

- ``GPU``: GPUs x wall seconds (SGLang servers x their GPUs each; trainer processes; the extraction's one GPU).
- ``simulated GPU``: the same count on the GPU-node simulator (:mod:`dflash_simulators`): not measured
  on a GPU.
- ``CPU``: CPU cores this process may use x wall seconds (``cores x wall``), or the process's own CPU time
  (``process CPU time``) for stages that run in-process on a CPU only (tokenization).
- ``server``: external servers whose devices are unknown: servers x wall.

No Dagster import here: plain values in, plain values out.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

GPU, SIMULATED_GPU, CPU, SERVER = "GPU", "simulated GPU", "CPU", "server"
CORES_X_WALL, PROCESS_CPU = "cores x wall", "process CPU time"
SIMULATION_PACKAGE = "dflash_simulators"
#: the keys :func:`cost_metadata` writes
KEYS = (
    "cost_device",
    "cost_basis",
    "cost_devices",
    "cost_device_s",
    "cost_wall_s",
    "cost_tokens_in",
    "cost_tokens_out",
    "cost_tok_per_device_s",
)


def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def torch_device(device: str, processes: int = 1) -> tuple[str, int, str]:
    """``(kind, devices, basis)`` for work on torch ``device`` (``cpu``, ``cuda``, ``cuda:N``) in
    ``processes`` processes: one GPU per process, or the process's cores on a CPU."""
    if str(device).startswith("cuda"):
        return GPU, processes, f"{processes} process(es) x 1 GPU x wall"
    return CPU, cpu_cores(), CORES_X_WALL


def generation_devices(inference) -> tuple[str, int, str]:
    """``(kind, devices, basis)`` of an :class:`~dflash_assets.stages.resources.inference.InferenceServerResource`.

    sglang: ``num_servers x tp_size`` GPUs (``simulated GPU`` when ``launch_module`` is the simulator);
    external: one device per URL (``server``: the devices behind it are unknown; a router counts
    ``num_servers``); vllm: ``num_servers x tp_size`` GPUs on cuda, the CPU cores on cpu; local: the CPU cores
    (``transformers serve`` on this machine)."""
    if inference.mode == "vllm" and inference.vllm.device == "cuda":
        v = inference.vllm
        return GPU, v.num_servers * v.tp_size, f"{v.num_servers} server(s) x {v.tp_size} GPU(s) x wall while generating"
    if inference.mode == "sglang":
        g = inference.sglang
        kind = SIMULATED_GPU if g.launch_module.startswith(SIMULATION_PACKAGE) else GPU
        return (
            kind,
            g.num_servers * g.tp_size,
            f"{g.num_servers} server(s) x {g.tp_size} GPU(s) x wall while generating",
        )
    if inference.mode == "external":
        n = max(1, len(inference.external.base_urls))
        return SERVER, n, f"{n} server URL(s) x wall while generating"
    return CPU, cpu_cores(), CORES_X_WALL + " while generating"


def cost_metadata(
    kind: str, devices: int, basis: str, device_s: float, wall_s: float, tokens_in: int, tokens_out: int
) -> dict:
    """The ``cost_*`` metadata of one materialization.

    Args:
        kind: :data:`GPU`, :data:`SIMULATED_GPU`, :data:`CPU` or :data:`SERVER`.
        devices: devices (GPUs, cores, servers) the stage held.
        basis: how ``device_s`` was counted (e.g. ``cores x wall``).
        device_s: device-seconds (devices x seconds held, or CPU seconds).
        wall_s: wall seconds of the work.
        tokens_in: tokens the stage read (prompt tokens; tokens tokenized, extracted or trained on).
        tokens_out: tokens the stage produced (generated tokens; 0 where it produces none).

    ``cost_tok_per_device_s`` = (tokens_out or, when 0, tokens_in) / device_s: throughput per device.
    """
    work = tokens_out or tokens_in
    return {
        "cost_device": kind,
        "cost_basis": basis,
        "cost_devices": int(devices),
        "cost_device_s": round(float(device_s), 3),
        "cost_wall_s": round(float(wall_s), 3),
        "cost_tokens_in": int(tokens_in),
        "cost_tokens_out": int(tokens_out),
        "cost_tok_per_device_s": round(work / device_s, 2) if device_s > 0 else 0.0,
    }


def device_cost(device: str, wall_s: float, tokens_in: int, tokens_out: int = 0, processes: int = 1) -> dict:
    """:func:`cost_metadata` of work on torch ``device`` for ``wall_s`` seconds: devices x wall."""
    kind, n, basis = torch_device(device, processes)
    return cost_metadata(kind, n, basis, n * wall_s, wall_s, tokens_in, tokens_out)


@dataclass
class CpuClock:
    """Wall and process CPU time of a block: ``with CpuClock() as clock: ...; clock.metadata(tokens)``."""

    wall_s: float = 0.0
    cpu_s: float = 0.0
    _start: tuple[float, float] = field(default=(0.0, 0.0), repr=False)

    def __enter__(self) -> CpuClock:
        self._start = (time.monotonic(), time.process_time())
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.monotonic() - self._start[0]
        self.cpu_s = time.process_time() - self._start[1]

    def metadata(self, tokens_in: int, tokens_out: int = 0) -> dict:
        """:func:`cost_metadata` with the block's process CPU time (all threads) as the device-seconds."""
        return cost_metadata(CPU, 1, PROCESS_CPU, self.cpu_s, self.wall_s, tokens_in, tokens_out)


@dataclass
class GenerationMeter:
    """Device-seconds of a completions run, split between its partitions by commit.

    A partition's share is the devices x the wall time from the previous commit (or from the moment the
    servers were up and the client started) to its own commit: the shares of a run add up to devices x
    its wall time while generating, start-up excluded (``startup_s`` records it), so the table's sum is
    exact even though one partition's share depends on when its neighbours finished."""

    kind: str
    devices: int
    basis: str
    startup_s: float = 0.0
    _mark: float | None = None

    def share(self, now: float, generation_started: float | None) -> tuple[float, float]:
        """``(device_s, wall_s)`` of the partition committed at monotonic time ``now``; zeros when no
        generation ran (``generation_started`` None: every row kept or cut locally)."""
        if generation_started is None:
            return 0.0, 0.0
        start = generation_started if self._mark is None else max(self._mark, generation_started)
        self._mark = now
        wall = max(0.0, now - start)
        return self.devices * wall, wall

    def metadata(self, now: float, generation_started: float | None, rows: list[dict]) -> dict:
        """The partition's ``cost_*`` metadata from this run's ``rows`` (token counts and latency), plus
        ``cost_rows`` / ``cost_slot_s`` / ``cost_slot_s_sq`` / ``cost_tokens_out_sq`` (sums over rows for
        the forecast's intervals) and ``cost_startup_s`` (the servers' start-up before generating)."""
        device_s, wall = self.share(now, generation_started)
        ok = [r for r in rows if not r.get("error")]
        made = [(r.get("completion_tokens") or 0) - (r.get("continued_from_tokens") or 0) for r in ok]
        slots = [float(r.get("latency_s") or 0.0) for r in ok]
        tokens_in = sum(r.get("prompt_tokens") or 0 for r in ok)
        return {
            **cost_metadata(self.kind, self.devices, self.basis, device_s, wall, tokens_in, sum(made)),
            "cost_rows": len(ok),
            "cost_tokens_out_sq": float(sum(t * t for t in made)),
            "cost_slot_s": round(sum(slots), 4),
            "cost_slot_s_sq": round(sum(s * s for s in slots), 4),
            "cost_startup_s": round(self.startup_s, 3),
        }


def evaluation_cost(plan, inference, device: str, wall_s: float, metadata: dict | None = None) -> dict:
    """``cost_*`` metadata of a ``drafter_evaluation`` run of ``wall_s`` seconds: the inference servers x wall
    when an engine plan (``plan``) served the drafter, else the target's torch ``device`` x wall (in
    process). Tokens: the run's generated tokens when its metadata counts them (``generated_tokens``)."""
    out = int((metadata or {}).get("generated_tokens") or 0)
    if plan is not None and getattr(plan, "kind", "") != "vllm":  # vLLM runs on the target's device, one server
        kind, n, basis = generation_devices(inference)
        return cost_metadata(kind, n, basis.replace(" while generating", ""), n * wall_s, wall_s, 0, out)
    return device_cost(device, wall_s, 0, out)
