"""The product's own PPO loop on the GPU issue's workloads: `train.run_on` through Ray, stage by stage.

`gpu_ppo_step.py` drives the role classes in one process to time every transition; this script
runs what a PPOJob runs: Ray actors for the rollout engine, actor, critic and reference,
colocated on the GPUs (fractional bundles), offload on, the critic's values handed to the actor
through the object store. Workload A is the Qwen2.5-0.5B shape, workload B the Qwen2.5-3B shape
(`gpu_workloads.py`), random bf16 weights; 256 prompts of about 100 tokens (byte tokenizer: one
token a character), up to 512 new tokens, reward `Synthetic`. The same call measures the
ceilings (bf16 matmul: one, and 5 s of them back to back, at the clock a training pass holds; pinned
copies). Inside each role's process `gpu_loop_probe` times the
backend's and engine's calls (training passes' FLOPs, generation, every offload and onload with
its bytes) and the device memory each role reaches awake; an NVML sampler reads each process's
device memory, and after the last step every role is put to sleep to read what all of them hold
asleep. `--restart` runs each backend twice on one checkpoint directory: a cold start, then a
resumed job in fresh processes, with the compile caches where the product places them (under
the checkpoint directory; the bench clears PPO_COMPILE_CACHE_DIR so that the cold run is cold), and
each step's compile seconds are the product's own step metric.
`--placement Disaggregated --schedules Synchronous,OneStepOverlap` compares the two schedules with
the engine in a process of its own that never sleeps: on one GPU, Ray is told of two GPUs and
leaves CUDA_VISIBLE_DEVICES alone, so the engine and the training roles share the device as two
shares, and the weight-update group runs over gloo (NCCL refuses two ranks on one device); on
two GPUs (`--gpus 2`) each side has its own and the group is NCCL. `--critic-model` and
`--critic-backend` give the critic a model and backend of its own (the values still go to the
actor by sample id through the object store; the actor's picking of its rows is timed).
`--compile-cache DIR` keeps the compile caches of every run of the call there (later runs start
warm); without it each job's go under its own checkpoint directory.
Steps after the first are averaged (the first compiles); so are the transitions the roles report (waking,
sleeping, process groups built and destroyed: their seconds per step). Writes loop.json into --out.

    python3 bench/gpu_ppo_loop.py --out $OUT/loop --steps 4 --backends Torch,Megatron
    python3 bench/gpu_ppo_loop.py --out $OUT/loop --models qwen2.5-3b --micro-batch-size 16 --steps 3
    python3 bench/gpu_ppo_loop.py --out $OUT/restart --backends Torch --steps 2 --restart
    python3 bench/gpu_ppo_loop.py --out $OUT/overlap --backends Torch --placement Disaggregated \
        --schedules Synchronous,OneStepOverlap --compile-cache /tmp/cc
    python3 bench/gpu_ppo_loop.py --out $OUT/critic --backends Megatron --critic-model qwen2.5-0.5b-narrow \
        --critic-backend Torch
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT.parent / "trainer"), str(ROOT.parent / "api")]

import gpu_loop_probe
from gpu_workloads import MODELS

from ppo_trainer.compile_cache import OVERRIDE_ENV
from ppo_trainer.reporting.reporters import Recorder
from ppojob_api.spec import parse_spec

GB = 1e9


def write_prompts(path: Path, count: int, length: int, seed: int) -> None:
    """JSONL prompts of length +- 10 lowercase words' characters."""
    rng = random.Random(seed)
    with path.open("w") as out:
        for _ in range(count):
            text = ""
            target = rng.randint(length - 10, length + 10)
            while len(text) < target:
                text += "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))) + " "
            out.write(json.dumps({"prompt": text[:target]}) + "\n")


class StepClock(Recorder):
    """A Recorder that also notes when each step ended (wall clock, as the probes' records) and
    prints the step's line as it ends (a run cut short by its time limit still says how far it got)."""

    def __init__(self) -> None:
        super().__init__()
        self.step_ends: list[float] = []

    def event(self, kind: str, **fields) -> None:
        super().event(kind, **fields)
        if kind == "step":
            self.step_ends.append(time.time())
            print(f"  {fields['line']} | stages " + ", ".join(f"{k} {v:.2f}" for k, v in fields["stage_seconds"].items()),
                  flush=True)


