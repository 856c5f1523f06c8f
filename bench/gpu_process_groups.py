"""What a Megatron role's process groups cost around a sleep, on one GPU (a world of one rank).

Builds the default group and megatron's model-parallel groups as a waking role does, runs one
collective on each group a model would use (NCCL builds a communicator per group at its first
collective), then tears them down as a sleeping role does; three cycles, with megatron's groups
as it builds them (gloo twins included), with no gloo twins and groups of the same ranks merged
(`merge_groups_of_the_same_ranks`: what the Megatron backend does), and that with the destroy
on a thread (`Teardown`, what a sleeping role does) while the role's offload copies 2 GiB to
pinned host memory, against the same copy alone. Prints, per cycle, the seconds of each part and
the GPU memory the communicators held; writes process_groups.json into --out.

    python3 bench/gpu_process_groups.py --out $OUT/groups
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT.parent / "trainer"), str(ROOT.parent / "api")]

from megatron.core import parallel_state

from ppo_trainer.distributed import Teardown, merge_groups_of_the_same_ranks


def used_groups() -> dict[str, dist.ProcessGroup]:
    """The groups a GPT model, its DDP and its optimizer reach for."""
    ps = parallel_state
    return {"world": dist.group.WORLD, "data": ps.get_data_parallel_group(),
            "data+context": ps.get_data_parallel_group(with_context_parallel=True),
            "tensor": ps.get_tensor_model_parallel_group(), "model": ps.get_model_parallel_group(),
            "pipeline": ps.get_pipeline_model_parallel_group(), "embedding": ps.get_embedding_group()}


def free_mib() -> float:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / 2**20


def offload_copy(device: torch.Tensor, host: torch.Tensor) -> float:
    """Seconds to copy `device` into pinned `host` (a sleeping role's offload)."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    host.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - started


def cycles(variant: str, count: int) -> list[dict]:
    weights = torch.ones(1 << 29, device="cuda")  # 2 GiB
    parked = torch.empty(weights.shape, dtype=weights.dtype, pin_memory=True)
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
    probe = torch.ones(1 << 20, device="cuda")
    out = []
    for n in range(count):
        before = free_mib()
        started = time.perf_counter()
        dist.init_process_group("nccl", store=dist.PrefixStore(f"{variant}/{n}/", store), rank=0, world_size=1)
        as_built = variant == "as built"
        parallel_state.initialize_model_parallel(1, 1, order="tp-cp-ep-pp-dp", create_gloo_process_groups=as_built)
        if not as_built:
            merge_groups_of_the_same_ranks(parallel_state)
        built = time.perf_counter()
        groups = used_groups()
        for group in groups.values():
            dist.all_reduce(probe, group=group)
        torch.cuda.synchronize()
        first_collectives = time.perf_counter()
        held = before - free_mib()
        copy_alone_s = offload_copy(weights, parked)
        teardown = time.perf_counter()
        parallel_state.destroy_model_parallel()
        threaded = {}
        if variant == "merged, on a thread":
            destroying = Teardown(dist.destroy_process_group, name="bench teardown")
            returned = time.perf_counter()
            threaded["copy_beside_destroy_s"] = offload_copy(weights, parked)
            waited = time.perf_counter()
            destroying.join()
            threaded["join_wait_s"] = time.perf_counter() - waited
            threaded["copy_alone_s"] = copy_alone_s
            done = returned
        else:
            dist.destroy_process_group()
            done = time.perf_counter()
        out.append({"variant": variant, "cycle": n, "build_s": built - started,
                    "first_collectives_s": first_collectives - built, "destroy_s": done - teardown, **threaded,
                    "communicators": len({id(g) for g in groups.values()}), "held_mib": held,
                    "released_mib": free_mib() - (before - held)})
        print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cycles", type=int, default=3)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.cuda.set_device(0)
    print(f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}", flush=True)
    runs = [row for variant in ("as built", "merged", "merged, on a thread") for row in cycles(variant, args.cycles)]
    (args.out / "process_groups.json").write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
