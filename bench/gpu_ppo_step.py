"""PPO steps on one GPU, stage by stage, for the Torch and Megatron backends side by side.

The workload of the GPU issue: a Qwen2.5-0.5B-shaped model with random weights, 256 prompts of
about 100 tokens, up to 512 new tokens, critic and reference on, train-side and rollout offload
on. The step follows train.py's schedule with the product's role classes (ActorWorker,
CriticWorker, RefWorker: their losses, targets, turns and offload), run IN ONE PROCESS, without
Ray: generate (TorchRolloutEngine) -> rollout sleeps -> actor and reference log-probs -> critic
values and training -> actor training on the critic's output -> weight sync (GPU to GPU). The
values handoff through Ray (what the product pays) is measured separately with two Ray actors
when Ray is importable. The same run measures the ceilings: an 8192^3 bf16 matmul and pinned
host<->device copies. Writes bench.json and bench.txt (a table) into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "trainer"), str(ROOT / "api")]

from ppo_trainer.roles.actor import ActorWorker
from ppo_trainer.roles.critic import CriticWorker
from ppo_trainer.roles.handoff import CriticValues
from ppo_trainer.roles.ref import RefWorker
from ppo_trainer.rollout.base import SamplingParams
from ppo_trainer.rollout.layout import build_rollout_batch
from ppo_trainer.rollout.torch_engine import TorchRolloutEngine
from ppojob_api.spec import PPOJobSpec

sys.path.insert(0, str(ROOT / "bench"))
from gpu_workloads import EOS, MODELS
from gpu_workloads import forward_flops as workload_flops

QWEN2_5_0_5B = MODELS["qwen2.5-0.5b"]
PUBLISHED_STEP_SECONDS = 65.0
TARGETS = {"step_s": 8.0, "gen_tok_s": 40_000, "train_mfu": 0.45, "offload_share": 0.80, "handoff_share": 0.02}


def sync() -> None:
    """Wait for the device's queued work (nothing to wait for while CUDA is unused: a CPU run)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def bf16_ceiling(n: int = 8192, repeats: int = 20) -> float:
    """TFLOP/s of an n^3 bf16 matmul (best of `repeats` after a warm-up)."""
    a, b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16), torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - started)
    return 2 * n**3 / best / 1e12


def bf16_sustained(ceiling_tflops: float, n: int = 8192, seconds: float = 5.0) -> float:
    """TFLOP/s of n^3 bf16 matmuls back to back for about `seconds` (their count from `bf16_ceiling`'s
    rate): the clock that a long run of matmuls holds under the GPU's power limit, where one short
    matmul meets the clock's maximum. Training passes run at the former."""
    a, b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16), torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    count = max(1, int(seconds * ceiling_tflops * 1e12 / (2 * n**3)))
    sync()
    started = time.perf_counter()
    for _ in range(count):
        a @ b
    sync()
    return count * 2 * n**3 / (time.perf_counter() - started) / 1e12


def pinned_bandwidth(gib: float = 1.0, repeats: int = 5) -> dict[str, float]:
    """GB/s of one pinned host <-> device copy each way (median)."""
    n = int(gib * 2**30)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(n, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("to_device", device, host), ("to_host", host, device)):
        times = []
        for _ in range(repeats):
            sync()
            started = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            sync()
            times.append(time.perf_counter() - started)
        out[name] = n / statistics.median(times) / 1e9
    return out


def make_checkpoint(directory: Path, seed: int, config: dict = QWEN2_5_0_5B) -> None:
    """A Hugging Face directory of a Qwen2 model of `config`'s shape, random bf16 weights drawn from `seed`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # the CPU for the loop bench's dry run
        model = Qwen2ForCausalLM(Qwen2Config(**config))
    model.to(torch.bfloat16).save_pretrained(str(directory))
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_prompts(count: int, mean_length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(mean_length - 10, mean_length + 11, (count,), generator=generator)
    return [torch.randint(0, 150_000, (int(n),), generator=generator).tolist() for n in lengths]


def forward_flops(batch, *, policy: bool) -> float:
    """Model FLOPs of one forward pass over the batch's real tokens (`gpu_workloads.forward_flops`)."""
    return workload_flops(QWEN2_5_0_5B, attention_mask=batch.attention_mask, response_mask=batch.response_mask,
                          policy=policy)