class DeviceSampler:
    """Every `period` seconds, NVML's device memory in use by each process and in all (peaks kept),
    and the SM clock (wall time, MHz)."""

    def __init__(self, period: float = 0.05) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.nvml, self.period = pynvml, period
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.peak_by_pid: dict[int, int] = {}
        self.peak_used = 0
        self.sm_clock: list[tuple[float, float]] = []
        self.max_sm_clock = pynvml.nvmlDeviceGetMaxClockInfo(self.handle, pynvml.NVML_CLOCK_SM)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def now(self) -> dict[int, int]:
        return {p.pid: int(p.usedGpuMemory or 0) for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)}

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            for pid, used in self.now().items():
                self.peak_by_pid[pid] = max(self.peak_by_pid.get(pid, 0), used)
            self.peak_used = max(self.peak_used, int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used))
            self.sm_clock.append((time.time(), self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def one_gpu_disaggregated(args: argparse.Namespace) -> bool:
    return args.placement == "Disaggregated" and args.gpus == 1


def build_spec(backend: str, schedule: str, args: argparse.Namespace, model: Path, prompts: Path, *, steps: int,
               checkpoint_interval: int, critic_model: Path | None) -> object:
    parallelism = {"tensor": args.tensor, "pipeline": args.pipeline}
    disaggregated = args.placement == "Disaggregated"
    critic = {"parallelism": parallelism}
    if critic_model is not None:
        critic["model"] = str(critic_model)
    if args.critic_backend:
        critic["backend"] = args.critic_backend
        if args.critic_backend != backend:
            critic["parallelism"] = {"tensor": 1, "pipeline": 1}
    return parse_spec({
        "image": "bench", "seed": 1,
        "model": {"path": str(model), "tokenizer": "builtin:tiny", "dtype": "bfloat16"},
        "actor": {"backend": backend, "microBatchSize": args.micro_batch_size, "learningRate": 1e-6,
                  "parallelism": parallelism},
        "critic": critic,
        "placement": args.placement,
        "rollout": {"batchSize": args.prompts, "maxNewTokens": args.max_new_tokens, "temperature": 1.0,
                    "gpus": 1 if disaggregated else 0},
        "ppo": {"numRollouts": steps, "numCriticOnlySteps": 0, "epochs": 1, "schedule": schedule},
        "data": {"prompts": str(prompts)},
        # Disaggregated: the engine keeps its GPU (OneStepOverlap refuses offload.rollout; Synchronous alike, to compare).
        "offload": {"train": True, "rollout": not disaggregated, "processGroups": args.process_groups},
        "checkpoint": {"interval": checkpoint_interval},
        "resources": {"nodes": 1, "gpusPerNode": max(args.gpus, 1) + int(one_gpu_disaggregated(args))},
    })


def run_loop(backend: str, schedule: str, configs: dict[str, dict], args: argparse.Namespace, model: Path,
             prompts: Path, *, steps: int, checkpoint_dir: Path | None, resume: bool, critic_model: Path | None,
             ceiling: float | None, pinned: dict | None) -> dict:
    """One job (fresh Ray, fresh processes) through `run_on`, probed, that runs `steps` steps (after
    the checkpoint's when resuming: the job is then 2 x `steps` long); its figures."""
    import ray

    from ppo_trainer.roles.build import build_roles, compute_layout
    from ppo_trainer.train import run_on

    spec = build_spec(backend, schedule, args, model, prompts, steps=steps * (2 if resume else 1),
                      checkpoint_interval=steps if checkpoint_dir else 0, critic_model=critic_model)
    # Ray's workers inherit this environment: the bench's modules (the probe). The compile caches go
    # where build_roles puts them: under the checkpoint directory, never an override's (a cold run stays cold).
    saved = dict(os.environ)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT.parent / "trainer"), str(ROOT.parent / "api"),
                                                os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    os.environ.pop(OVERRIDE_ENV, None)
    if args.compile_cache:
        os.environ[OVERRIDE_ENV] = str(args.compile_cache)
    shared_gpu = one_gpu_disaggregated(args)
    if shared_gpu:  # every process sees the one device; Ray counts two
        os.environ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
    ray.init(num_gpus=args.gpus + int(shared_gpu), include_dashboard=False, logging_level="WARNING",
             _temp_dir=tempfile.mkdtemp(prefix="ppo-loop-ray-"))
    started = time.perf_counter()
    sampler = DeviceSampler() if args.gpus else None
    clock = StepClock()
    try:
        roles = build_roles(spec, compute_layout(spec, use_gpus=args.gpus > 0),
                            timeout=spec.scheduling.schedule_timeout_seconds,
                            checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None)
        try:
            handles = [h for g in roles.groups for h in g.handles]
            ray.get([h.__ray_call__.remote(gpu_loop_probe.install, configs, "gloo" if shared_gpu else None)
                     for h in handles])
            build_seconds = time.perf_counter() - started
            state = run_on(roles, spec, reporter=clock, checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None,
                           resume=resume)
            processes = ray.get([h.__ray_call__.remote(gpu_loop_probe.collect) for h in handles])
            for group in roles.groups:  # every role asleep: what the job holds between its turns
                group.call(group.worker_class.sleep)
            time.sleep(0.5)
            asleep = ray.get([h.__ray_call__.remote(gpu_loop_probe.collect) for h in handles])
            nvml_asleep = sampler.now() if sampler else {}
        finally:
            roles.shutdown()
    finally:
        if sampler:
            sampler.stop()
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)
    history = state.history[-steps:] if resume else state.history
    step_list = [{"seconds": h["seconds"], "stages": h["stage_seconds"], "tokens": h["response_tokens"],
                  "compile_seconds": h["compile_seconds"], "generation_seconds": h["generation_seconds"],
                  "staleness": h["staleness"]} for h in history]
    for index, step in enumerate(step_list):
        stages = ", ".join(f"{k} {v:.2f}" for k, v in step["stages"].items())
        print(f"[{backend} {schedule}] step {index}: {step['seconds']:.2f} s, {step['tokens']} tokens, staleness"
              f" {step['staleness']}; {stages}", flush=True)
    measured = step_list[1:] or step_list
    first_end = clock.step_ends[0] if len(step_list) > 1 else 0.0
    after_first = [p | {"records": [r for r in p["records"] if r["time"] > first_end]} for p in processes]
    probe = gpu_loop_probe.summarize(after_first, ceiling_tflops=ceiling, pinned=pinned, steps=len(measured),
                                     sm_clock=sampler.sm_clock if sampler else ())
    roles_memory = {}
    for p, a in zip(processes, asleep):
        entry = roles_memory.setdefault(p["role"], {})
        entry["rss_bytes"] = p["rss_bytes"]
        entry["compile_seconds"] = p["compile_seconds"]
        if sampler:
            entry["nvml_peak_bytes"] = sampler.peak_by_pid.get(p["pid"], 0)
            entry["nvml_asleep_bytes"] = nvml_asleep.get(p["pid"], 0)
            entry["reserved_asleep_bytes"] = a.get("reserved_now", 0)
            entry["allocated_asleep_bytes"] = a.get("allocated_now", 0)
    transitions = transition_seconds(clock.events, after=first_end, steps=len(measured))
    waited = statistics.mean(s["stages"]["generate"] for s in measured)
    generated = statistics.mean(s["generation_seconds"] for s in measured)
    return {
        "backend": backend, "schedule": schedule, "placement": args.placement,
        "critic": {"model": args.critic_model or "actor's", "backend": spec.training_role("critic").backend.value},
        "wall_seconds": time.perf_counter() - started, "build_seconds": build_seconds,
        "generation_seconds": generated, "generation_hidden_share": 1 - waited / generated if generated else None,
        "steps": step_list, "first_step_seconds": step_list[0]["seconds"],
        "first_step_compile_seconds": step_list[0]["compile_seconds"],
        "step_seconds": statistics.mean(s["seconds"] for s in measured),
        "stage_seconds": {k: statistics.mean(s["stages"][k] for s in measured) for k in measured[0]["stages"]},
        "tokens_per_step": statistics.mean(s["tokens"] for s in measured),
        "probe": probe, "roles": roles_memory, "transition_seconds": transitions,
        "device_peak_used_bytes": sampler.peak_used if sampler else None,
        "max_sm_clock_mhz": sampler.max_sm_clock if sampler else None,
        "all_asleep_nvml_bytes": sum(nvml_asleep.values()),
    }


