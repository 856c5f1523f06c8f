"""Megatron roles as the product runs them: the process groups go down with every sleep and come
back with every wake, and the PPO loop runs a Megatron actor, critic and reference over two GPUs
through Ray (tensor parallel 2, pipeline parallel 2, and data parallel 2).

Skipped without CUDA or megatron-core (CI has neither); the two-GPU tests need two GPUs.
"""

from __future__ import annotations

import math
import tempfile

import pytest
import torch
import torch.distributed as dist

from ppojob_api.spec import parse_spec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (megatron-core does not run on CPUs)"),
]
pytest.importorskip("megatron.core", reason="needs megatron-core (tools/gpu-bundle packs it)")

from test_megatron_backend import checkpoint, make_batch  # noqa: F401  (fixture and helper)


def megatron_spec(path: str, **sections) -> object:
    raw = {
        "image": "local", "seed": 1, "model": {"path": path, "dtype": "float32"},
        "actor": {"backend": "Megatron", "learningRate": 1e-3, "microBatchSize": 2, "compile": False},
        "rollout": {"batchSize": 8, "maxNewTokens": 8},
        "ppo": {"numRollouts": 3, "numCriticOnlySteps": 1, "epochs": 1, "normalizeAdvantages": False},
        "checkpoint": {"interval": 0},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return parse_spec(raw)


def leave_no_world() -> None:
    from megatron.core import parallel_state

    if dist.is_initialized():
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def used_bytes() -> int:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def test_a_sleeping_megatron_role_holds_no_process_group_and_trains_on_identically(checkpoint):  # noqa: F811
    from ppo_trainer.roles.actor import ActorWorker

    leave_no_world()  # the backend tests of this process built a world of their own
    spec = megatron_spec(str(checkpoint))
    batch = make_batch()

    def two_updates(worker) -> torch.Tensor:
        for _ in range(2):
            old = worker.log_probs(batch)
            worker.train(batch, old_log_probs=old, ref_log_probs=old)
        return worker.log_probs(batch)

    sleeping = ActorWorker(spec, rank=0, world_size=1, device="cuda", offload=True)
    sleeping.process_group.finish_teardown()
    assert not dist.is_initialized()  # built, then put to sleep: its group is gone
    after_sleeps = two_updates(sleeping)
    sleeping.process_group.finish_teardown()
    assert not dist.is_initialized()
    transitions = sleeping.drain_transitions()
    states = [(t.role, t.to_state) for t in transitions]
    for state in ("Connected", "Disconnected"):
        times = [t.seconds for t in transitions[2:] if t.role == "actor.process_group" and t.to_state == state]
        print(f"\nprocess group {state}: {1e3 * sum(times) / len(times):.0f} ms on average over {len(times)} turns")
    assert states.count(("actor.process_group", "Connected")) == 1 + 5  # the build, then each of 5 turns
    assert states.count(("actor.process_group", "Disconnected")) == 1 + 5

    # What destroying the groups frees: wake, train (the communicators come up), offload, then disconnect.
    sleeping.wake()
    old = sleeping.log_probs(batch)  # a turn of its own: asleep again afterwards
    sleeping.wake()
    sleeping.backend.train(batch, lambda out, rows: (out["log_probs"].sum() * 0, {}), micro_batch_size=2)
    sleeping.residency.sleep(sleeping.backend.offload)
    with_groups = used_bytes()
    sleeping.process_group.disconnect()
    sleeping.process_group.finish_teardown()
    without_groups = used_bytes()
    print(f"\nasleep with the process groups: {with_groups / 2**20:.0f} MiB used on the GPU;"
          f" destroyed: {without_groups / 2**20:.0f} MiB ({(with_groups - without_groups) / 2**20:.0f} MiB freed)")
    assert without_groups <= with_groups
    del sleeping, old

    awake = ActorWorker(spec, rank=0, world_size=1, device="cuda", offload=False)
    assert dist.is_initialized()  # never sleeps: keeps its group
    kept = two_updates(awake)
    torch.testing.assert_close(after_sleeps, kept, atol=1e-6, rtol=0)
    leave_no_world()


def tiny_even_vocab(directory) -> str:
    """builtin:tiny's shape with 260 token ids (the byte tokenizer's 259, padded) so that it splits over 2 ranks."""
    from transformers import LlamaForCausalLM

    from ppo_trainer.models.builtin import tiny_config

    config = tiny_config()
    config.vocab_size = 260
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(directory))
    return str(directory)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("parallelism", [{"tensor": 2}, {"pipeline": 2}, {}],
                         ids=["tensor-parallel-2", "pipeline-parallel-2", "data-parallel-2"])
def test_the_loop_runs_megatron_roles_over_two_gpus_through_ray(parallelism, tmp_path):
    import ray

    from ppo_trainer.checkpoint import read_role_state
    from ppo_trainer.reporting.reporters import Recorder
    from ppo_trainer.train import run

    parallel = {"parallelism": parallelism}
    spec = megatron_spec(
        tiny_even_vocab(tmp_path / "model"), model={"tokenizer": "builtin:tiny"}, actor=parallel, critic=parallel,
        resources={"nodes": 1, "gpusPerNode": 2}, checkpoint={"interval": 3}, offload={"train": True, "rollout": True},
    )
    ray.init(num_gpus=2, num_cpus=8, include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="ppo-gpu-ray-"),
             logging_level="WARNING")
    try:
        recorder = Recorder()
        state = run(spec, reporter=recorder, checkpoint_dir=str(tmp_path / "ckpt"), resume=False, use_gpus=True)
    finally:
        ray.shutdown()
    assert state.step == 3 and state.critic_only_steps_done == 1
    rewards = [h["reward_mean"] for h in state.history]
    assert all(math.isfinite(r) for r in rewards)
    print(f"\n{parallelism or 'data parallel'}: rewards {rewards}, seconds {[round(h['seconds'], 2) for h in state.history]},"
          f" last step's stages {state.history[-1]['stage_seconds']}")
    groups = [f for kind, f in recorder.events if kind == "transition" and f["role"].endswith(".process_group")]
    assert {(f["role"], f["rank"]) for f in groups} == {(f"{r}.process_group", k) for r in ("actor", "critic", "ref")
                                                      for k in (0, 1)}
    print(f"process group transitions: {len(groups)}, {sum(f['seconds'] for f in groups) / len(groups):.3f} s each on average")
    latest = max((tmp_path / "ckpt").glob("step-*"))
    shards = [read_role_state(latest, role="actor", rank=rank)["backend"]["model"] for rank in (0, 1)]
    name = "embedding.word_embeddings.weight"
    if parallelism.get("tensor") == 2:  # each rank holds half of the vocabulary's rows, and the halves differ
        assert shards[0][name].shape[0] == shards[1][name].shape[0] == 130
        assert not torch.equal(shards[0][name], shards[1][name])
    elif parallelism.get("pipeline") == 2:  # one layer each: the embedding on the first, the head on the last
        assert name in shards[0] and "output_layer.weight" not in shards[0]
        assert name not in shards[1] and "output_layer.weight" in shards[1]
        assert all(not n.startswith("decoder.layers.") or n.startswith("decoder.layers.0.") for s in shards for n in s)
    else:  # data parallel: both ranks hold the whole model, identical after the same averaged updates
        assert shards[0][name].shape[0] == 260
        for key in shards[0]:
            torch.testing.assert_close(shards[0][key], shards[1][key], atol=0, rtol=0)