class Recorder:
    """Wraps methods so that each call's seconds (device work included) land in `records`."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def wrap(self, obj, method: str, stage: str, *, transfer_of=None) -> None:
        inner = getattr(obj, method)

        def timed(*args, **kwargs):
            before = getattr(transfer_of, "last_transfer", None)
            sync()
            started = time.perf_counter()
            result = inner(*args, **kwargs)
            sync()
            record = {"stage": stage, "seconds": time.perf_counter() - started}
            if transfer_of is not None and transfer_of.last_transfer is not before:  # a no-op moved nothing
                record["bytes"] = transfer_of.last_transfer["bytes"]
                record["copy_seconds"] = transfer_of.last_transfer["seconds"]
            self.records.append(record)
            return result

        setattr(obj, method, timed)


def run_backend(kind: str, spec: PPOJobSpec, prompts: list[list[int]], steps: int, *, device: str = "cuda") -> dict:
    """`steps` PPO steps of backend `kind` in this process; `device` "cpu": the wiring's dry run (Torch)."""
    spec = spec.model_copy(update={"actor": spec.actor.model_copy(update={"backend": kind})})
    recorder = Recorder()
    built = time.perf_counter()
    engine = TorchRolloutEngine(model_spec=spec.model, device=device, seed=spec.seed, dtype=spec.model.dtype,
                                eos_token_id=EOS, pad_token_id=EOS)
    common = {"rank": 0, "world_size": 1, "device": device, "offload": True, "shared_process": True}
    actor, critic, ref = ActorWorker(spec, **common), CriticWorker(spec, **common), RefWorker(spec, **common)
    build_seconds = time.perf_counter() - built
    for worker, name in ((actor, "actor"), (critic, "critic"), (ref, "ref")):
        forward = {"actor": "actor log-probs", "critic": "critic values", "ref": "ref log-probs"}[name]
        recorder.wrap(worker.backend, "forward", forward)
        recorder.wrap(worker.backend, "train", f"{name} train")
        recorder.wrap(worker.backend, "offload", f"{name} offload", transfer_of=worker.backend)
        recorder.wrap(worker.backend, "onload", f"{name} onload", transfer_of=worker.backend)
    recorder.wrap(engine, "generate", "generate")
    recorder.wrap(engine, "sleep", "rollout sleep", transfer_of=engine)
    recorder.wrap(engine, "wake_up", "rollout wake", transfer_of=engine)
    params = SamplingParams(max_new_tokens=spec.rollout.max_new_tokens, temperature=spec.rollout.temperature)
    results = []
    for step in range(steps):
        recorder.records.clear()
        started = time.perf_counter()
        engine.wake_up()
        generation = engine.generate(prompts, dataclasses.replace(params, seed=step))
        timing = dict(engine.last_timing)
        scores = torch.rand(len(prompts), generator=torch.Generator().manual_seed(step))
        batch = build_rollout_batch(prompts, generation, scores, EOS)
        engine.sleep()
        old_log_probs = actor.log_probs(batch)
        ref_log_probs = ref.log_probs(batch)
        # One rank each: the critic takes the actor's and the reference's log-probs of its one actor rank.
        values, _ = critic.train(batch, old_log_probs, ref_log_probs, actor_data_size=1, updates=1)
        actor_stats = actor.train(batch, values, old_log_probs=old_log_probs, ref_log_probs=ref_log_probs,
                                  stay_awake=True)  # as train.py: the sync follows
        sync_started = time.perf_counter()
        engine.wake_up()
        with actor.turn("export weights"):
            engine.update_weights(actor.backend.named_weights())
        sync()
        sync_seconds = time.perf_counter() - sync_started
        step_seconds = time.perf_counter() - started
        probe = wake_probe(engine) if device.startswith("cuda") else {}
        stages: dict[str, dict] = {}
        for record in recorder.records:
            entry = stages.setdefault(record["stage"], {"seconds": 0.0, "calls": 0})
            entry["seconds"] += record["seconds"]
            entry["calls"] += 1
            if "bytes" in record:
                entry["bytes"] = entry.get("bytes", 0) + record["bytes"]
                entry["copy_seconds"] = entry.get("copy_seconds", 0.0) + record["copy_seconds"]
        stages["weight sync (wake + actor turn + copy)"] = {"seconds": sync_seconds, "calls": 1}
        flops = {
            "actor log-probs": forward_flops(batch, policy=True), "ref log-probs": forward_flops(batch, policy=True),
            "critic values": forward_flops(batch, policy=False), "critic train": 3 * forward_flops(batch, policy=False),
            "actor train": 3 * forward_flops(batch, policy=True),
        }
        for stage, value in flops.items():
            stages[stage]["flops"] = value
        results.append({
            "step": step, "seconds": step_seconds, "generated_tokens": int(batch.num_response_tokens),
            "response_length": batch.response_length, "generate_timing": timing, "stages": stages,
            "actor": {k: actor_stats[k] for k in ("loss", "grad_norm", "kl")}, "wake_probe": probe,
        })
        print(f"[{kind}] step {step}: {step_seconds:.2f}s, {batch.num_response_tokens} tokens, "
              + ", ".join(f"{k} {v['seconds']:.2f}" for k, v in stages.items())
              + "; wake probe GB/s " + ", ".join(f"{k} {v:.1f}" for k, v in probe.items()), flush=True)
    del actor, critic, ref, engine
    gc.collect()
    torch.cuda.empty_cache()
    return {"backend": kind, "build_seconds": build_seconds, "steps": results}