def transition_seconds(events: list[tuple[str, dict]], *, after: float, steps: int) -> dict[str, float]:
    """Seconds per step of each kind of transition the roles reported (a role waking or sleeping,
    its process group built or destroyed: "actor.process_group asleep->awake"), summed over ranks,
    of those that finished after `after` (wall clock). A step's last transitions (the actor's sleep
    after the weight sync) reach the driver after the step's own event: told apart by when they
    finished, the first step's stay out."""
    totals: dict[str, float] = {}
    for kind, fields in events:
        if kind == "transition" and fields["time"] > after:
            name = f"{fields['role']} {fields['frm']}->{fields['to']}"
            totals[name] = totals.get(name, 0.0) + fields["seconds"] / max(steps, 1)
    return totals


def measure_ceilings() -> tuple[float, float, dict]:
    """(bf16 TFLOP/s of one matmul, of 5 s of them back to back, pinned copy GB/s each way)."""
    import torch
    from gpu_ppo_step import bf16_ceiling, bf16_sustained, pinned_bandwidth

    ceiling = bf16_ceiling()
    sustained, pinned = bf16_sustained(ceiling), pinned_bandwidth()
    torch.cuda.empty_cache()
    return ceiling, sustained, pinned


def table(results: list[dict], ceiling: float | None, pinned: dict | None, sustained: float | None = None) -> str:
    lines = []
    if ceiling:
        lines.append(f"ceilings: bf16 matmul {ceiling:.0f} TFLOP/s ({sustained:.0f} sustained over 5 s); pinned copy "
                     f"{pinned['to_device']:.1f} GB/s to device, {pinned['to_host']:.1f} GB/s to host")
    heads = [f"{r['model']} {r['backend']}{' ' + r['schedule'] if r['schedule'] != 'Synchronous' else ''}"
             f"{' restart' if r.get('restarted') else ''}" for r in results]
    width = max([24, *(len(h) + 2 for h in heads)])
    lines.append(f"{'(per step, steps 2..)':44}" + "".join(f"{h:>{width}}" for h in heads))

    def row(label: str, cell) -> None:
        values = []
        for r in results:
            try:
                values.append(cell(r))
            except (KeyError, TypeError, ZeroDivisionError):
                values.append("-")
        lines.append(f"{label:44}" + "".join(f"{v:>{width}}" for v in values))

    for stage in dict.fromkeys(k for r in results for k in r["stage_seconds"]):
        row(f"stage {stage} s", lambda r, stage=stage: f"{r['stage_seconds'][stage]:.2f}")
    row("step s", lambda r: f"{r['step_seconds']:.2f}")
    row("first step s", lambda r: f"{r['first_step_seconds']:.2f}")
    row("first step compile s (step metric)", lambda r: f"{r['first_step_compile_seconds']:.1f}")
    row("compile s (all roles, whole run)", lambda r: f"{sum(v['compile_seconds'] for v in r['roles'].values()):.1f}")
    row("generated tokens per step", lambda r: f"{r['tokens_per_step']:,.0f}")
    row("generation s (engine), hidden share", lambda r: f"{r['generation_seconds']:.2f} {r['generation_hidden_share']:.0%}")
    row("values handoff s (actor picks its rows)", lambda r: f"{r['probe']['values_handoff_seconds']:.4f}")
    row("generate tokens/s (engine call)", lambda r: f"{r['probe']['generate_tokens_per_s']:,.0f}")
    row("training passes, share of bf16 ceiling", lambda r: f"{r['probe']['training_mfu']:.1%}")
    row("  of the sustained matmuls' rate", lambda r: f"{r['probe']['training_mfu'] * ceiling / sustained:.1%}")
    row("SM clock MHz: generating, training (max)", lambda r: (
        f"{r['probe']['sm_clock_mhz']['generate']:.0f}, {r['probe']['sm_clock_mhz']['training passes']:.0f}"
        f" ({r['max_sm_clock_mhz']})"))
    for name in dict.fromkeys(n for r in results for n in r["probe"]["passes"]):
        row(f"  {name} s / mfu", lambda r, name=name: f"{r['probe']['passes'][name]['seconds']:.2f} / {r['probe']['passes'][name]['mfu']:.0%}")
    for name in dict.fromkeys(n for r in results for n in r["probe"]["transfers"]):
        row(f"  {name} GB, GB/s, of pinned", lambda r, name=name: (
            f"{r['probe']['transfers'][name]['bytes'] / GB:.1f} {r['probe']['transfers'][name]['gb_per_s']:.0f} "
            f"{r['probe']['transfers'][name]['share_of_pinned']:.0%}"))
    for role in dict.fromkeys(k for r in results for k in r["roles"]):
        row(f"  {role} awake peak GB (alloc/reserved/nvml)", lambda r, role=role: (
            f"{r['probe']['peak_awake_bytes'][role]['allocated'] / GB:.1f}/"
            f"{r['probe']['peak_awake_bytes'][role]['reserved'] / GB:.1f}/{r['roles'][role]['nvml_peak_bytes'] / GB:.1f}"))
    for role in dict.fromkeys(k for r in results for k in r["roles"]):
        row(f"  {role} asleep GB (nvml)", lambda r, role=role: f"{r['roles'][role]['nvml_asleep_bytes'] / GB:.2f}")
    row("all roles asleep GB (nvml)", lambda r: f"{r['all_asleep_nvml_bytes'] / GB:.2f}")
    for name in dict.fromkeys(n for r in results for n in r["transition_seconds"]):
        row(f"  {name} s", lambda r, name=name: f"{r['transition_seconds'][name]:.3f}")
    row("device peak in use GB (nvml)", lambda r: f"{r['device_peak_used_bytes'] / GB:.1f}")
    row("host pinned GB (parked by measured offloads)", lambda r: f"{r['probe']['parked_bytes_total'] / GB:.1f}")
    row("host resident GB (all roles' RSS)", lambda r: f"{sum(v['rss_bytes'] for v in r['roles'].values()) / GB:.1f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", default="qwen2.5-0.5b", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--steps", type=int, default=4, help="PPO steps per backend; the first is warm-up")
    parser.add_argument("--backends", default="Torch,Megatron")
    parser.add_argument("--gpus", type=int, default=1, help="0: a dry run on the CPU (Torch only)")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt-length", type=int, default=100)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=64)
    parser.add_argument("--tensor", type=int, default=1, help="Megatron's tensor-parallel size")
    parser.add_argument("--pipeline", type=int, default=1, help="Megatron's pipeline-parallel size")
    parser.add_argument("--process-groups", action=argparse.BooleanOptionalAction, default=True,
                        help="offload.processGroups: destroy and rebuild the roles' process groups around sleep")
    parser.add_argument("--schedules", default="Synchronous", help="comma-separated ppo.schedule values")
    parser.add_argument("--placement", default="Colocate", choices=("Colocate", "Disaggregated"))
    parser.add_argument("--critic-model", choices=sorted(MODELS), help="a critic of its own (default: the actor's)")
    parser.add_argument("--critic-backend", choices=("Torch", "Megatron"), help="default: the actor's")
    parser.add_argument("--compile-cache", type=Path, help="one compile-cache folder for every run of the call")
    parser.add_argument("--restart", action="store_true",
                        help="each backend twice on one checkpoint directory: cold, then resumed in fresh processes")
    args = parser.parse_args()
    if args.restart and args.compile_cache:
        parser.error("--restart measures a cold job against a resumed one: leave --compile-cache out")
    args.out.mkdir(parents=True, exist_ok=True)
    ceiling, sustained, pinned = measure_ceilings() if args.gpus else (None, None, None)
    if ceiling:
        print(f"bf16 ceiling {ceiling:.0f} TFLOP/s ({sustained:.0f} sustained), pinned {pinned}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="ppo-loop-"))
    write_prompts(work / "prompts.jsonl", args.prompts, args.prompt_length, seed=0)
    from gpu_ppo_step import make_checkpoint

    results = []
    critic_model = None
    if args.critic_model:
        critic_model = work / args.critic_model
        make_checkpoint(critic_model, seed=1, config=MODELS[args.critic_model])
    for model_name in args.models.split(","):
        config = MODELS[model_name]
        configs = {"actor": config, "ref": config, "rollout": config,
                   "critic": MODELS[args.critic_model] if args.critic_model else config}
        model_dir = work / model_name
        make_checkpoint(model_dir, seed=0, config=config)
        for backend in args.backends.split(","):
            for schedule in args.schedules.split(","):
                runs = [(False, args.steps)] + ([(True, args.steps)] if args.restart else [])
                checkpoints = work / f"checkpoints-{model_name}-{backend}-{schedule}" if args.restart else None
                for resume, steps in runs:
                    try:
                        result = run_loop(backend, schedule, configs, args, model_dir, work / "prompts.jsonl",
                                          steps=steps, checkpoint_dir=checkpoints, resume=resume,
                                          critic_model=critic_model, ceiling=ceiling, pinned=pinned)
                    except Exception:  # noqa: BLE001 (keep the other runs' figures; the traceback says what failed)
                        traceback.print_exc()
                        break
                    results.append(result | {"model": model_name, "restarted": resume})
                    (args.out / "loop.json").write_text(json.dumps(
                        {"args": vars(args) | {"out": str(args.out), "compile_cache": str(args.compile_cache)},
                         "ceiling_tflops": ceiling, "sustained_tflops": sustained, "pinned_gb_per_s": pinned,
                         "results": results}, indent=1))
                    print(f"[{model_name} {backend} {schedule}{' restart' if resume else ''}] step"
                          f" {result['step_seconds']:.2f} s, first {result['first_step_seconds']:.2f} s (compiling"
                          f" {result['first_step_compile_seconds']:.1f} s), wall {result['wall_seconds']:.0f} s", flush=True)
        shutil.rmtree(model_dir)
    text = table(results, ceiling, pinned, sustained)
    (args.out / "loop.txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
