"""TorchRolloutEngine on the tiny model: sampling, log-probs, EOS, weight updates, sleep; the layout."""

from __future__ import annotations

import pytest
import torch

from ppo_trainer.backends.torch_backend import TorchBackend
from ppo_trainer.rollout.base import Generation, SamplingParams
from ppo_trainer.rollout.layout import build_rollout_batch, left_pad, position_ids
from ppo_trainer.rollout.torch_engine import (
    StaticKVDecoder,
    TorchRolloutEngine,
    inverse_cdf,
    sample_tokens,
    top_p_filter,
)
from ppojob_api.spec import ModelSpec

TINY = ModelSpec(path="builtin:tiny")
BOS, EOS, PAD = 256, 257, 258
PROMPTS = [[BOS, 72, 105], [BOS, 49, 43, 50, 61], [BOS], [BOS, 97, 98, 99, 100, 101, 102]]


def make_engine(seed: int = 0, **overrides) -> TorchRolloutEngine:
    return TorchRolloutEngine(**{"model_spec": TINY, "device": "cpu", "seed": seed, **overrides})


def make_backend(seed: int = 0, **overrides) -> TorchBackend:
    kwargs = {"model_spec": TINY, "role": "actor", "learning_rate": 1e-3, "max_grad_norm": 1.0}
    kwargs |= {"device": "cpu", "seed": seed}
    return TorchBackend(**{**kwargs, **overrides})


# --- log-probs agree with the trainer ----------------------------------------------------------


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_engine_log_probs_equal_backend_forward(temperature, top_p):
    engine = make_engine(seed=1)
    params = SamplingParams(max_new_tokens=12, temperature=temperature, top_p=top_p, seed=3)
    generation = engine.generate(PROMPTS, params)
    batch = build_rollout_batch(PROMPTS, generation, [0.0] * len(PROMPTS), PAD)
    recomputed = make_backend(seed=1, logits_temperature=temperature).forward(batch)["log_probs"]
    torch.testing.assert_close(recomputed, batch.rollout_log_probs, atol=1e-5, rtol=0)
    assert torch.all(batch.rollout_log_probs[batch.response_mask.bool()] < 0)


# --- the static-cache forward ------------------------------------------------------------------


