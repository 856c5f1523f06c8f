"""The SGLang adapter against two built-in servers, for real: separate processes, HTTP, a gloo group.

The servers are `python -m tests.doubles.sglang_server`, started by the adapter's own
launcher with the arguments built for SGLang; both serve builtin:tiny from the same weights
(--model-seed), so greedy answers can be compared with a local TorchRolloutEngine.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tests.doubles import sglang_server

from ppo_trainer.models.builtin import build_policy
from ppo_trainer.offload import OffloadError
from ppo_trainer.rollout.base import SamplingParams
from ppo_trainer.rollout.sglang.client import RolloutServerError
from ppo_trainer.rollout.sglang.engine import SGLangRolloutEngine
from ppo_trainer.rollout.sglang.launcher import launch_engine_server
from ppo_trainer.rollout.torch_engine import TorchRolloutEngine
from ppo_trainer.weight_sync.broadcast import GroupSender, ServerReceiver
from ppojob_api.spec import PPOJobSpec

MODEL_SEED = 7
PAD = 258
PROMPTS = [[256, 104, 105], [256, 65], [256, 111, 107, 33], [256, 120]]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)
SPEC = PPOJobSpec(image="test", seed=1)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("rollout-logs")

    def launch(index: int):
        return launch_engine_server(
            SPEC,
            engine_index=index,
            host="127.0.0.1",
            log_dir=log_dir,
            program=sglang_server.program("--model-seed", str(MODEL_SEED)),
            timeout_s=120,
        )

    with ThreadPoolExecutor(2) as pool:
        started = list(pool.map(launch, range(2)))
    yield started
    for server in started:
        server.stop()


@pytest.fixture
def engine(servers):
    engine = SGLangRolloutEngine(servers=[s.client() for s in servers], pad_token_id=PAD)
    yield engine
    engine.close()


def local_engine(seed: int) -> TorchRolloutEngine:
    return TorchRolloutEngine(model_spec=SPEC.model, device="cpu", seed=seed)


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach()) for n, p in build_policy(SPEC.model, seed=seed, device="cpu").named_parameters()]


def assert_same_greedy(served, local) -> None:
    assert torch.equal(served.response_tokens, local.response_tokens)
    assert torch.equal(served.response_mask, local.response_mask)
    torch.testing.assert_close(served.log_probs, local.log_probs, atol=1e-5, rtol=1e-5)


def test_generate_sampled_is_right_padded_with_log_probs(engine):
    one = SGLangRolloutEngine(servers=engine.servers[:1], pad_token_id=PAD)
    out = one.generate(PROMPTS, SamplingParams(max_new_tokens=5, temperature=1.0, seed=3))
    rows, width = out.response_tokens.shape
    assert rows == len(PROMPTS) and 1 <= width <= 5
    lengths = out.response_mask.sum(dim=1).long()
    for row, length in enumerate(lengths.tolist()):
        assert out.response_mask[row, :length].eq(1).all() and out.response_mask[row, length:].eq(0).all()
        assert out.response_tokens[row, length:].eq(PAD).all()
        assert out.log_probs[row, :length].lt(0).all() and out.log_probs[row, length:].eq(0).all()


def test_generate_greedy_matches_the_local_engine_on_one_and_on_two_servers(engine):
    local = local_engine(MODEL_SEED).generate(PROMPTS, GREEDY)
    one = SGLangRolloutEngine(servers=engine.servers[:1], pad_token_id=PAD)
    assert_same_greedy(one.generate(PROMPTS, GREEDY), local)
    assert_same_greedy(engine.generate(PROMPTS, GREEDY), local)  # sharded 2 + 2 over both servers, in order


def test_weight_sync_through_a_gloo_group_changes_what_is_served(engine):
    before = engine.generate(PROMPTS, GREEDY)
    sync = GroupSender(receivers=[ServerReceiver(engine.servers)], master_address="127.0.0.1", backend="gloo",
                       bucket_bytes=64 * 1024)
    sync.connect()
    try:
        assert sync.world_size == 3  # the actor's source rank and one rank per server
        sync.broadcast(weights(99))  # several buckets: the tiny model's weights are ~0.4 MB
    finally:
        sync.disconnect()
    after = engine.generate(PROMPTS, GREEDY)
    assert_same_greedy(after, local_engine(99).generate(PROMPTS, GREEDY))
    assert not torch.equal(before.log_probs, after.log_probs)
    sync.connect()
    sync.broadcast(weights(MODEL_SEED))  # put the shared weights back for the other tests
    sync.disconnect()


def test_disconnect_before_sleep_and_reconnect_after_wake(engine):
    sync = GroupSender(receivers=[ServerReceiver(engine.servers)], master_address="127.0.0.1", backend="gloo")
    # Actor awake: connect, sync; before the actor sleeps: disconnect (twice is a no-op).
    sync.connect()
    sync.broadcast(weights(5))
    sync.disconnect()
    sync.disconnect()
    # The servers' ends are gone too: a broadcast to the old group is refused by name.
    with pytest.raises(RolloutServerError, match=r"update_weights_from_distributed failed: HTTP 400: Group weight_update_group not in \[\]"):
        engine.servers[0].update_weights_from_distributed(names=["x"], dtypes=["float32"], shapes=[[1]])
    with pytest.raises(RuntimeError, match="not connected: call connect"):
        sync.broadcast(weights(6))
    # The engines sleep and wake meanwhile; after the actor wakes: reconnect, sync again.
    engine.sleep()
    engine.wake_up()
    sync.connect()
    sync.broadcast(weights(6))
    sync.disconnect()
    assert_same_greedy(engine.generate(PROMPTS, GREEDY), local_engine(6).generate(PROMPTS, GREEDY))
    sync.connect()
    sync.broadcast(weights(MODEL_SEED))
    sync.disconnect()


def test_release_and_resume_memory_keep_the_weights(engine):
    before = engine.generate(PROMPTS, GREEDY)
    engine.sleep()
    engine.sleep()  # idempotent: the second is a no-op, not a crash
    with pytest.raises(OffloadError, match="cannot generate while Asleep"):
        engine.generate(PROMPTS, GREEDY)
    # A server asked to generate while released says so (SGLang's behaviour there is undefined).
    with pytest.raises(RolloutServerError, match="memory released .*resume_memory_occupation"):
        engine.servers[0].generate(PROMPTS[:1], [{"max_new_tokens": 2}])
    engine.wake_up()
    assert_same_greedy(engine.generate(PROMPTS, GREEDY), before)


def test_colocated_update_weights_from_tensor_is_refused_by_the_builtin_server(engine):
    # SGLang's payload is a pickle of CUDA IPC handles; the built-in server answers as SGLang
    # answers a failed update: {"success": false, "message": ...} with HTTP 400.
    with pytest.raises(RolloutServerError, match="update_weights_from_tensor failed: .*not supported") as caught:
        engine.update_weights(weights(MODEL_SEED)[:2])
    assert caught.value.status == 400
    engine.generate(PROMPTS[:1], GREEDY)  # the servers were paused for the update and continued after it


def test_paused_server_holds_generation_until_continue(engine):
    server = engine.servers[0]
    server.pause_generation()
    done = threading.Event()
    worker = threading.Thread(target=lambda: (server.generate(PROMPTS[:1], [{"max_new_tokens": 2}]), done.set()))
    worker.start()
    time.sleep(0.5)
    assert not done.is_set()
    server.continue_generation()
    worker.join(timeout=30)
    assert done.is_set()
