"""A host-to-device copy into device memory that another process has just released.

Roles that take turns on one GPU hand device memory from process to process (the engine sleeps,
the actor wakes). The driver clears memory a process releases before another may use it; this
times a pinned copy of `--gb` GB into freshly allocated memory right after another process
released `--released` GB, after a pause, after zeroing it first, and by the GPU's cores
(`kernel_copy.copy_from_host`, one of the roles' wakes' two paths) instead of the copy engines, against
the same copy into memory already in use (the pinned ceiling). `python3 bench/gpu_memory_handover.py`
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("trainer", "api")]
from ppo_trainer.offload.host_mirror import pinned_empty
from ppo_trainer.offload.kernel_copy import copy_from_host


def copy_ms(device: torch.Tensor, host: torch.Tensor, *, by_kernel: bool = False) -> float:
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    if by_kernel:
        copy_from_host(device, host)
    else:
        device.copy_(host, non_blocking=True)
    end.record()
    end.synchronize()
    return begin.elapsed_time(end)


def release_in_another_process(gb: float) -> None:
    code = f"import torch; x = torch.ones({int(gb * 1e9)}, dtype=torch.uint8, device='cuda'); torch.cuda.synchronize()"
    subprocess.run([sys.executable, "-c", code], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=6.0, help="bytes copied (a 3B model's bf16 weights: 6.2 GB)")
    parser.add_argument("--released", default="10,40", help="GB the other process allocates and releases")
    parser.add_argument("--pause", type=float, default=0.5)
    args = parser.parse_args()
    size = int(args.gb * 1e9)
    host = pinned_empty(size, torch.uint8)
    host.fill_(1)
    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    copy_ms(device, host)
    ceiling = min(copy_ms(device, host) for _ in range(3))
    copy_ms(device, host, by_kernel=True)
    by_kernel = min(copy_ms(device, host, by_kernel=True) for _ in range(3))
    del device
    torch.cuda.empty_cache()
    print(f"{args.gb:g} GB into memory in use: {ceiling:.1f} ms, {size / ceiling / 1e6:.1f} GB/s; by the cores"
          f" {by_kernel:.1f} ms, {ceiling / by_kernel:.0%} of the ceiling", flush=True)

    def case(label: str, released: float, *, zero: bool = False, pause: float = 0.0, kernel: bool = False) -> None:
        release_in_another_process(released)
        time.sleep(pause)
        target = torch.empty(size, dtype=torch.uint8, device="cuda")
        if zero:
            target.zero_()
        ms = copy_ms(target, host, by_kernel=kernel)
        print(f"another process released {released:g} GB; {label:<22} {ms:6.1f} ms, {size / ms / 1e6:5.1f} GB/s,"
              f" {ceiling / ms:4.0%} of the ceiling", flush=True)
        del target
        torch.cuda.empty_cache()

    for released in (float(g) for g in args.released.split(",")):
        case("copied at once", released)
        case("zeroed first", released, zero=True)
        case(f"copied {args.pause:g} s later", released, pause=args.pause)
        case("copied by the cores", released, kernel=True)

if __name__ == "__main__":
    main()
