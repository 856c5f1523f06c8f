"""MegatronBackend with tensor parallel size 2 on two real GPUs, against the eager TorchBackend.

Two processes (one per GPU) build the backend from the same tiny Qwen2 checkpoint (float32),
each holding half of every sharded weight. Rank 0 writes what it saw; the test compares it with
TorchBackend on one GPU. Skipped with fewer than two GPUs or without megatron-core.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from ppojob_api.spec import ModelSpec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]
pytest.importorskip("megatron.core", reason="needs megatron-core (tools/gpu-bundle packs it)")

from test_megatron_backend import checkpoint, make, make_batch  # noqa: F401  (fixture and helpers)


def _rank_main(rank: int, port: int, directory: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    from ppo_trainer.backends.megatron.backend import MegatronBackend

    batch = make_batch()
    kwargs = {"model_spec": ModelSpec(path=directory, dtype="float32"), "learning_rate": 1e-3, "max_grad_norm": 1.0,
              "device": "cuda", "seed": 0, "tensor_parallel": 2}
    actor = MegatronBackend(role="actor", **kwargs)
    result = {"log_probs": actor.forward(batch)["log_probs"], "weights": {k: v.cpu() for k, v in actor.named_weights()}}
    actor.offload()
    actor.onload()
    result["log_probs_after_onload"] = actor.forward(batch)["log_probs"]

    def loss_fn(output, rows):
        lp = output["log_probs"]
        return -(lp * batch.response_mask[rows].to(lp.device)).sum() / batch.response_mask[rows].sum(), {}

    result["train"] = [actor.train(batch, loss_fn, micro_batch_size=2)["loss"] for _ in range(2)]
    result["values"] = MegatronBackend(role="critic", **kwargs).forward(batch)["values"]
    if rank == 0:
        torch.save(result, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def test_tensor_parallel_2_equals_one_gpu_and_exports_whole_weights(checkpoint, tmp_path):  # noqa: F811
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "rank0.pt"
    mp.spawn(_rank_main, args=(port, str(checkpoint), str(out)), nprocs=2, join=True)
    result = torch.load(out)
    batch = make_batch()
    reference = make("torch", checkpoint).forward(batch)["log_probs"]
    torch.testing.assert_close(result["log_probs"], reference, atol=2e-4, rtol=0)
    assert torch.equal(result["log_probs_after_onload"], result["log_probs"])
    assert result["train"][1] < result["train"][0]
    values = result["values"]
    assert values.shape == (4, 6) and torch.all(values[batch.response_mask == 0] == 0)
    from safetensors.torch import load_file

    hf = load_file(str(checkpoint / "model.safetensors"))
    assert set(result["weights"]) == set(hf) - {"lm_head.weight"}
    for name, tensor in result["weights"].items():
        torch.testing.assert_close(tensor, hf[name], atol=0, rtol=0)
