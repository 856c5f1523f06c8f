"""The training passes of a PPO step alone, backend by backend and variant by variant, on one GPU.

What `gpu_ppo_step.py` times as "actor log-probs" and "actor train", isolated so that the
choices behind them can be compared in one run: each backend eager or compiled (`compile`), a
larger micro-batch ("mb64", training and no-grad passes), and the output layer's logits recomputed
in the backward instead of kept ("recompute"). The batch is the step's shape
(Qwen2.5-0.5B shape, 256 rows of ~100 prompt + 512 response tokens, random tokens); no rollout.
Each pass runs twice and the second is timed. `--profile` prints the top CUDA kernels of one
eager training micro-batch. Writes passes.json into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_ppo_step import EOS, bf16_ceiling, forward_flops, make_checkpoint, make_prompts, sync

from ppo_trainer.algorithms.ppo import masked_mean
from ppo_trainer.rollout.base import Generation
from ppo_trainer.rollout.layout import build_rollout_batch
from ppojob_api.spec import ModelSpec

VARIANTS = {
    "torch eager": {"backend": "Torch", "compile": False},
    "torch eager mb64": {"backend": "Torch", "compile": False, "micro_batch_size": 64},
    "torch compiled": {"backend": "Torch", "compile": True},
    "megatron eager": {"backend": "Megatron", "compile": False},
    "megatron compiled": {"backend": "Megatron", "compile": True},
    "torch compiled mb64": {"backend": "Torch", "compile": True, "micro_batch_size": 64},
    "megatron compiled mb64": {"backend": "Megatron", "compile": True, "micro_batch_size": 64},
    # the output layer's logits recomputed in the backward instead of kept (KEPT_LOGITS_SHARE)
    "torch compiled mb64 recompute": {"backend": "Torch", "compile": True, "micro_batch_size": 64,
                                      "kept_logits_bytes": 0},
    "megatron compiled mb64 recompute": {"backend": "Megatron", "compile": True, "micro_batch_size": 64,
                                         "kept_logits_bytes": 0},
}


def synthetic_batch(rows: int, prompt_length: int, response_length: int):
    prompts = make_prompts(rows, prompt_length, seed=0)
    generator = torch.Generator().manual_seed(1)
    generation = Generation(
        response_tokens=torch.randint(0, 150_000, (rows, response_length), generator=generator),
        response_mask=torch.ones(rows, response_length),
        log_probs=torch.zeros(rows, response_length),
    )
    return build_rollout_batch(prompts, generation, torch.zeros(rows), EOS)


def build(variant: dict, model_spec: ModelSpec):
    common = {"model_spec": model_spec, "role": "actor", "learning_rate": 1e-6, "max_grad_norm": 1.0,
              "device": "cuda", "seed": 1, "dtype": "bfloat16",
              "forward_micro_batch_size": variant.get("micro_batch_size", 32)}
    if variant["backend"] == "Megatron":
        from ppo_trainer.backends.megatron.backend import MegatronBackend as Backend
    else:
        from ppo_trainer.backends.torch_backend import TorchBackend as Backend
    backend = Backend(**common, compile=variant["compile"])
    if "kept_logits_bytes" in variant:
        backend.kept_logits_bytes = variant["kept_logits_bytes"]
    return backend


def policy_loss_fn(batch):
    def loss_fn(outputs, rows):
        mask = batch.response_mask[rows].to(outputs["log_probs"].device)
        loss = -masked_mean(outputs["log_probs"], mask) - 0.01 * masked_mean(outputs["entropy"], mask)
        return loss, {}
    return loss_fn


def timed(fn) -> tuple[float, float]:
    """(first call seconds, second call seconds)."""
    out = []
    for _ in range(2):
        sync()
        started = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - started)
    return out[0], out[1]


def profile_train_micro_batch(backend, batch, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    small = batch.shard(0, batch.size // rows)
    backend.train(small, policy_loss_fn(small), micro_batch_size=rows)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        backend.train(small, policy_loss_fn(small), micro_batch_size=rows)
        sync()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)


def measure(variant: dict, model_spec: ModelSpec, batch, flops: float, ceiling: float, micro_batch_size: int,
            *, profile: bool) -> dict:
    built = time.perf_counter()
    backend = build(variant, model_spec)
    build_seconds = time.perf_counter() - built
    forward = timed(lambda: backend.forward(batch))
    micro_batch_size = variant.get("micro_batch_size", micro_batch_size)
    train = timed(lambda: backend.train(batch, policy_loss_fn(batch), micro_batch_size=micro_batch_size))
    entry = {
        "build_seconds": build_seconds, "forward_first": forward[0], "forward": forward[1],
        "train_first": train[0], "train": train[1],
        "forward_mfu": flops / forward[1] / (ceiling * 1e12),
        "train_mfu": 3 * flops / train[1] / (ceiling * 1e12),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    if profile:
        print(profile_train_micro_batch(backend, batch, micro_batch_size), flush=True)
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ceiling = bf16_ceiling()
    checkpoint = Path(tempfile.mkdtemp()) / "qwen2.5-0.5b-random"
    make_checkpoint(checkpoint, seed=0)
    model_spec = ModelSpec(path=str(checkpoint), dtype="bfloat16")
    batch = synthetic_batch(256, 100, 512)
    flops = forward_flops(batch, policy=True)
    results = {"ceiling_tflops": ceiling, "forward_tflop": flops / 1e12, "variants": {}}
    for name in args.variants.split(","):
        variant = VARIANTS[name]
        try:
            entry = measure(variant, model_spec, batch, flops, ceiling, args.micro_batch_size,
                            profile=args.profile and name == "torch eager")
        except Exception as exc:  # noqa: BLE001 - one variant failing must not hide the others' figures
            entry = {"error": f"{type(exc).__name__}: {exc}"}
        results["variants"][name] = entry
        print(f"{name}: {json.dumps(entry)}", flush=True)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        (args.out / "passes.json").write_text(json.dumps(results, indent=1))
    print(f"ceiling {ceiling:.0f} TFLOP/s; one forward = {flops / 1e12:.1f} TFLOP")
    for name, entry in results["variants"].items():
        if "error" in entry:
            print(f"{name:40} {entry['error']}")
        else:
            print(f"{name:40} forward {entry['forward']:.3f}s mfu {entry['forward_mfu']:.0%}   "
                  f"train {entry['train']:.3f}s mfu {entry['train_mfu']:.0%}   "
                  f"(first {entry['forward_first']:.1f}/{entry['train_first']:.1f}s)")


if __name__ == "__main__":
    main()