def wake_probe(engine) -> dict:
    """After the step (outside its timing): the engine's parked host buffer copied again into the
    device buffer the wake just filled, and into a fresh allocation, in GB/s. Tells whether a slow
    wake is the host buffer, fresh device memory, or the moment it ran at."""
    mirror = engine._mirror
    host, woken = mirror._host, mirror._device_flat
    if host is None or woken is None:
        return {}

    def gb_s(target: torch.Tensor) -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        target.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        return host.nbytes / (begin.elapsed_time(end) / 1e3) / 1e9

    same = gb_s(woken)
    fresh = torch.empty_like(woken)
    result = {"wake_gb_s": mirror.last_transfer["bytes"] / max(mirror.last_transfer["seconds"], 1e-9) / 1e9,
              "same_buffer_gb_s": same, "fresh_buffer_gb_s": gb_s(fresh), "fresh_again_gb_s": gb_s(fresh)}
    del fresh
    return result


def ray_handoff(rows: int, cols: int, repeats: int = 4) -> dict | None:
    """Seconds for the CriticValues of [rows, cols] values and returns to go from one Ray actor to
    another as an ObjectRef argument (median after the first call), and for a tiny one."""
    try:
        import ray
    except ImportError:
        return None
    paths = [str(ROOT / "trainer"), str(ROOT / "api"), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)  # Ray's workers import ppo_trainer
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)

    @ray.remote
    class Critic:
        def output(self, r: int, c: int) -> CriticValues:
            return CriticValues(sample_ids=torch.arange(r), values=torch.randn(r, c), returns=torch.randn(r, c))

    @ray.remote
    class Actor:
        def take(self, output: CriticValues) -> float:
            return float(output.values[0, 0])

    critic, actor = Critic.remote(), Actor.remote()
    out = {}
    for name, (r, c) in (("full", (rows, cols)), ("tiny", (1, 1))):
        times = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            ray.get(actor.take.remote(critic.output.remote(r, c)))
            times.append(time.perf_counter() - started)
        out[f"{name}_seconds"] = statistics.median(times[1:])
    out["bytes"] = 2 * rows * cols * 4
    ray.shutdown()
    return out


def summarize(run: dict, ceiling_tflops: float, pinned: dict, handoff: dict | None) -> dict:
    measured = run["steps"][1:] or run["steps"]  # the first step pays the warm-up
    mean = lambda values: sum(values) / len(values)
    stage_names = list(measured[0]["stages"])
    stages = {}
    for name in stage_names:
        seconds = mean([s["stages"][name]["seconds"] for s in measured])
        entry = {"seconds": seconds}
        if "flops" in measured[0]["stages"][name]:
            entry["mfu"] = mean([s["stages"][name]["flops"] for s in measured]) / seconds / (ceiling_tflops * 1e12)
        if "bytes" in measured[0]["stages"][name]:
            size = mean([s["stages"][name].get("bytes", 0) for s in measured])
            copy = mean([s["stages"][name].get("copy_seconds", 0.0) for s in measured])
            way = "to_host" if ("offload" in name or "sleep" in name) else "to_device"
            entry["copy_seconds"] = copy
            entry["whole_call_gb_per_s"] = size / seconds / 1e9
            entry["gb_per_s"] = size / copy / 1e9 if copy > 0 else 0.0
            entry["share_of_pinned"] = entry["gb_per_s"] / pinned[way]
            entry["bytes"] = size
        stages[name] = entry
    step = mean([s["seconds"] for s in measured])
    tokens = mean([s["generated_tokens"] for s in measured])
    train = [n for n in stages if "mfu" in stages[n]]
    train_flops = mean([sum(s["stages"][n]["flops"] for n in train) for s in measured])
    out = {
        "backend": run["backend"], "step_seconds": step, "first_step_seconds": run["steps"][0]["seconds"],
        "generated_tokens": tokens, "tokens_per_s_end_to_end": tokens / step,
        "generate_tokens_per_s": tokens / stages["generate"]["seconds"],
        "training_mfu": train_flops / sum(stages[n]["seconds"] for n in train) / (ceiling_tflops * 1e12),
        "stages": stages, "vs_published_anchor": PUBLISHED_STEP_SECONDS / step,
        "generate_timing": measured[-1]["generate_timing"],
        "decode_ms_per_step": mean([1e3 * s["generate_timing"]["decode_seconds"] / max(1, s["response_length"] - 1)
                                    for s in measured]),
    }
    if handoff is not None:
        out["handoff_share_of_step"] = handoff["full_seconds"] / step
    return out


