"""Where a decoding step of the built-in engine spends its time, on the GPU issue's workloads.

Builds the engine (`rollout/torch_engine.py`) on a random Qwen2.5 checkpoint of the chosen shape,
times a whole `generate` (256 prompts of ~100 tokens, 512 new tokens; its decode loop is one
captured CUDA graph a step) three ways: the decoding layer and the sampling compiled (the
engine's default on a GPU), only the sampling compiled, neither; then the default with other
spans of the cache attended a step (`--span-steps`); then profiles decoding steps
with torch.profiler (the same kernels, without the graph) and prints the kernels by device time,
and times the step's parts on their own at the step's shapes: the attention of one layer, the
output layer, the sampling. The figures say which part to make faster; nothing here changes the
engine. Writes decode.json and the profiler's table into --out.

    python3 bench/gpu_decode_profile.py --out $OUT/decode
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT.parent / "trainer"), str(ROOT.parent / "api")]

from gpu_ppo_step import make_checkpoint, make_prompts
from gpu_workloads import EOS, MODELS

from ppo_trainer.rollout.base import SamplingParams
from ppo_trainer.rollout.layout import left_pad, position_ids
from ppo_trainer.rollout.torch_engine import (
    SPAN_STEP,
    StaticKVDecoder,
    TorchRolloutEngine,
    attention_inputs,
    decode_layer,
    layer_output,
    sample_tokens,
)
from ppojob_api.spec import ModelSpec


def timed_call(engine: TorchRolloutEngine, generation) -> dict:
    """The engine's timing of its last `generate` call, with its tokens, a decoding step's
    milliseconds and the call's generated tokens a second."""
    timing = dict(engine.last_timing)
    tokens, columns = int(generation.response_mask.sum()), generation.response_tokens.shape[1]
    return timing | {"tokens": tokens, "columns": columns,
                     "decode_ms_per_step": timing["decode_seconds"] * 1e3 / max(columns - 1, 1),
                     "tokens_per_s": tokens / (timing["prefill_seconds"] + timing["decode_seconds"])}


