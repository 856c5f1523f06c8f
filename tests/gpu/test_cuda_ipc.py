"""Colocated weight sync by CUDA IPC (`weight_sync/cuda_ipc.py`) between two real processes on one GPU."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _receive(payload: bytes, results) -> None:
    from ppo_trainer.weight_sync.cuda_ipc import open_shared_weights

    shared = pickle.loads(payload)  # as Ray delivers it: the handles, pickled
    copies = {name: tensor.clone() for name, tensor in open_shared_weights(shared, "cuda")}
    torch.cuda.synchronize()
    # Plain pickle bytes: a torch tensor put on the queue would be shared by a file descriptor that
    # this process, exiting, could no longer hand over.
    results.put(pickle.dumps({name: tensor.cpu() for name, tensor in copies.items()}))


def test_the_engine_process_copies_the_actors_device_tensors_exactly():
    from ppo_trainer.weight_sync.cuda_ipc import share_weights

    flat = torch.randn(3000, device="cuda", dtype=torch.bfloat16)
    named = [("a.weight", flat[:1000].view(10, 100)), ("b.bias", flat[1000:1024]), ("c", torch.arange(5, device="cuda"))]
    shared, kept = share_weights(named, "cuda")
    assert len(kept) == 3 and len(pickle.dumps(shared)) < 10_000  # handles, not the data
    context = mp.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=_receive, args=(pickle.dumps(shared), results))
    child.start()
    received = pickle.loads(results.get(timeout=120))
    child.join(timeout=60)
    assert child.exitcode == 0
    for name, tensor in named:
        assert torch.equal(received[name], tensor.cpu()), name


def test_shared_weights_refuse_another_gpu_and_cpu_tensors():
    from ppo_trainer.weight_sync.cuda_ipc import SharedWeights, open_shared_weights, share_weights

    with pytest.raises(RuntimeError, match="same device"):
        next(open_shared_weights(SharedWeights(device_uuid="GPU-elsewhere", handles=[]), "cuda"))
    with pytest.raises(ValueError, match="CUDA tensors only"):
        share_weights([("w", torch.zeros(2))], "cuda")
