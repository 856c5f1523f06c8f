"""The SGLang adapter against a real SGLang server on one GPU.

A server is started by the adapter's own launcher with the flags `server_args.py` builds (plus
`--attention-backend triton`: the bundle for the GPU machine carries no FlashAttention 3 kernels,
bench/gpu_sglang_bundle.sh) on a Qwen2.5-0.5B-shaped model with random weights, and driven through
`SGLangRolloutEngine`. Needs sglang importable (the bundle on the GPU machine, or the `sglang`
extra) and a CUDA GPU. Each test prints its figures (run with -s to see them).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
pytest.importorskip("sglang", reason="needs sglang (bench/gpu_sglang_bundle.sh on the GPU machine)")

from ppo_trainer.algorithms.ppo import chunked_log_probs_and_entropy
from ppo_trainer.algorithms.rollout_correction import log_prob_mismatch, summarize_mismatch
from ppo_trainer.rollout.base import SamplingParams
from ppo_trainer.rollout.sglang.engine import SGLangRolloutEngine
from ppo_trainer.rollout.sglang.launcher import launch_engine_server
from ppo_trainer.rollout.sglang.server_args import ServerProgram
from ppojob_api.spec import ModelSpec, PPOJobSpec, RolloutSpec

EOS = 151643
SGLANG_ON_TRITON = ServerProgram(args=("--attention-backend", "triton"))  # the bundle has no FlashAttention 3
# Within bf16 round-off: the server's kernels (triton attention, its fused norms) and the
# trainer's (torch's SDPA, F.rms_norm) round differently; a wrong token or stale weights moves a
# log-prob by the spread of the logits, about 1 here (checked in each test).
MAX_LOG_RATIO = 0.1
MAX_K3 = 1e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Workload A's shape (bench/gpu_workloads.py), random bf16 weights from seed 0."""
    from bench.gpu_workloads import MODELS
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("qwen2.5-0.5b")
    Qwen2ForCausalLM(Qwen2Config(**MODELS["qwen2.5-0.5b"])).to(torch.bfloat16).save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def spec(model_dir):
    return PPOJobSpec(
        image="test",
        seed=1,
        model=ModelSpec(path=str(model_dir), dtype="bfloat16"),
        rollout=RolloutSpec(memory_fraction=0.5),
    )


@pytest.fixture(scope="module")
def server(spec, tmp_path_factory):
    started = launch_engine_server(
        spec,
        engine_index=0,
        host="127.0.0.1",
        log_dir=tmp_path_factory.mktemp("sglang-logs"),
        base_gpu_id=0,
        program=SGLANG_ON_TRITON,
        timeout_s=420,
    )
    yield started
    print(f"server log tail:\n{started.log_tail(8)}")
    started.stop()


@pytest.fixture(scope="module")
def engine(server):
    engine = SGLangRolloutEngine(servers=[server.client()], pad_token_id=EOS)
    yield engine
    engine.close()


def prompts(count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 40, (count,), generator=g)
    return [torch.randint(0, EOS, (int(n),), generator=g).tolist() for n in lengths]


def load_model(model_dir, seed: int | None = None):
    """The checkpoint's model on the GPU in bf16; with `seed`, the same shape with fresh random weights."""
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    if seed is not None:
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(model.config).to(torch.bfloat16)
    return model.cuda().eval()


@torch.no_grad()
def trainer_log_probs(model, prompt_rows: list[list[int]], tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] log-probs of `tokens` after each prompt, by the trainer's output-layer pass."""
    out = torch.zeros(tokens.shape, dtype=torch.float32)
    for row, prompt in enumerate(prompt_rows):
        length = int(mask[row].sum())
        ids = torch.tensor(prompt + tokens[row, :length].tolist(), device="cuda")[None]
        hidden = model.model(input_ids=ids).last_hidden_state[0, len(prompt) - 1 : len(prompt) - 1 + length]
        log_probs, _ = chunked_log_probs_and_entropy(
            hidden, model.lm_head.weight, tokens[row, :length].cuda(), with_entropy=False
        )
        out[row, :length] = log_probs.float().cpu()
    return out


