"""Colocated weight sync between two Ray actors sharing one GPU: Ray's object store against CUDA IPC.

The sender holds weights of the Qwen2.5-0.5B shape (bf16, about 1 GB in 290 tensors) on the GPU;
the receiver copies them into its own GPU tensors. "object store": the sender returns CPU copies
through Ray (what the product did before); "cuda ipc": the sender returns CUDA IPC handles
(`weight_sync/cuda_ipc.py`) and the receiver copies device to device. Median of 5 after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import ray
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "trainer"), str(ROOT / "api")]


def qwen_like_shapes() -> list[tuple[str, tuple[int, ...]]]:
    h, ffn, kv, layers, vocab = 896, 4864, 128, 24, 151936
    shapes = [("model.embed_tokens.weight", (vocab, h)), ("model.norm.weight", (h,))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.q_proj.bias", (h,)),
                   (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.k_proj.bias", (kv,)),
                   (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.v_proj.bias", (kv,)),
                   (p + "self_attn.o_proj.weight", (h, h)), (p + "mlp.gate_proj.weight", (ffn, h)),
                   (p + "mlp.up_proj.weight", (ffn, h)), (p + "mlp.down_proj.weight", (h, ffn)),
                   (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    return shapes


@ray.remote(num_gpus=0.5)
class Sender:
    def __init__(self) -> None:
        self.weights = {n: torch.randn(s, device="cuda", dtype=torch.bfloat16) for n, s in qwen_like_shapes()}
        self.kept: list = []

    def cpu_copies(self) -> dict:
        return {n: t.to("cpu", copy=True) for n, t in self.weights.items()}

    def share(self):
        from ppo_trainer.weight_sync.cuda_ipc import share_weights

        shared, self.kept = share_weights(self.weights.items(), "cuda")
        return shared

    def release(self) -> None:
        self.kept = []
        torch.cuda.ipc_collect()

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.weights.values())


@ray.remote(num_gpus=0.5)
class Receiver:
    def __init__(self) -> None:
        self.weights = {n: torch.empty(s, device="cuda", dtype=torch.bfloat16) for n, s in qwen_like_shapes()}

    def take(self, named: dict) -> None:
        for name, tensor in named.items():
            self.weights[name].copy_(tensor, non_blocking=True)
        torch.cuda.synchronize()

    def take_shared(self, shared) -> None:
        from ppo_trainer.weight_sync.cuda_ipc import open_shared_weights

        for name, tensor in open_shared_weights(shared, "cuda"):
            self.weights[name].copy_(tensor)
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "trainer"), str(ROOT / "api"),
                                                           os.environ.get("PYTHONPATH", "")) if p)
    ray.init(num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False)
    sender, receiver = Sender.remote(), Receiver.remote()
    size = ray.get(sender.nbytes.remote())

    def object_store() -> None:
        ray.get(receiver.take.remote(sender.cpu_copies.remote()))

    def cuda_ipc() -> None:
        try:
            ray.get(receiver.take_shared.remote(sender.share.remote()))
        finally:
            ray.get(sender.release.remote())

    results = {"bytes": size}
    for name, fn in (("object store", object_store), ("cuda ipc", cuda_ipc)):
        times = []
        for _ in range(6):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        seconds = statistics.median(times[1:])
        results[name] = {"seconds": seconds, "gb_per_s": size / seconds / 1e9, "first_seconds": times[0]}
        print(f"{name:13} {seconds * 1e3:8.1f} ms  {size / seconds / 1e9:6.1f} GB/s  (first call {times[0]:.2f} s)",
              flush=True)
    print(f"{size / 1e9:.2f} GB of weights; cuda ipc is {results['object store']['seconds'] / results['cuda ipc']['seconds']:.0f}x faster")
    (args.out / "weight_sync.json").write_text(json.dumps(results, indent=1))
    ray.shutdown()


if __name__ == "__main__":
    main()
