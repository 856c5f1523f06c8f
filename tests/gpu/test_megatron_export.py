"""The Hugging Face export of a Megatron backend equals the Torch backend's export of the same weights:
the actor (a tiny Qwen2 with tied embeddings, float32) and the critic, on one GPU and split over two
(tensor parallel 2, pipeline parallel 2: rank 0 writes what every rank's gathers reassemble).

Skipped without CUDA or megatron-core; run on the GPU machine with `python -m pytest -q -m gpu tests/gpu`.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from ppo_trainer.export import WEIGHTS_FILE, export_source, write_export
from ppojob_api.spec import ModelSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (megatron-core does not run on CPUs)"),
]
pytest.importorskip("megatron.core", reason="needs megatron-core (tools/gpu-bundle packs it)")

from test_megatron_backend import checkpoint, make  # noqa: F401  (fixture and helper)

ROLES = ("actor", "critic")


def export_of(backend, checkpoint_dir, directory: Path, role: str) -> Path:
    source = export_source(ModelSpec(path=str(checkpoint_dir), dtype="float32"), value_model=role == "critic")
    return write_export(directory, backend.named_weights(), source=source, dtype=torch.float32)


def assert_same_export(megatron: Path, torch_export: Path) -> None:
    assert sorted(p.name for p in megatron.iterdir()) == sorted(p.name for p in torch_export.iterdir())
    assert json.loads((megatron / "config.json").read_text()) == json.loads((torch_export / "config.json").read_text())
    ours, theirs = load_file(str(megatron / WEIGHTS_FILE)), load_file(str(torch_export / WEIGHTS_FILE))
    assert set(ours) == set(theirs) and "lm_head.weight" not in ours  # tied: the embedding only
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


@pytest.mark.parametrize("role", ROLES)
def test_megatron_export_equals_the_torch_export_on_one_gpu(checkpoint, tmp_path, role):  # noqa: F811
    torch_export = export_of(make("torch", checkpoint, role=role), checkpoint, tmp_path / "torch", role)
    megatron_export = export_of(make("megatron", checkpoint, role=role), checkpoint, tmp_path / "megatron", role)
    assert_same_export(megatron_export, torch_export)


def _export_rank(rank: int, port: int, directory: str, out: str, parallel: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    from ppo_trainer.backends.megatron.backend import MegatronBackend
    from ppo_trainer.weight_sync.base import drain

    for role in ROLES:
        backend = MegatronBackend(model_spec=ModelSpec(path=directory, dtype="float32"), role=role, learning_rate=1e-3,
                                  max_grad_norm=1.0, device="cuda", seed=0, **parallel)
        if rank == 0:
            export_of(backend, directory, Path(out) / role, role)
        else:
            drain(backend.named_weights())  # this rank's part of each gather
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("parallel", [{"tensor_parallel": 2}, {"pipeline_parallel": 2}],
                         ids=["tensor-parallel-2", "pipeline-parallel-2"])
def test_megatron_export_over_two_gpus_equals_the_torch_export(checkpoint, tmp_path, parallel):  # noqa: F811
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_export_rank, args=(port, str(checkpoint), str(tmp_path / "megatron"), parallel), nprocs=2, join=True)
    for role in ROLES:
        torch_export = export_of(make("torch", checkpoint, role=role), checkpoint, tmp_path / "torch" / role, role)
        assert_same_export(tmp_path / "megatron" / role, torch_export)