def mismatch(train: torch.Tensor, served: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    return summarize_mismatch([log_prob_mismatch(train, served, mask)])


def test_sampled_log_probs_equal_the_trainers(engine, model_dir):
    rows = prompts(16, seed=1)
    out = engine.generate(rows, SamplingParams(max_new_tokens=48, temperature=1.0, seed=5))
    assert out.response_tokens.shape[0] == 16
    assert (out.response_mask.sum(dim=1) >= 1).all()
    model = load_model(model_dir)
    train = trainer_log_probs(model, rows, out.response_tokens, out.response_mask)
    figures = mismatch(train, out.log_probs, out.response_mask)
    # The same trainer pass scored on the next token id instead: what a misaligned or wrong answer looks like.
    shifted = trainer_log_probs(model, rows, (out.response_tokens + 1) % EOS, out.response_mask)
    wrong = mismatch(shifted, out.log_probs, out.response_mask)
    print(f"sampled: {int(out.response_mask.sum())} tokens, mismatch {figures}; scored on the wrong tokens {wrong}")
    assert figures["rollout_log_ratio_abs_max"] < MAX_LOG_RATIO
    assert figures["rollout_k3"] < MAX_K3
    assert wrong["rollout_log_ratio_abs_max"] > 10 * MAX_LOG_RATIO


def test_greedy_equals_the_builtin_engine(engine, spec):
    from ppo_trainer.rollout.torch_engine import TorchRolloutEngine

    rows = prompts(16, seed=2)
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    served = engine.generate(rows, greedy)
    builtin = TorchRolloutEngine(
        model_spec=spec.model, device="cuda", seed=0, dtype="bfloat16", eos_token_id=EOS, pad_token_id=EOS
    )
    local = builtin.generate(rows, greedy)
    del builtin
    torch.cuda.empty_cache()
    first = 8
    same = [torch.equal(served.response_tokens[r, :first], local.response_tokens[r, :first]) for r in range(len(rows))]
    whole = [torch.equal(served.response_tokens[r], local.response_tokens[r]) for r in range(len(rows))]
    print(f"greedy: first {first} tokens equal in {sum(same)}/{len(rows)} rows, all 16 in {sum(whole)}/{len(rows)}")
    # bf16 near-ties may flip a late token; the first tokens of nearly every row must agree.
    assert sum(same) >= len(rows) - 1


def test_update_weights_from_tensor_serves_the_new_weights(engine, model_dir):
    rows = prompts(8, seed=3)
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0)
    new = load_model(model_dir, seed=11)
    engine.update_weights(list(new.named_parameters()))
    out = engine.generate(rows, greedy)
    fresh = mismatch(trainer_log_probs(new, rows, out.response_tokens, out.response_mask), out.log_probs, out.response_mask)
    old = load_model(model_dir)
    stale = mismatch(trainer_log_probs(old, rows, out.response_tokens, out.response_mask), out.log_probs, out.response_mask)
    print(f"after /update_weights_from_tensor: against the new weights {fresh}, against the old {stale}")
    assert fresh["rollout_log_ratio_abs_max"] < MAX_LOG_RATIO
    assert stale["rollout_log_ratio_abs_max"] > 10 * MAX_LOG_RATIO
    # Back to the checkpoint, so that later tests serve what they load.
    engine.update_weights(list(old.named_parameters()))


def test_sleep_frees_memory_and_wake_restores_weights(engine):
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    used = lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**30
    rows = prompts(8, seed=4)
    greedy = SamplingParams(max_new_tokens=24, temperature=0.0)
    before = engine.generate(rows, greedy)
    awake = used()
    engine.sleep()
    asleep = used()
    engine.wake_up()
    woken = used()
    after = engine.generate(rows, greedy)
    print(f"device memory used (nvml): awake {awake:.2f} GiB, asleep {asleep:.2f} GiB, woken {woken:.2f} GiB")
    assert awake - asleep > 10.0  # half of the GPU's memory was the server's weights and KV cache
    assert abs(woken - awake) < 2.0
    assert torch.equal(after.response_tokens, before.response_tokens)
    torch.testing.assert_close(after.log_probs, before.log_probs, atol=0.0, rtol=0.0)
