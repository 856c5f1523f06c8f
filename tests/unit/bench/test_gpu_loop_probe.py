"""gpu_loop_probe: the records taken inside the roles' processes, and the figures made of them."""

import types

import gpu_loop_probe
import pytest
import torch
from gpu_workloads import MODELS

from ppo_trainer.rollout.base import SamplingParams
from ppo_trainer.rollout.torch_engine import TorchRolloutEngine
from ppojob_api.spec import ModelSpec


def record(role, method, seconds, time=10.0, **extra):
    return {"role": role, "method": method, "seconds": seconds, "time": time} | extra


def test_summarize_per_step_shares_of_the_ceilings():
    processes = [
        {"records": [
            record("actor", "forward", 1.0, flops=300e12),
            record("actor", "train", 3.0, flops=900e12),
            record("actor", "onload", 0.5, bytes=20e9, copy_seconds=0.4, path="cores", peak_allocated=60e9,
                   peak_reserved=62e9),
            record("actor", "offload", 0.6, bytes=20e9, copy_seconds=0.5),
            record("actor", "forward", 1.0, flops=300e12),
            record("actor", "train", 3.0, flops=900e12),
            record("actor", "onload", 0.5, bytes=20e9, copy_seconds=0.8, path="engines", peak_allocated=61e9,
                   peak_reserved=63e9),
            record("actor", "offload", 0.6, bytes=20e9, copy_seconds=0.3),
        ]},
        {"records": [record("rollout", "generate", 2.0, tokens=100_000,
                            timing={"prefill_seconds": 0.2, "decode_seconds": 1.5, "graphs_captured": 8}),
                     record("rollout", "generate", 2.0, tokens=60_000,
                            timing={"prefill_seconds": 0.1, "decode_seconds": 1.5}),
                     record("rollout", "sleep", 0.1, bytes=0, copy_seconds=0.0)]},
        {"records": [record("actor", "gather_values", 0.004), record("actor", "gather_values", 0.002)]},
    ]
    out = gpu_loop_probe.summarize(processes, ceiling_tflops=600.0, pinned={"to_device": 50.0, "to_host": 50.0},
                                   steps=2)
    assert out["passes"]["actor train"]["seconds"] == pytest.approx(3.0)  # per step
    assert out["passes"]["actor train"]["mfu"] == pytest.approx(0.5)
    assert out["training_mfu"] == pytest.approx(2400e12 / 8.0 / 600e12)
    assert out["generate_tokens_per_s"] == pytest.approx(40_000)
    assert out["decode_seconds"] == pytest.approx(1.5)
    assert out["prefill_seconds"] == pytest.approx(0.15)  # the engine's parts, per step
    assert out["graphs_captured"] == pytest.approx(4)
    assert out["transfers"]["actor onload by cores"]["gb_per_s"] == pytest.approx(50.0)  # a wake's, by its path
    assert out["transfers"]["actor onload by cores"]["share_of_pinned"] == pytest.approx(1.0)
    assert out["transfers"]["actor onload by engines"]["share_of_pinned"] == pytest.approx(0.5)
    assert out["transfers"]["actor offload"]["gb_per_s"] == pytest.approx(40e9 / 0.8 / 1e9)
    assert "rollout sleep" not in out["transfers"]  # a no-op moved nothing
    assert out["peak_awake_bytes"]["actor"] == {"allocated": 61e9, "reserved": 63e9}
    assert out["parked_bytes"] == {"actor": 20e9}
    assert out["parked_bytes_total"] == 20e9
    assert out["values_handoff_seconds"] == pytest.approx(0.003)


def test_an_optimizer_state_parked_on_its_own_counts_beside_the_weights_parked_after_it():
    records = [record("actor", "offload_optimizer_state", 0.8, bytes=37e9, copy_seconds=0.74),
               record("actor", "offload", 0.2, bytes=6e9, copy_seconds=0.12)] * 2
    out = gpu_loop_probe.summarize([{"records": records}], ceiling_tflops=None,
                                   pinned={"to_device": 50.0, "to_host": 50.0}, steps=2)
    assert out["parked_bytes"] == {"actor": 43e9}
    assert out["transfers"]["actor offload_optimizer_state"]["share_of_pinned"] == pytest.approx(1.0)


def test_summarize_averages_the_sm_clock_inside_generation_and_training_passes():
    processes = [{"records": [record("rollout", "generate", 2.0, time=12.0, tokens=1000),
                              record("actor", "train", 3.0, time=20.0, flops=1e12)]}]
    clock = [(9.0, 1980.0), (10.5, 1700.0), (11.5, 1800.0), (14.0, 1980.0), (17.5, 1900.0), (19.0, 1800.0)]
    out = gpu_loop_probe.summarize(processes, ceiling_tflops=600.0, pinned=None, steps=1, sm_clock=clock)
    assert out["sm_clock_mhz"] == {"generate": pytest.approx(1750.0), "training passes": pytest.approx(1850.0)}
    assert gpu_loop_probe.summarize(processes, ceiling_tflops=600.0, pinned=None, steps=1)["sm_clock_mhz"] == {
        "generate": None, "training passes": None}


def test_installed_probe_times_the_engine_and_returns_its_results_unchanged():
    spec = ModelSpec(path="builtin:tiny", tokenizer="builtin:tiny", dtype="float32")
    engine = TorchRolloutEngine(model_spec=spec, device="cpu", seed=0)
    worker = types.SimpleNamespace(engine=engine)
    prompts = [[5, 6, 7], [8, 9]]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3)
    expected = engine.generate(prompts, params)
    role, _ = gpu_loop_probe.install(worker, {"rollout": MODELS["qwen2-test"]})
    got = engine.generate(prompts, params)
    assert role == "rollout"
    assert torch.equal(got.response_tokens, expected.response_tokens)
    collected = gpu_loop_probe.collect(worker)
    [generated] = collected["records"]
    assert generated["method"] == "generate"
    assert generated["tokens"] == int(expected.response_mask.sum())
    assert generated["seconds"] > 0
    assert collected["rss_bytes"] > 0
    assert gpu_loop_probe.collect(worker)["records"] == []  # handed back once
