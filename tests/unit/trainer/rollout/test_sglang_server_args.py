"""The SGLang server and router command lines built from the spec, and the base GPU id of a bundle.

The `sglang`-marked tests parse the built arguments with SGLang's own parsers
(`sglang.srt.server_args.prepare_server_args`, `sglang_router.launch_router.parse_router_args`);
they skip unless sglang 0.5.23 / sglang-router 0.3.2 are importable, which CI's venv never has
(docs/sglang.md says how to run them in a throwaway venv).
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from ppo_trainer.rollout.sglang.launcher import compute_base_gpu_id
from ppo_trainer.rollout.sglang.server_args import (
    ServerPlace,
    ServerProgram,
    build_router_args,
    build_server_args,
    router_command,
    server_command,
)
from ppojob_api.spec import ModelSpec, OffloadSpec, PPOJobSpec, RolloutSpec


def make_spec(**overrides) -> PPOJobSpec:
    return PPOJobSpec(image="trainer:test", seed=11, **overrides)


PLACE = ServerPlace(model_path="/models/qwen", host="10.0.0.5", port=30001, base_gpu_id=2, engine_index=3)


def test_server_args_with_rollout_offload():
    spec = make_spec(
        rollout=RolloutSpec(tensor_parallel=2, memory_fraction=0.7),
        model=ModelSpec(path="/models/qwen", dtype="bfloat16"),
    )
    assert build_server_args(spec, PLACE) == [
        "--model-path", "/models/qwen",
        "--host", "10.0.0.5",
        "--port", "30001",
        "--tp-size", "2",
        "--mem-fraction-static", "0.7",
        "--base-gpu-id", "2",
        "--dtype", "bfloat16",
        "--random-seed", "14",
        "--skip-tokenizer-init",
        "--enable-memory-saver",
        "--enable-weights-cpu-backup",
    ]  # fmt: skip


def test_server_args_without_offload_and_with_a_tokenizer():
    spec = make_spec(offload=OffloadSpec(rollout=False), model=ModelSpec(path="/m", tokenizer="/tok"))
    assert build_server_args(spec, PLACE) == [
        "--model-path", "/models/qwen",
        "--host", "10.0.0.5",
        "--port", "30001",
        "--tp-size", "1",
        "--mem-fraction-static", "0.8",
        "--base-gpu-id", "2",
        "--dtype", "float32",
        "--random-seed", "14",
        "--skip-tokenizer-init",
        "--tokenizer-path", "/tok",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("place", "message"),
    [
        (ServerPlace(model_path="/m", host="h", port=0), "port 0 is out of range"),
        (ServerPlace(model_path="/m", host="h", port=1, base_gpu_id=-1), "base GPU id -1 is negative"),
    ],
)
def test_server_args_reject_a_bad_place(place, message):
    with pytest.raises(ValueError, match=message):
        build_server_args(make_spec(), place)


def test_commands_run_the_module_with_this_python():
    assert server_command(["--port", "1"]) == [sys.executable, "-m", "sglang.launch_server", "--port", "1"]
    stand_in = ServerProgram(module="tests.doubles.sglang_server", args=("--device", "cpu"), on_gpu=False)
    assert server_command(["--port", "1"], program=stand_in, python="/py") == [
        "/py", "-m", "tests.doubles.sglang_server", "--port", "1", "--device", "cpu"]
    assert router_command(["--port", "2"], python="/py") == ["/py", "-m", "sglang_router.launch_router", "--port", "2"]


def test_router_args_put_the_engines_behind_one_address():
    urls = ["http://10.0.0.5:30001", "http://10.0.0.6:30001"]
    assert build_router_args(worker_urls=urls, host="0.0.0.0", port=30000) == [
        "--host", "0.0.0.0", "--port", "30000", "--policy", "cache_aware", "--worker-urls", *urls,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="a router is for several engines; got 1"):
        build_router_args(worker_urls=urls[:1], host="0.0.0.0", port=30000)


@pytest.mark.parametrize(
    ("gpu_ids", "visible", "base"),
    [
        ([5], "5", 0),  # Ray narrowed the visible devices to the bundle's GPU
        ([6, 7], "6,7", 0),
        ([3], "1,3", 1),
        ([3], None, 3),  # every GPU visible: the physical id
        ([3], "", 3),
    ],
)
def test_base_gpu_id_of_a_bundle(gpu_ids, visible, base):
    assert compute_base_gpu_id(bundle_gpu_ids=gpu_ids, visible_devices=visible) == base


def test_base_gpu_id_errors_name_the_problem():
    with pytest.raises(ValueError, match="bundle holds no GPU"):
        compute_base_gpu_id(bundle_gpu_ids=[], visible_devices="0")
    with pytest.raises(ValueError, match=r"GPU 4 of the engine's bundle is not in CUDA_VISIBLE_DEVICES='0,1'"):
        compute_base_gpu_id(bundle_gpu_ids=[4], visible_devices="0,1")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


needs_sglang = pytest.mark.skipif(
    not _importable("sglang.srt.server_args"),
    reason="sglang is not installed (CI never installs it); see docs/sglang.md to run the check",
)
needs_router = pytest.mark.skipif(
    not _importable("sglang_router"),
    reason="sglang-router is not installed (CI never installs it); see docs/sglang.md to run the check",
)


@pytest.mark.sglang
@needs_sglang
@pytest.mark.parametrize("offload", [True, False])
def test_sglang_own_parser_reads_the_built_arguments(offload):
    from sglang.srt.server_args import prepare_server_args
    from sglang.version import __version__

    assert __version__ == "0.5.23"
    spec = make_spec(
        rollout=RolloutSpec(tensor_parallel=2, memory_fraction=0.65),
        model=ModelSpec(path="/m", tokenizer="/tok", dtype="bfloat16"),
        offload=OffloadSpec(rollout=offload),
    )
    parsed = prepare_server_args(build_server_args(spec, PLACE))
    seen = {
        key: getattr(parsed, key)
        for key in (
            "model_path", "tokenizer_path", "host", "port", "tp_size", "mem_fraction_static", "base_gpu_id",
            "dtype", "random_seed", "skip_tokenizer_init", "enable_memory_saver", "enable_weights_cpu_backup",
        )
    }  # fmt: skip
    assert seen == {
        "model_path": "/models/qwen",
        "tokenizer_path": "/tok",
        "host": "10.0.0.5",
        "port": 30001,
        "tp_size": 2,
        "mem_fraction_static": 0.65,
        "base_gpu_id": 2,
        "dtype": "bfloat16",
        "random_seed": 14,
        "skip_tokenizer_init": True,
        "enable_memory_saver": offload,
        "enable_weights_cpu_backup": offload,
    }


@pytest.mark.sglang
@needs_router
def test_sglang_router_own_parser_reads_the_built_arguments():
    from sglang_router.launch_router import parse_router_args

    urls = ["http://10.0.0.5:30001", "http://10.0.0.6:30001"]
    parsed = parse_router_args(build_router_args(worker_urls=urls, host="0.0.0.0", port=30000))
    assert (parsed.host, parsed.port, parsed.policy, parsed.worker_urls) == ("0.0.0.0", 30000, "cache_aware", urls)
