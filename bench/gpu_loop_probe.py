"""What the loop bench reads inside the product's Ray actors while `train.run_on` drives them.

`install` runs inside a role's process (through Ray's `__ray_call__`, so the roles need no
bench method): it wraps the rank's backend (forward, train, offload, onload) or engine
(generate, sleep, wake_up) so that every call leaves a record: the call's seconds (device work
included), the bytes and copy seconds of a transfer (the backend's own `last_transfer`; the
optimizer state's copy that a training pass runs beside it as "optimizer_onload"), the
FLOPs of a pass (from the batch it was given) and the device memory the process had allocated
and reserved at its peak since the role last woke. `collect` hands the records back with the
process id and its resident host memory. The wrappers only time and read; they change nothing
the product computes. `summarize` (pure) turns the records of every process into the figures.
"""

from __future__ import annotations

import os
import time

from gpu_workloads import forward_flops

TRAIN_METHODS = ("forward", "train", "offload", "onload", "offload_optimizer_state")
ENGINE_METHODS = ("generate", "sleep", "wake_up")
WAKING = ("onload", "wake_up")
PARKING = ("offload", "sleep", "offload_optimizer_state")
TRANSFERS = {"offload": "to_host", "sleep": "to_host", "onload": "to_device", "wake_up": "to_device",
             "optimizer_onload": "to_device", "offload_optimizer_state": "to_host"}
"""Each transfer's direction; "optimizer_onload" is the optimizer state's copy that `train` runs beside its passes."""


def _role_of(worker) -> str:
    return "rollout" if hasattr(worker, "engine") else worker.role


