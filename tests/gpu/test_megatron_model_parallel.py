"""MegatronBackend split over two real GPUs (tensor parallel 2, or pipeline parallel 2) against one GPU.

Two processes (one per GPU) build the backend from the same tiny Qwen2 checkpoint (float32, tied
embeddings): with tensor parallel 2 each holds half of every sharded weight; with pipeline parallel 2
each holds one of the two layers (the first stage the embedding, the last the final norm and its
copy of the tied embedding), and passes run megatron's 1F1B schedule. Rank 0 writes what it saw; the
test compares it with the eager TorchBackend and with MegatronBackend on one GPU, after two
optimizer steps too (a pipeline that failed to sum the tied embedding's two gradients would drift).
Skipped with fewer than two GPUs or without megatron-core.
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


def loss_fn_for(batch):
    def loss_fn(output, rows):
        lp = output["log_probs"]
        return -(lp * batch.response_mask[rows].to(lp.device)).sum() / batch.response_mask.sum(), {}  # a term of the batch

    return loss_fn


def two_steps(actor, batch) -> dict:
    """Two optimizer steps (two micro-batches each), then the log-probs."""
    losses = [actor.train(batch, loss_fn_for(batch), micro_batch_size=2)["loss"] for _ in range(2)]
    return {"train": losses, "log_probs_after_train": actor.forward(batch)["log_probs"]}


def _rank_main(rank: int, port: int, directory: str, out: str, parallel: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    from ppo_trainer.backends.megatron.backend import MegatronBackend

    batch = make_batch()
    kwargs = {"model_spec": ModelSpec(path=directory, dtype="float32"), "learning_rate": 1e-3, "max_grad_norm": 1.0,
              "device": "cuda", "seed": 0, **parallel}
    actor = MegatronBackend(role="actor", **kwargs)
    result = {"log_probs": actor.forward(batch)["log_probs"], "weights": {k: v.cpu() for k, v in actor.named_weights()}}
    actor.offload()
    actor.onload()
    result["log_probs_after_onload"] = actor.forward(batch)["log_probs"]
    result.update(two_steps(actor, batch))
    result["values"] = MegatronBackend(role="critic", **kwargs).forward(batch)["values"]
    result["held"] = sorted(actor.state_dict()["model"])
    results = [None, None]
    torch.distributed.all_gather_object(results, result)
    if rank == 0:
        torch.save(results, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("parallel", [{"tensor_parallel": 2}, {"pipeline_parallel": 2}],
                         ids=["tensor-parallel-2", "pipeline-parallel-2"])
def test_two_gpus_equal_one_gpu_and_export_whole_weights(checkpoint, tmp_path, parallel):  # noqa: F811
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "results.pt"
    mp.spawn(_rank_main, args=(port, str(checkpoint), str(out), parallel), nprocs=2, join=True)
    ranks = torch.load(out)
    result, batch = ranks[0], make_batch()
    reference = make("torch", checkpoint).forward(batch)["log_probs"]
    torch.testing.assert_close(result["log_probs"], reference, atol=2e-4, rtol=0)
    assert torch.equal(result["log_probs_after_onload"], result["log_probs"])
    one_gpu = two_steps(make("megatron", checkpoint), batch)
    torch.testing.assert_close(torch.tensor(result["train"]), torch.tensor(one_gpu["train"]), atol=2e-4, rtol=0)
    torch.testing.assert_close(result["log_probs_after_train"], one_gpu["log_probs_after_train"], atol=5e-4, rtol=0)
    for other in ranks[1:]:  # every rank returns what the last stage computed
        assert torch.equal(other["log_probs"], result["log_probs"]) and other["train"] == result["train"]
    values = result["values"]
    assert values.shape == (4, 6) and torch.all(values[batch.response_mask == 0] == 0)
    from safetensors.torch import load_file

    hf = load_file(str(checkpoint / "model.safetensors"))
    assert set(result["weights"]) == set(hf) - {"lm_head.weight"}
    for name, tensor in result["weights"].items():
        torch.testing.assert_close(tensor, hf[name], atol=0, rtol=0)
    if "pipeline_parallel" in parallel:  # one layer each; the embedding first, the norm and head copy last
        first, last = (set(r["held"]) for r in ranks)
        assert "embedding.word_embeddings.weight" in first and "decoder.final_layernorm.weight" not in first
        assert {"decoder.final_layernorm.weight", "output_layer.weight"} <= last
        assert not any(n.startswith("embedding.") for n in last)
        assert {n.split(".")[2] for n in first | last if n.startswith("decoder.layers.")} == {"0"}