def tiny_qwen2() -> torch.nn.Module:
    """A 2-layer Qwen2 (q/k/v biases, 2 query heads per key/value head), random weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen2ForCausalLM(config).eval()


def test_static_decoder_prefill_and_step_match_the_hugging_face_forward_on_qwen2():
    model = tiny_qwen2()
    ids, mask = left_pad(PROMPTS, pad_id=PAD)
    following = torch.tensor([5, 6, 7, 8])
    decoder = StaticKVDecoder(model, batch=len(PROMPTS), capacity=ids.shape[1] + 3)
    with torch.no_grad():
        prefill = decoder.prefill(ids, mask, position_ids(mask))
        # The step attends over the filled columns only, short of the cache's capacity.
        step = decoder.step(following, position_ids(mask)[:, -1] + 1, torch.tensor([ids.shape[1]]),
                            columns=ids.shape[1] + 1)
        full_mask = torch.cat([mask, torch.ones(len(PROMPTS), 1, dtype=torch.long)], dim=1)
        reference = model(
            input_ids=torch.cat([ids, following[:, None]], dim=1),
            attention_mask=full_mask,
            position_ids=position_ids(full_mask),
        ).logits
    torch.testing.assert_close(prefill, reference[:, -2], atol=1e-4, rtol=0)
    torch.testing.assert_close(step, reference[:, -1], atol=1e-4, rtol=0)


def test_attending_over_spans_of_the_cache_changes_no_token_or_log_prob():
    params = SamplingParams(max_new_tokens=20, temperature=1.0, seed=5)
    whole = make_engine(seed=3, eos_token_id=-1, span_step=4096).generate(PROMPTS, params)
    for span_step in (1, 3, 8):
        spans = make_engine(seed=3, eos_token_id=-1, span_step=span_step).generate(PROMPTS, params)
        assert torch.equal(spans.response_tokens, whole.response_tokens)
        torch.testing.assert_close(spans.log_probs, whole.log_probs, atol=1e-5, rtol=0)


def test_span_step_below_one_is_rejected_by_name():
    with pytest.raises(ValueError, match="span_step must be >= 1"):
        make_engine(span_step=0)


# --- greedy and sampling -----------------------------------------------------------------------


def naive_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Argmax decoding with a full forward per token and no cache."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_greedy_is_deterministic_and_equals_argmax_decoding_without_cache():
    engine = make_engine(seed=2, eos_token_id=-1)
    params = SamplingParams(max_new_tokens=10, temperature=0.0, seed=0)
    first = engine.generate(PROMPTS, params)
    second = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10, temperature=0.0, seed=99))
    assert torch.equal(first.response_tokens, second.response_tokens)
    assert first.response_mask.all()
    for row, prompt in enumerate(PROMPTS):
        assert first.response_tokens[row].tolist() == naive_greedy(engine.model, prompt, 10)


def test_sampling_is_deterministic_per_seed():
    engine = make_engine(eos_token_id=-1)
    a = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, seed=5))
    b = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, seed=5))
    c = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, seed=6))
    assert torch.equal(a.response_tokens, b.response_tokens) and torch.equal(a.log_probs, b.log_probs)
    assert not torch.equal(a.response_tokens, c.response_tokens)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]]))
    kept = lambda p: torch.isfinite(top_p_filter(logits, p))[0].tolist()
    assert kept(0.5) == [False, True, False, False]
    assert kept(0.8) == [False, True, False, True]
    assert kept(0.81) == [False, True, True, True]
    assert kept(1.0) == [True, True, True, True]
    assert kept(0.01) == [False, True, False, False]


def test_sampling_with_top_p_never_draws_outside_the_nucleus():
    logits = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3])).expand(4000, 4)
    uniform = torch.rand(4000, generator=torch.Generator().manual_seed(0))
    tokens, log_probs = sample_tokens(logits, temperature=1.0, top_p=0.8, uniform=uniform)
    assert set(tokens.tolist()) == {1, 3}
    assert (tokens == 1).float().mean().item() == pytest.approx(0.5 / 0.8, abs=0.03)
    # Reported log-probs are under the full (temperature-scaled) distribution, not the nucleus.
    torch.testing.assert_close(log_probs, torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3]))[tokens])


def test_sampling_follows_the_temperature_scaled_distribution():
    logits = torch.log(torch.tensor([0.2, 0.8])).expand(20000, 2)
    uniform = torch.rand(20000, generator=torch.Generator().manual_seed(1))
    tokens, log_probs = sample_tokens(logits, temperature=2.0, top_p=1.0, uniform=uniform)
    scaled = torch.log_softmax(torch.log(torch.tensor([0.2, 0.8])) / 2.0, -1)
    assert (tokens == 1).float().mean().item() == pytest.approx(scaled[1].exp().item(), abs=0.015)
    torch.testing.assert_close(log_probs, scaled[tokens])


def test_inverse_cdf_sampling_never_draws_a_token_of_probability_zero():
    logits = torch.tensor([[float("-inf"), 0.0, float("-inf"), 1.0, float("-inf")]]).expand(5, 5)
    uniform = torch.tensor([0.0, 0.2, 0.5, 0.9, 1.0 - 2**-24])
    tokens, log_probs = sample_tokens(logits, temperature=1.0, top_p=1.0, uniform=uniform)
    assert set(tokens.tolist()) <= {1, 3} and tokens[0] == 1 and tokens[-1] == 3
    assert torch.isfinite(log_probs).all()


def test_two_level_inverse_cdf_picks_the_token_a_float64_running_sum_picks():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(512, 1000, generator=generator) * 3  # 1000 columns: the last block is partial
    logits[:, ::7] = float("-inf")
    uniform = torch.rand(512, generator=generator)
    tokens, peak, total = inverse_cdf(logits, uniform)
    weights = (logits.double() - logits.double().amax(-1, keepdim=True)).exp()
    running = weights.cumsum(-1)
    expected = torch.searchsorted(running, uniform.double()[:, None] * running[:, -1:], right=True).squeeze(1)
    assert (tokens == expected).float().mean().item() >= 0.998  # a mismatch only within rounding of a boundary
    assert torch.isfinite(logits.gather(1, tokens[:, None])).all()
    torch.testing.assert_close(total.double(), running[:, -1], rtol=1e-5, atol=0)
    torch.testing.assert_close(peak, logits.amax(-1))


# --- EOS and padding ---------------------------------------------------------------------------


def test_eos_stops_a_row_and_the_mask_includes_it():
    free = make_engine(seed=4, eos_token_id=-1).generate(
        PROMPTS, SamplingParams(max_new_tokens=12, temperature=0)
    )
    stop_token = int(free.response_tokens[0, 3])
    first_stop = {row: (free.response_tokens[row] == stop_token).nonzero() for row in range(len(PROMPTS))}
    out = make_engine(seed=4, eos_token_id=stop_token).generate(
        PROMPTS, SamplingParams(max_new_tokens=12, temperature=0)
    )
    for row, hits in first_stop.items():
        length = int(hits[0]) + 1 if len(hits) else 12
        assert out.response_mask[row].tolist() == [1.0] * length + [0.0] * (
            out.response_mask.shape[1] - length
        )
        assert out.response_tokens[row, :length].tolist() == free.response_tokens[row, :length].tolist()
        assert torch.all(out.response_tokens[row, length:] == PAD)
        assert torch.all(out.log_probs[row, length:] == 0)
    assert out.response_tokens.shape[1] == int(out.response_mask.sum(1).max())


def test_generation_stops_early_when_every_row_is_done():
    free = make_engine(seed=4, eos_token_id=-1).generate(
        [[BOS]], SamplingParams(max_new_tokens=12, temperature=0)
    )
    stop_token = int(free.response_tokens[0, 2])
    out = make_engine(seed=4, eos_token_id=stop_token).generate(
        [[BOS]], SamplingParams(max_new_tokens=12, temperature=0)
    )
    length = int((free.response_tokens[0] == stop_token).nonzero()[0]) + 1
    assert out.response_tokens.shape == (1, length) and out.response_mask.all()


def test_left_padding_does_not_change_a_rows_log_probs_or_tokens():
    engine = make_engine(seed=7, eos_token_id=-1)
    params = SamplingParams(max_new_tokens=8, temperature=0)
    alone = engine.generate([PROMPTS[0]], params)
    padded = engine.generate([PROMPTS[0], [BOS] + list(range(30))], params)
    assert torch.equal(alone.response_tokens[0], padded.response_tokens[0])
    torch.testing.assert_close(alone.log_probs[0], padded.log_probs[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "params,field",
    [
        (SamplingParams(max_new_tokens=0), "max_new_tokens"),
        (SamplingParams(max_new_tokens=4, temperature=-1.0), "temperature"),
        (SamplingParams(max_new_tokens=4, top_p=0.0), "top_p"),
        (SamplingParams(max_new_tokens=2000), "max_new_tokens"),
    ],
)
def test_generate_rejects_bad_params_naming_the_field(params, field):
    with pytest.raises(ValueError, match=field):
        make_engine().generate(PROMPTS, params)


def test_generate_rejects_empty_prompts():
    with pytest.raises(ValueError, match="prompt"):
        make_engine().generate([[BOS], []], SamplingParams(max_new_tokens=2))


# --- weights and sleep -------------------------------------------------------------------------


def test_update_weights_makes_the_engine_serve_the_new_weights():
    engine = make_engine(seed=1, eos_token_id=-1)
    actor = make_backend(seed=2)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=0)
    before = engine.generate(PROMPTS, params)
    storage = engine.model.lm_head.weight.data_ptr()
    engine.update_weights(actor.named_weights())
    after = engine.generate(PROMPTS, params)
    assert engine.model.lm_head.weight.data_ptr() == storage
    assert not torch.equal(before.log_probs, after.log_probs)
    expected = make_engine(seed=2, eos_token_id=-1).generate(PROMPTS, params)
    assert torch.equal(after.response_tokens, expected.response_tokens)
    batch = build_rollout_batch(PROMPTS, after, [0.0] * len(PROMPTS), PAD)
    torch.testing.assert_close(actor.forward(batch)["log_probs"], batch.rollout_log_probs, atol=1e-5, rtol=0)


def test_update_weights_rejects_unknown_names_and_wrong_shapes():
    engine = make_engine()
    with pytest.raises(ValueError, match="not in the served model"):
        engine.update_weights([("model.nope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([("lm_head.weight", torch.zeros(3, 3))])


def test_sleep_and_wake_are_idempotent_transitions():
    engine = make_engine(eos_token_id=-1)
    params = SamplingParams(max_new_tokens=6, seed=1)
    before = engine.generate(PROMPTS, params)
    engine.sleep()
    engine.sleep()
    assert engine.asleep and engine.last_transfer["direction"] == "sleep"
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.generate(PROMPTS, params)
    engine.update_weights(make_backend(seed=0).named_weights())
    engine.wake_up()
    engine.wake_up()
    assert not engine.asleep and engine.last_transfer["direction"] == "wake_up"
    assert torch.equal(engine.generate(PROMPTS, params).response_tokens, before.response_tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sleep_moves_weights_to_pinned_host_memory_on_cuda():
    engine = make_engine(device="cuda", eos_token_id=-1)
    params = SamplingParams(max_new_tokens=6, seed=1)
    before = engine.generate(PROMPTS, params)
    engine.sleep()
    assert all(p.device.type == "cpu" and p.is_pinned() for p in engine.model.parameters())
    assert engine.last_transfer["bytes"] > 0
    engine.wake_up()
    assert all(p.device.type == "cuda" for p in engine.model.parameters())
    assert torch.equal(engine.generate(PROMPTS, params).response_tokens, before.response_tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_decoding_equals_eager_decoding():
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3)
    for span_step in (64, 8):  # one graph; a graph per 8 cache columns, sharing their memory
        engine = make_engine(device="cuda", eos_token_id=-1, span_step=span_step)
        graphs = engine.generate(PROMPTS, params)
        # Spans of 8 past 7 prompt columns: 16, 24, 32, 40 and 47 (column 8's one step runs eagerly).
        assert engine.last_timing["graphs_captured"] == (1 if span_step == 64 else 5)
        eager = make_engine(device="cuda", eos_token_id=-1, cuda_graphs=False).generate(PROMPTS, params)
        assert torch.equal(graphs.response_tokens, eager.response_tokens)
        torch.testing.assert_close(graphs.log_probs, eager.log_probs, atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_decoding_draws_the_eager_tokens_and_the_trainers_log_probs():
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3)
    compiled = make_engine(device="cuda", eos_token_id=-1, compiled=True, span_step=8)
    fused = compiled.generate(PROMPTS, params)
    eager = make_engine(device="cuda", eos_token_id=-1, compiled=False).generate(PROMPTS, params)
    assert torch.equal(fused.response_tokens, eager.response_tokens)
    torch.testing.assert_close(fused.log_probs, eager.log_probs, atol=1e-4, rtol=0)
    batch = build_rollout_batch(PROMPTS, fused, [0.0] * len(PROMPTS), PAD)
    recomputed = make_backend(device="cuda", compile=False).forward(batch)["log_probs"].cpu()
    torch.testing.assert_close(recomputed, batch.rollout_log_probs, atol=1e-4, rtol=0)
    # Longer prompts: another cache capacity and other spans.
    longer = [prompt + [3, 4, 5] for prompt in PROMPTS]
    eager = make_engine(device="cuda", eos_token_id=-1, compiled=False).generate(longer, params)
    fused = compiled.generate(longer, params)
    assert torch.equal(fused.response_tokens, eager.response_tokens)
    torch.testing.assert_close(fused.log_probs, eager.log_probs, atol=1e-4, rtol=0)


# --- layout ------------------------------------------------------------------------------------


def test_build_rollout_batch_lays_out_left_padded_prompts_and_right_padded_responses():
    generation = Generation(
        response_tokens=torch.tensor([[5, EOS, PAD], [6, 7, 8]]),
        response_mask=torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]),
        log_probs=torch.tensor([[-1.0, -2.0, 0.0], [-3.0, -4.0, -5.0]]),
    )
    batch = build_rollout_batch([[BOS, 1, 2], [BOS]], generation, [1.0, 0.0], PAD, prompts=["a", "b"])
    assert batch.prompt_length == 3 and batch.response_length == 3
    assert batch.tokens.tolist() == [[BOS, 1, 2, 5, EOS, PAD], [PAD, PAD, BOS, 6, 7, 8]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert batch.scores.tolist() == [1.0, 0.0] and batch.prompts == ["a", "b"]
    assert batch.tokens.dtype == torch.long and batch.response_mask.dtype == torch.float32
    with pytest.raises(ValueError, match="scores"):
        build_rollout_batch([[BOS, 1, 2], [BOS]], generation, [1.0], PAD)
    with pytest.raises(ValueError, match="prompts"):
        build_rollout_batch([[BOS]], generation, [1.0], PAD)


def test_position_ids_count_real_tokens_only():
    ids, mask = left_pad([[1, 2, 3], [4]], pad_id=PAD)
    assert ids.tolist() == [[1, 2, 3], [PAD, PAD, 4]]
    assert position_ids(mask).tolist() == [[0, 1, 2], [0, 0, 0]]