def install(worker, configs: dict[str, dict], weights_group_backend: str | None = None) -> tuple[str, int]:
    """Wrap `worker`'s backend or engine (`configs`: each role's model shape, for the FLOPs); on the
    actor, also time the values handoff (`gather_values`: the critic's rows picked by sample id).
    `weights_group_backend` replaces the weight-update group's backend of actor rank 0 (the
    one-GPU Disaggregated run: NCCL refuses two ranks on one device, so gloo). Returns (role, pid)."""
    import torch

    role = _role_of(worker)
    config = configs[role]
    target = worker.engine if role == "rollout" else worker.backend
    cuda = torch.cuda.is_available() and str(getattr(target, "device", "cuda")).startswith("cuda")
    records: list[dict] = []
    worker._bench_records = records

    def wrap(method: str) -> None:
        inner = getattr(target, method)

        def timed(*args, **kwargs):
            if cuda:
                torch.cuda.synchronize()
                if method in WAKING:
                    torch.cuda.reset_peak_memory_stats()
            before = getattr(target, "last_transfer", None)
            started = time.perf_counter()
            result = inner(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
            record = {"role": role, "method": method, "seconds": time.perf_counter() - started, "time": time.time()}
            transfer = getattr(target, "last_transfer", None)
            if method in TRANSFERS and transfer is not None and transfer is not before:  # a no-op moved nothing
                record |= {"bytes": transfer["bytes"], "copy_seconds": transfer["seconds"]}
                if method in WAKING:
                    record["path"] = transfer.get("path")
            if method == "train" and transfer is not before and (transfer or {}).get("beside_compute"):
                records.append({"role": role, "method": "optimizer_onload", "seconds": transfer["seconds"],
                                "time": time.time(), "bytes": transfer["bytes"], "copy_seconds": transfer["seconds"]})
            if method in ("forward", "train") and args:
                batch = args[0]
                passes = 3 if method == "train" else 1  # a backward pass costs two forwards
                record["flops"] = passes * forward_flops(config, attention_mask=batch.attention_mask,
                                                         response_mask=batch.response_mask, policy=role != "critic")
            if method == "generate":
                record["tokens"] = int(result.response_mask.sum())
                record["timing"] = dict(getattr(target, "last_timing", {}))
            if cuda:
                record["peak_allocated"] = torch.cuda.max_memory_allocated()
                record["peak_reserved"] = torch.cuda.max_memory_reserved()
                record["reserved"] = torch.cuda.memory_reserved()
            records.append(record)
            return result

        setattr(target, method, timed)

    for method in ENGINE_METHODS if role == "rollout" else TRAIN_METHODS:
        wrap(method)
    if role == "actor":
        from ppo_trainer.roles import actor as actor_module

        inner_gather = actor_module.gather_values

        def timed_gather(*args, **kwargs):
            started = time.perf_counter()
            result = inner_gather(*args, **kwargs)
            records.append({"role": role, "method": "gather_values", "seconds": time.perf_counter() - started,
                            "time": time.time()})
            return result

        actor_module.gather_values = timed_gather
    group = getattr(getattr(worker, "sender", None), "group", None)  # the broadcast path's, on actor rank 0
    if weights_group_backend and group is not None:
        connected = group.connected
        group.disconnect()
        group.backend = weights_group_backend
        if connected:
            group.connect()
    return role, os.getpid()


def collect(worker) -> dict:
    """The records since the last collect, this process's id, role, resident host memory and the
    seconds it has spent compiling."""
    import psutil
    import torch

    from ppo_trainer.compile_cache import compile_seconds

    records, worker._bench_records[:] = list(worker._bench_records), []
    out = {"role": _role_of(worker), "pid": os.getpid(), "records": records,
           "rss_bytes": psutil.Process().memory_info().rss, "compile_seconds": compile_seconds()}
    if torch.cuda.is_available():
        out["reserved_now"] = torch.cuda.memory_reserved()
        out["allocated_now"] = torch.cuda.memory_allocated()
    return out


def summarize(processes: list[dict], *, ceiling_tflops: float | None, pinned: dict | None, steps: int,
              sm_clock: list[tuple[float, float]] = ()) -> dict:
    """Per-step figures from every process's records over `steps` steps (the measured ones):
    training passes' share of the bf16 ceiling, generation tokens/s, each transfer's bandwidth
    (bytes over the copy's own device time) against the pinned copy of the same direction (a wake's
    apart by the path it took: "actor onload by cores", "actor onload by engines"), the
    peak device memory each role reached awake, and the bytes each role's measured offloads parked in
    host memory (a role whose offloads copy nothing, such as the reference after its first, counts none).
    `sm_clock`: (wall time, MHz) samples of the GPU's SM clock; their mean while generating and while
    in a training pass (a hot or power-capped GPU runs slower clocks)."""
    records = [r for p in processes for r in p["records"]]
    out: dict = {"passes": {}, "transfers": {}, "peak_awake_bytes": {}, "parked_bytes": {}}
    passes = [r for r in records if "flops" in r]
    for r in passes:
        entry = out["passes"].setdefault(f"{r['role']} {r['method']}", {"seconds": 0.0, "flops": 0.0, "calls": 0})
        entry["seconds"] += r["seconds"] / steps
        entry["flops"] += r["flops"] / steps
        entry["calls"] += 1
    if passes and ceiling_tflops:
        for entry in out["passes"].values():
            entry["mfu"] = entry["flops"] / entry["seconds"] / (ceiling_tflops * 1e12)
        out["training_mfu"] = (sum(r["flops"] for r in passes) / sum(r["seconds"] for r in passes)
                               / (ceiling_tflops * 1e12))
    generated = [r for r in records if r["method"] == "generate"]
    if generated:
        out["generate_seconds"] = sum(r["seconds"] for r in generated) / steps
        out["generate_tokens_per_s"] = sum(r["tokens"] for r in generated) / sum(r["seconds"] for r in generated)
        for part in ("prefill_seconds", "decode_seconds", "graphs_captured"):  # the engine's own timing
            values = [r["timing"][part] for r in generated if part in r.get("timing", {})]
            if values:
                out[part] = sum(values) / steps
    gathered = [r for r in records if r["method"] == "gather_values"]
    if gathered:
        out["values_handoff_seconds"] = sum(r["seconds"] for r in gathered) / steps
    parked: dict[tuple[str, str], int] = {}
    for r in (r for r in records if "bytes" in r and r["bytes"] > 0):
        name = f"{r['role']} {r['method']}" + (f" by {r['path']}" if r.get("path") else "")
        entry = out["transfers"].setdefault(name,
                                            {"bytes": r["bytes"], "seconds": 0.0, "copy_seconds": 0.0, "calls": 0})
        entry["seconds"] += r["seconds"]
        entry["copy_seconds"] += r["copy_seconds"]
        entry["calls"] += 1
        if r["method"] in PARKING:  # a role's largest park of each kind: the optimizer state may leave on its own
            parked[r["role"], r["method"]] = max(parked.get((r["role"], r["method"]), 0), r["bytes"])
    for (role, _), size in parked.items():
        out["parked_bytes"][role] = out["parked_bytes"].get(role, 0) + size
    for name, entry in out["transfers"].items():
        moved = entry["bytes"] * entry["calls"]
        entry["gb_per_s"] = moved / entry["copy_seconds"] / 1e9 if entry["copy_seconds"] > 0 else 0.0
        entry["whole_call_gb_per_s"] = moved / entry["seconds"] / 1e9
        if pinned:
            entry["share_of_pinned"] = entry["gb_per_s"] / pinned[TRANSFERS[name.split()[1]]]
    for r in (r for r in records if "peak_reserved" in r):
        peak = out["peak_awake_bytes"].setdefault(r["role"], {"allocated": 0, "reserved": 0})
        peak["allocated"] = max(peak["allocated"], r["peak_allocated"])
        peak["reserved"] = max(peak["reserved"], r["peak_reserved"])
    out["parked_bytes_total"] = sum(out["parked_bytes"].values())
    out["sm_clock_mhz"] = {name: mean_during(sm_clock, chosen) for name, chosen in
                           (("generate", generated), ("training passes", passes))}
    return out


def mean_during(samples: list[tuple[float, float]], records: list[dict]) -> float | None:
    """The mean of the (wall time, value) samples taken inside the records' calls (a record's
    call ends at its "time" and lasted its "seconds"); None when none falls inside."""
    inside = [value for at, value in samples
              if any(r["time"] - r["seconds"] <= at <= r["time"] for r in records)]
    return sum(inside) / len(inside) if inside else None