def table(summaries: list[dict], ceiling: float, pinned: dict, handoff: dict | None) -> str:
    names = list(dict.fromkeys(n for s in summaries for n in s["stages"]))
    lines = [(f"ceilings: bf16 matmul {ceiling:.0f} TFLOP/s; pinned copy {pinned['to_device']:.1f} GB/s to device, "
              f"{pinned['to_host']:.1f} GB/s to host"),
             ("offload/onload GB/s: bytes over the copy's device time (events); their seconds: the whole call")]
    header = f"{'stage (s per step)':42}" + "".join(f"{s['backend']:>28}" for s in summaries)
    lines += [header, "-" * len(header)]
    for name in names:
        cells = []
        for s in summaries:
            e = s["stages"].get(name)
            if e is None:
                cells.append(f"{'-':>28}")
                continue
            extra = f" mfu {e['mfu']:.0%}" if "mfu" in e else (f" {e['gb_per_s']:.0f}GB/s {e['share_of_pinned']:.0%}" if "gb_per_s" in e else "")
            cells.append(f"{e['seconds']:8.3f}{extra:>20}")
        lines.append(f"{name:42}" + "".join(cells))
    for label, key, fmt in (("step seconds (target < 8)", "step_seconds", "{:.2f}"),
                            ("first step seconds (warm-up)", "first_step_seconds", "{:.2f}"),
                            ("generate tokens/s (target >= 40k)", "generate_tokens_per_s", "{:,.0f}"),
                            ("decode ms per step", "decode_ms_per_step", "{:.2f}"),
                            ("tokens/s end to end", "tokens_per_s_end_to_end", "{:,.0f}"),
                            ("training MFU (target >= 45%)", "training_mfu", "{:.1%}"),
                            ("x faster than the 65 s anchor", "vs_published_anchor", "{:.1f}"),
                            ("Ray values handoff share (target < 2%)", "handoff_share_of_step", "{:.3%}")):
        lines.append(f"{label:42}" + "".join(f"{fmt.format(s[key]) if key in s else '-':>28}" for s in summaries))
    if handoff is not None:
        lines.append(f"Ray handoff of {handoff['bytes'] / 1e6:.1f} MB: {handoff['full_seconds'] * 1e3:.1f} ms "
                     f"(a 1x1 object: {handoff['tiny_seconds'] * 1e3:.1f} ms)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3, help="steps per backend; the first is warm-up")
    parser.add_argument("--backends", default="Torch,Megatron")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt-length", type=int, default=100)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=64)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ceiling, pinned = bf16_ceiling(), pinned_bandwidth()
    print(f"bf16 ceiling {ceiling:.0f} TFLOP/s, pinned {pinned}", flush=True)
    checkpoint = Path(tempfile.mkdtemp()) / "qwen2.5-0.5b-random"
    make_checkpoint(checkpoint, seed=0)
    prompts = make_prompts(args.prompts, args.prompt_length, seed=0)
    summaries, runs = [], []
    try:
        handoff = ray_handoff(args.prompts, args.max_new_tokens)
    except (OSError, RuntimeError) as exc:  # the step figures do not need Ray; say why it is missing
        print(f"ray handoff not measured: {type(exc).__name__}: {exc}", flush=True)
        handoff = None
    print(f"ray handoff {handoff}", flush=True)
    for kind in args.backends.split(","):
        spec = PPOJobSpec.model_validate({
            "image": "bench", "seed": 1,
            "model": {"path": str(checkpoint), "dtype": "bfloat16"},
            "actor": {"backend": kind, "microBatchSize": args.micro_batch_size, "learningRate": 1e-6},
            "rollout": {"batchSize": args.prompts, "maxNewTokens": args.max_new_tokens, "temperature": 1.0},
        })
        try:
            run = run_backend(kind, spec, prompts, args.steps)
        except (RuntimeError, ValueError, TypeError, AttributeError, KeyError, IndexError, ImportError):  # keep the other's figures
            traceback.print_exc()
            gc.collect()
            torch.cuda.empty_cache()
            continue
        runs.append(run)
        summaries.append(summarize(run, ceiling, pinned, handoff))
        (args.out / "bench.json").write_text(json.dumps(
            {"ceiling_tflops": ceiling, "pinned_gb_per_s": pinned, "ray_handoff": handoff, "targets": TARGETS,
             "summaries": summaries, "runs": runs}, indent=1))
    text = table(summaries, ceiling, pinned, handoff)
    (args.out / "bench.txt").write_text(text + "\n")
    print(text)
    for file in checkpoint.iterdir():
        file.unlink()
    checkpoint.rmdir()


if __name__ == "__main__":
    main()