def device_ms(fn, repeats: int = 50) -> float:
    """Median device milliseconds of `fn()` over `repeats` calls (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def parts(engine: TorchRolloutEngine, batch: int, capacity: int, filled: int) -> dict[str, float]:
    """Device ms of a step's parts at its shapes, with `filled` of `capacity` cache columns valid."""
    model, config = engine.model, engine.model.config
    decoder = StaticKVDecoder(model, batch=batch, capacity=capacity)
    decoder.valid[:, :filled] = True
    kv, group, dim = decoder.kv_heads, decoder.heads // decoder.kv_heads, decoder.head_dim
    q = torch.randn(batch, kv, group, dim, device="cuda", dtype=torch.bfloat16)
    keys = torch.randn(batch, kv, capacity, dim, device="cuda", dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    bias = torch.zeros(batch, 1, group, capacity, device="cuda", dtype=torch.bfloat16)
    bias[..., filled:] = torch.finfo(torch.bfloat16).min
    q_heads = q.reshape(batch, kv * group, 1, dim)
    bias_heads = bias[:, :, :1]
    hidden = torch.randn(batch, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    logits = model.lm_head(hidden)
    uniform = torch.rand(batch, device="cuda")
    layer = model.model.layers[0]
    weights = decoder.weights[0]
    cos, sin = model.model.rotary_emb(hidden[:, None], torch.full((batch, 1), filled - 1, device="cuda"))
    cos, sin = cos[:, None], sin[:, None]

    def before(x):
        return attention_inputs(x, weights, cos, sin, eps=decoder.eps, heads=decoder.heads, kv_heads=kv)

    def after(x, attended):
        return layer_output(x, attended, weights, eps=decoder.eps, activation=decoder.activation)

    compiled_before, compiled_after = torch.compile(before, dynamic=False), torch.compile(after, dynamic=False)
    with torch.inference_mode():
        out = {
            "attention, one layer (SDPA, query heads stacked per kv head, bias)": device_ms(
                lambda: F.scaled_dot_product_attention(q, keys, values, attn_mask=bias)),
            "attention, one layer (SDPA, no mask)": device_ms(
                lambda: F.scaled_dot_product_attention(q, keys, values)),
            "attention, one layer (SDPA enable_gqa, [B,H,1,D], bias: the engine)": device_ms(
                lambda: F.scaled_dot_product_attention(q_heads, keys, values, attn_mask=bias_heads, enable_gqa=True)),
            "attention, one layer (matmul, softmax, matmul)": device_ms(
                lambda: (torch.matmul(q, keys.transpose(-1, -2)).float().add_(bias).softmax(-1).to(q.dtype)
                         @ values)),
            "attention, one layer, only the filled columns (SDPA, no mask)": device_ms(
                lambda: F.scaled_dot_product_attention(q, keys[:, :, :filled], values[:, :, :filled])),
            "MLP, one layer": device_ms(lambda: layer.mlp(hidden[:, None])),
            "a layer before attention (norm, q/k/v, rotary), eager": device_ms(lambda: before(hidden[:, None])),
            "a layer before attention, torch.compile": device_ms(lambda: compiled_before(hidden[:, None])),
            "a layer after attention (o, residual, norm, MLP, residual), eager": device_ms(
                lambda: after(hidden[:, None], q_heads)),
            "a layer after attention, torch.compile": device_ms(lambda: compiled_after(hidden[:, None], q_heads)),
            "q, k, v, o projections, one layer": device_ms(lambda: (
                layer.self_attn.q_proj(hidden), layer.self_attn.k_proj(hidden), layer.self_attn.v_proj(hidden),
                layer.self_attn.o_proj(hidden))),
            "output layer (lm_head)": device_ms(lambda: model.lm_head(hidden)),
            "sampling (two-level inverse CDF), eager": device_ms(
                lambda: sample_tokens(logits, temperature=1.0, top_p=1.0, uniform=uniform)),
            "sampling (two-level inverse CDF), compiled: the engine's": device_ms(
                lambda: engine.sample(logits, temperature=1.0, top_p=1.0, uniform=uniform)),
            "sampling, exponential race (argmax of p / Exp(1)) with its log-prob": device_ms(
                lambda: _race(logits)),
            "log_softmax + gather (the token's log-prob alone)": device_ms(
                lambda: logits.float().log_softmax(-1).gather(-1, uniform.long()[:, None])),
        }
        compiled_race = torch.compile(_race)
        out["sampling, exponential race, torch.compile"] = device_ms(lambda: compiled_race(logits))
    return out


def _race(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scaled = logits.float()
    log_z = scaled.logsumexp(-1, keepdim=True)
    noise = torch.empty_like(scaled).exponential_()
    token = ((scaled - log_z).exp() / noise).argmax(-1)
    return token, (scaled.gather(-1, token[:, None]) - log_z).squeeze(1)


def profile_steps(engine: TorchRolloutEngine, prompts: list[list[int]], steps: int) -> str:
    """torch.profiler's kernel table over `steps` eager decoding steps after a prefill."""
    ids, mask = left_pad(prompts, pad_id=engine.pad_token_id)
    ids, mask = ids.cuda(), mask.cuda()
    width = ids.shape[1]
    decoder = StaticKVDecoder(engine.model, batch=ids.shape[0], capacity=width + 512)
    positions = position_ids(mask)
    uniform = torch.rand(ids.shape[0], device="cuda")
    sample = engine.sample
    with torch.inference_mode():
        logits = decoder.prefill(ids, mask, positions)
        token, _ = sample(logits, temperature=1.0, top_p=1.0, uniform=uniform)
        position = positions[:, -1] + 1
        slot = torch.full((1,), width, dtype=torch.long, device="cuda")

        def step():
            nonlocal token
            logits = decoder.step(token, position, slot, columns=decoder.valid.shape[1])
            token, _ = sample(logits, temperature=1.0, top_p=1.0, uniform=uniform)
            position.add_(1)
            slot.add_(1)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(MODELS))
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--span-steps", type=lambda text: [int(n) for n in text.split(",")], default=[32, 128, 4096],
                        help="other cache spans to time the default engine with (4096: one span, the whole cache)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="decode-")) / args.model
    make_checkpoint(directory, seed=0, config=MODELS[args.model])
    spec = ModelSpec(path=str(directory), tokenizer="builtin:tiny", dtype="bfloat16")
    prompts = make_prompts(args.prompts, 100, seed=0)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, seed=1)
    runs, engines, outputs = [], {}, {}
    for compiled in ("layer and sampling", "sampling", "nothing"):
        engine = engines[compiled] = TorchRolloutEngine(
            model_spec=spec, device="cuda", seed=0, eos_token_id=EOS, pad_token_id=EOS, compiled=compiled != "nothing")
        if compiled == "sampling":
            engine.step_layer = decode_layer
        started = time.perf_counter()
        engine.generate(prompts, params)  # warm-up (and compiling)
        warm_up = time.perf_counter() - started
        for _ in range(2):
            generation = outputs[compiled] = engine.generate(prompts, params)
            runs.append(timed_call(engine, generation) | {"compiled": compiled, "warm_up_seconds": warm_up})
            print(json.dumps(runs[-1]), flush=True)
    same = (outputs["layer and sampling"].response_tokens == outputs["nothing"].response_tokens).float().mean().item()
    print(f"compiled and eager decoding: {same:.2%} of token positions equal (a row that diverges differs after)")
    engine = engines["layer and sampling"]
    spans = []
    for span_step in args.span_steps:  # the default engine attending over other spans of the cache
        engine.span_step = span_step
        engine.generate(prompts, params)  # warm-up
        for _ in range(2):
            generation = engine.generate(prompts, params)
            spans.append(timed_call(engine, generation) | {"span_step": span_step})
            print(json.dumps(spans[-1]), flush=True)
        same_span = (generation.response_tokens == outputs["layer and sampling"].response_tokens).float().mean().item()
        print(f"span step {span_step} against the default's: {same_span:.2%} of token positions equal")
    engine.span_step = SPAN_STEP
    width = max(len(p) for p in prompts)
    measured = {filled: parts(engine, args.prompts, width + args.max_new_tokens, filled)
                for filled in (width + 64, width + args.max_new_tokens)}
    for filled, figures in measured.items():
        print(f"\nparts at {filled} of {width + args.max_new_tokens} cache columns filled (device ms):")
        for name, ms in figures.items():
            print(f"  {ms:8.3f}  {name}")
    table = profile_steps(engine, prompts, args.profile_steps)
    print(f"\nkernels over {args.profile_steps} decoding steps (compiled sampling, no graph):\n{table}")
    (args.out / "profile.txt").write_text(table)
    (args.out / "decode.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": runs,
                                                      "same_tokens": same, "spans": spans, "parts_ms": measured}, indent=1))


if __name__ == "__main__":
    main()
