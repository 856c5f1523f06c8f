"""What a Megatron role's process groups cost around a sleep, on one GPU (a world of one rank).

Builds the default group and megatron's model-parallel groups as a waking role does, runs one
collective on each group a model would use (NCCL builds a communicator per group at its first
collective), then tears them down as a sleeping role does; three cycles, with megatron's groups
as it builds them and with groups of the same ranks merged (`merge_groups_of_the_same_ranks`,
what the Megatron backend does). Prints, per cycle, the seconds of each part and the GPU memory
the communicators held; writes process_groups.json into --out.

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

from ppo_trainer.distributed import merge_groups_of_the_same_ranks


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


def cycles(variant: str, count: int) -> list[dict]:
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
    probe = torch.ones(1 << 20, device="cuda")
    out = []
    for n in range(count):
        before = free_mib()
        started = time.perf_counter()
        dist.init_process_group("nccl", store=dist.PrefixStore(f"{variant}/{n}/", store), rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1, order="tp-cp-ep-pp-dp")
        if variant == "merged":
            merge_groups_of_the_same_ranks(parallel_state)
        built = time.perf_counter()
        groups = used_groups()
        for group in groups.values():
            dist.all_reduce(probe, group=group)
        torch.cuda.synchronize()
        first_collectives = time.perf_counter()
        held = before - free_mib()
        teardown = time.perf_counter()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        done = time.perf_counter()
        out.append({"variant": variant, "cycle": n, "build_s": built - started,
                    "first_collectives_s": first_collectives - built, "destroy_s": done - teardown,
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
    runs = [row for variant in ("as built", "merged") for row in cycles(variant, args.cycles)]
    (args.out / "process_groups.json").write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
