"""The built-in rollout engine: batched sampling from a Llama/Qwen2 causal LM over a static KV cache.

It owns its decode loop and its attention (`StaticKVDecoder`). The key/value cache is allocated
once per call for prompt + max_new_tokens positions, the prompts are prefilled in one pass, and
every decoding step has fixed shapes (one token per row; keys masked by a validity map that the
step itself extends). A step attends over the cache's first columns only, as many as it has
filled rounded up to a multiple of `span_step`, so that reading the cache costs what the rows
hold rather than what they may come to hold. The step and the sampling that follows it advance
their own state on the device (cache slot, positions, output column, finished rows), so on a
CUDA device the whole step, sampling included, is captured once per span and replayed as one
CUDA graph. The forward reuses the Hugging Face modules' weights (projections, norms, MLP, rotary
embedding), so weight updates in place reach the graphs. Sampling is temperature and top-p by
inverse CDF over uniforms drawn up front from a per-call seeded generator; the host asks whether
every row has finished only every FINISH_CHECK_EVERY steps. Reported log-probs are those of the
sampled tokens under the temperature-scaled float32 logits, before top-p filtering:
log_softmax(logits / temperature); with temperature 0 (greedy) under the unscaled logits. A
trainer recomputes the same numbers with TorchBackend(logits_temperature=temperature). Must not
depend on Ray or the PPO loop.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ppo_trainer.models.builtin import build_policy
from ppo_trainer.models.tokenizer import load_tokenizer
from ppo_trainer.offload.host_mirror import HostMirror
from ppo_trainer.rollout.base import Generation, SamplingParams
from ppo_trainer.rollout.layout import left_pad, position_ids
from ppojob_api.spec import ModelSpec

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
FINISH_CHECK_EVERY = 32
"""Steps between two host checks of "every row finished" (each check waits for the device)."""
SPAN_STEP = 64
"""Cache columns a decoding step attends over come in multiples of this many: each multiple is
one CUDA graph to capture (a few milliseconds), and the columns past the filled ones are read
for nothing (on average half of it a step)."""


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """[B, V] logits with -inf outside the smallest set of most likely tokens whose mass reaches
    `top_p` (the most likely token is always kept)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


SAMPLING_BLOCK = 128
"""Vocabulary columns per block of the two-level inverse CDF (`inverse_cdf`)."""


def inverse_cdf(logits: torch.Tensor, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, V] float32 logits and [B] uniforms in [0, 1) -> ([B] tokens, [B] max logit, [B] sum of
    exp(logit - max)): the first token whose cumulative weight exceeds uniform * total.

    Two levels, so that no pass writes a [B, V] running sum: the weights' sums per block of
    SAMPLING_BLOCK columns and their running sum pick the block, a running sum inside that one
    block picks the token. A token of weight zero is never picked.
    """
    batch, vocab = logits.shape
    peak = logits.amax(dim=-1, keepdim=True)
    weights = F.pad((logits - peak).exp(), (0, (-vocab) % SAMPLING_BLOCK)).view(batch, -1, SAMPLING_BLOCK)
    block_sums = weights.sum(dim=-1)  # [B, blocks]
    block_ends = block_sums.cumsum(dim=-1)
    total = block_ends[:, -1:]
    target = uniform[:, None].to(total.dtype) * total
    block = torch.searchsorted(block_ends, target, right=True).clamp_(max=block_ends.shape[1] - 1)  # [B, 1]
    before = block_ends.gather(1, block) - block_sums.gather(1, block)
    inside = weights.gather(1, block[:, :, None].expand(-1, -1, SAMPLING_BLOCK)).squeeze(1).cumsum(dim=-1) + before
    offset = torch.searchsorted(inside, target, right=True).clamp_(max=SAMPLING_BLOCK - 1)
    tokens = (block * SAMPLING_BLOCK + offset).squeeze(1).clamp_(max=vocab - 1)
    return tokens, peak.squeeze(1), total.squeeze(1)


def sample_tokens(
    logits: torch.Tensor, *, temperature: float, top_p: float, uniform: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V] logits (any float dtype) and [B] uniforms in [0, 1) -> ([B] sampled tokens, [B]
    their log-probs under float32 logits / temperature).

    Inverse-CDF sampling (`inverse_cdf`): the randomness is an input and the whole draw is
    fixed-shape device work (safe inside a CUDA graph). Temperature 0 is greedy (argmax), its
    log-probs under the unscaled logits. Top-p filtering (sorting the vocabulary) runs only when
    top_p < 1.
    """
    scaled = logits.float()
    if temperature not in (0.0, 1.0):
        scaled = scaled / temperature
    if temperature == 0:
        tokens = scaled.argmax(dim=-1)
        return tokens, scaled.gather(-1, tokens[:, None]).squeeze(1) - scaled.logsumexp(dim=-1)
    candidates = top_p_filter(scaled, top_p) if top_p < 1.0 else scaled
    tokens, peak, total = inverse_cdf(candidates, uniform)
    picked = scaled.gather(-1, tokens[:, None]).squeeze(1)
    if top_p < 1.0:
        return tokens, picked - scaled.logsumexp(dim=-1)
    return tokens, picked - peak - total.log()


class LayerWeights(NamedTuple):
    """One decoder layer's tensors, the projections that read the same input packed into one
    matrix each (q, k and v; gate and up): fewer, wider GEMMs, which a 256-row decoding step
    runs closer to the GPU's bandwidth. Packing copies the weights, so it is done per `generate`
    call (`StaticKVDecoder`): updates in place between calls reach the next one. Biases are None
    where the model has none (Llama)."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor

    @classmethod
    def of(cls, layer: torch.nn.Module) -> LayerWeights:
        attention, mlp = layer.self_attn, layer.mlp
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        biases = [projection.bias for projection in projections]
        return cls(
            layer.input_layernorm.weight, torch.cat([projection.weight for projection in projections]),
            None if biases[0] is None else torch.cat(biases), attention.o_proj.weight,
            layer.post_attention_layernorm.weight, torch.cat((mlp.gate_proj.weight, mlp.up_proj.weight)),
            mlp.down_proj.weight,
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Llama/Qwen2 RMSNorm: normalise in float32, round to the input dtype, scale."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def attention_inputs(
    x: torch.Tensor, w: LayerWeights, cos: torch.Tensor, sin: torch.Tensor, *, eps: float, heads: int, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, S, hidden] -> rotated queries [B, heads, S, D], rotated keys and values [B, kv, S, D].
    Rotary embedding is x * cos + roll(x) * signed sin (`sin` carries the sign)."""
    batch, length, _ = x.shape
    head_dim = w.qkv.shape[0] // (heads + 2 * kv_heads)
    h = rms_norm(x, w.input_norm, eps)
    q, k, v = F.linear(h, w.qkv, w.qkv_bias).view(batch, length, -1, head_dim).split(
        (heads, kv_heads, kv_heads), dim=2)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    half = head_dim // 2
    q = torch.addcmul(q * cos, q.roll(half, dims=-1), sin)
    k = torch.addcmul(k * cos, k.roll(half, dims=-1), sin)
    return q, k, v


def layer_output(x: torch.Tensor, attended: torch.Tensor, w: LayerWeights, *, eps: float, activation) -> torch.Tensor:
    """The rest of a layer after attention ([B, heads, S, D]): output projection, residual, MLP, residual."""
    batch, _, length, _ = attended.shape
    x = x + F.linear(attended.transpose(1, 2).reshape(batch, length, -1), w.o)
    h = rms_norm(x, w.post_norm, eps)
    gate, up = F.linear(h, w.gate_up).chunk(2, dim=-1)
    return x + F.linear(activation(gate) * up, w.down)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, *, scaling: float) -> torch.Tensor:
    """Queries [B, heads, S, D] against keys and values [B, kv, L, D] under the additive `bias`
    [B, 1, S, L]; grouped-query heads through `enable_gqa` (keys and values never repeated)."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=scaling,
                                          enable_gqa=q.shape[1] != keys.shape[1])


def decode_layer(x: torch.Tensor, w: LayerWeights, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor, slot: torch.Tensor, bias: torch.Tensor, *, eps: float, heads: int,
                 kv_heads: int, scaling: float, activation) -> torch.Tensor:
    """One layer over the KV cache ([B, S, hidden]): its keys and values written into the cache
    columns `slot` ([S] int64) of this layer's `keys` and `values`, attention over the cache under
    `bias`. A decoding step passes one column; the prefill the prompt's columns."""
    q, k, v = attention_inputs(x, w, cos, sin, eps=eps, heads=heads, kv_heads=kv_heads)
    keys.index_copy_(2, slot, k)
    values.index_copy_(2, slot, v)
    return layer_output(x, attend(q, keys, values, bias, scaling=scaling), w, eps=eps, activation=activation)


class StaticKVDecoder:
    """A Llama/Qwen2 forward over a preallocated KV cache for `batch` rows and `capacity` positions.

    `prefill` runs the left-padded prompts (columns 0..P-1 of the cache); `step` runs one token
    per row into the cache column `slot`, attending over the first `columns` columns, each layer
    through `step_layer` (`decode_layer`, or the engine's compiled copy of it: one graph serves
    every layer). Attention is one
    `scaled_dot_product_attention` with grouped-query heads (`enable_gqa`; on an H200 a third
    faster than stacking each key/value head's query heads) and the validity of keys as an
    additive bias built once per pass; masked keys get the dtype's lowest value rather than
    -inf, so a padding query (which sees no key) yields finite garbage instead of NaNs. cos and
    sin of the rotary embedding are computed once per pass.
    """

    def __init__(self, model: torch.nn.Module, *, batch: int, capacity: int, step_layer: Callable = decode_layer):
        config = model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type {config.model_type!r} is not supported by the torch rollout engine; "
                f"use one of {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        self.model = model
        layers = list(model.model.layers)
        if any(getattr(layer.self_attn, "sliding_window", None) for layer in layers):
            raise ValueError("sliding-window attention layers are not supported by the torch rollout engine")
        self.weights = [LayerWeights.of(layer) for layer in layers]
        self.step_layer = step_layer
        self.activation = F.silu if config.hidden_act == "silu" else layers[0].mlp.act_fn
        self.eps = float(config.rms_norm_eps)
        self.kv_heads = config.num_key_value_heads
        self.heads = config.num_attention_heads
        self.head_dim = layers[0].self_attn.head_dim
        self.scaling = float(layers[0].self_attn.scaling)
        weight = model.lm_head.weight
        shape = (batch, self.kv_heads, capacity, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=weight.dtype, device=weight.device) for _ in layers]
        self.values = [torch.zeros(shape, dtype=weight.dtype, device=weight.device) for _ in layers]
        self.valid = torch.zeros((batch, capacity), dtype=torch.bool, device=weight.device)

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[B, P] prompts -> [B, V] logits (the model's dtype) of the next token; fills cache columns 0..P-1."""
        width = ids.shape[1]
        self.valid[:, :width] = mask.bool()
        causal = torch.ones((width, width), dtype=torch.bool, device=ids.device).tril()
        bias = self._bias(causal[None, :, :] & self.valid[:, None, :width])  # [B, query, key] allowed

        columns = torch.arange(width, device=ids.device)

        def layer(index: int, x: torch.Tensor, w: LayerWeights, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            return decode_layer(x, w, cos, sin, self.keys[index][:, :, :width], self.values[index][:, :, :width],
                                columns, bias, eps=self.eps, heads=self.heads, kv_heads=self.kv_heads,
                                scaling=self.scaling, activation=self.activation)

        return self._forward(ids, positions, layer)

    def step(self, token: torch.Tensor, position: torch.Tensor, slot: torch.Tensor, *, columns: int) -> torch.Tensor:
        """[B] tokens at [B] positions, written to cache column `slot` ([1] int64, on the device,
        below `columns`), attending over the cache's first `columns` columns -> [B, V] logits.
        Fixed shapes and no host reads: safe to capture in a graph."""
        self.valid.index_fill_(1, slot, True)
        bias = self._bias(self.valid[:, None, :columns])  # [B, 1 query, columns]

        def layer(index: int, x: torch.Tensor, w: LayerWeights, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            return self.step_layer(x, w, cos, sin, self.keys[index][:, :, :columns],
                                   self.values[index][:, :, :columns], slot, bias, eps=self.eps, heads=self.heads,
                                   kv_heads=self.kv_heads, scaling=self.scaling, activation=self.activation)

        return self._forward(token[:, None], position[:, None], layer)

    def _bias(self, allowed: torch.Tensor) -> torch.Tensor:
        """[B, query, key] booleans -> [B, 1, query, key] additive attention bias."""
        dtype = self.model.lm_head.weight.dtype
        bias = torch.zeros(allowed[:, None].shape, dtype=dtype, device=allowed.device)
        return bias.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, layer: Callable) -> torch.Tensor:
        inner = self.model.model
        x = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(x, positions)  # [B, S, D]
        half = self.head_dim // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        cos, sin = cos[:, None], sin[:, None]  # against [B, heads, S, D]
        for index, weights in enumerate(self.weights):
            x = layer(index, x, weights, cos, sin)
        return self.model.lm_head(rms_norm(x[:, -1], inner.norm.weight, self.eps))


def capture_step(step: Callable[[], None], pool: tuple | None = None) -> torch.cuda.CUDAGraph:
    """Run `step` once eagerly (it initialises the libraries' workspaces for its shapes and counts
    as a real step), then capture it in a CUDA graph, its temporaries in memory `pool` (a graph's
    `pool()`: graphs replayed one after another share it), and return the graph.

    Both on a side stream and without `torch.cuda.graph`'s synchronize and cache release: the
    device goes on with the steps queued before while the host captures. `step` must read and
    write only fixed buffers and advance its own state on the device.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        step()
        graph.capture_begin(pool=pool)
        try:
            step()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    return graph


class TorchRolloutEngine:
    """A RolloutEngine over `build_policy(model_spec, seed=seed)`, awake after construction.

    EOS and PAD ids come from the model's tokenizer unless given. `cuda_graphs` (default: on for
    CUDA devices) captures the decoding step once per span of `span_step` cache columns in a
    `generate` call; `compiled` (default: on for CUDA devices) runs the sampling and the decoding
    step's layers through torch.compile, which fuses the sampling's passes over the vocabulary
    (on an H200, 0.22 instead of 0.59 ms a step for 256 rows of 151,936 logits; the same draw up
    to rounding of the running sums) and a layer's norms, rotary embedding and residuals; the
    first call compiles them, into the process's compile cache. `last_timing` holds the seconds
    of the last call's prefill and decode loop (its captures included) and the number of graphs
    it captured.
    """

    def __init__(
        self,
        *,
        model_spec: ModelSpec,
        device: str | torch.device,
        seed: int,
        dtype: str | torch.dtype | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        cuda_graphs: bool | None = None,
        compiled: bool | None = None,
        span_step: int = SPAN_STEP,
    ):
        self.device = torch.device(device)
        self.model = build_policy(model_spec, seed=seed, device=self.device, dtype=dtype)
        self.model.requires_grad_(False).eval()
        if self.model.config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model {model_spec.path!r} is a {self.model.config.model_type!r} model; the torch rollout "
                f"engine serves {', '.join(SUPPORTED_MODEL_TYPES)} models"
            )
        if eos_token_id is None or pad_token_id is None:
            tokenizer = load_tokenizer(model_spec)
            eos_token_id = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
            pad_token_id = tokenizer.pad_token_id if pad_token_id is None else pad_token_id
        self.eos_token_id = int(eos_token_id)
        self.pad_token_id = int(pad_token_id)
        if span_step < 1:
            raise ValueError(f"span_step must be >= 1 cache column, got {span_step}")
        self.span_step = span_step
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA device; this engine runs on {self.device}")
        compiled = self.device.type == "cuda" if compiled is None else compiled
        self.sample = torch.compile(sample_tokens, dynamic=False) if compiled else sample_tokens
        # One graph for every layer; a second span of the cache recompiles it once, with the span dynamic.
        self.step_layer = torch.compile(decode_layer) if compiled else decode_layer
        # Parameters by every name they answer to (tied weights answer to two).
        self._weights = self.model.state_dict(keep_vars=True)
        self._mirror = HostMirror(device=self.device)
        self.asleep = False
        self.last_transfer: dict = dict(self._mirror.last_transfer)
        self.last_timing: dict[str, float] = {}

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> Generation:
        """Sample up to `params.max_new_tokens` per prompt; a row stops after its EOS token."""
        if self.asleep:
            raise RuntimeError("generate() on a sleeping rollout engine; call wake_up() first")
        _check_params(params)
        ids, mask = left_pad(prompts, pad_id=self.pad_token_id)
        limit = self.model.config.max_position_embeddings
        if ids.shape[1] + params.max_new_tokens > limit:
            raise ValueError(
                f"longest prompt ({ids.shape[1]} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
                f"the model's {limit} positions; shorten the prompts or lower max_new_tokens"
            )
        with torch.inference_mode():
            return self._decode(ids.to(self.device), mask.to(self.device), params)

    def _decode(self, ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams) -> Generation:
        (batch, width), steps = ids.shape, params.max_new_tokens
        device = self.device
        clock = _Clock(device)
        generator = torch.Generator(device=device).manual_seed(params.seed)
        uniforms = torch.rand((steps, batch), generator=generator, device=device)
        tokens = torch.full((batch, steps), self.pad_token_id, dtype=torch.long, device=device)
        log_probs = torch.zeros((batch, steps), dtype=torch.float32, device=device)
        alive = torch.zeros((batch, steps), dtype=torch.float32, device=device)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        decoder = StaticKVDecoder(self.model, batch=batch, capacity=width + steps, step_layer=self.step_layer)
        positions = position_ids(mask)
        # The step's state lives in fixed buffers that the step itself advances (graph-safe).
        token = torch.zeros(batch, dtype=torch.long, device=device)
        position = positions[:, -1] + 1
        slot = torch.full((1,), width, dtype=torch.long, device=device)
        column = torch.zeros(1, dtype=torch.long, device=device)

        def record(logits: torch.Tensor) -> None:
            """Sample from `logits` into output column `column`; rows already finished get padding."""
            uniform = uniforms.index_select(0, column)[0]
            drawn, log_prob = self.sample(logits, temperature=params.temperature, top_p=params.top_p, uniform=uniform)
            drawn = drawn.masked_fill(finished, self.pad_token_id)
            tokens.index_copy_(1, column, drawn[:, None])
            log_probs.index_copy_(1, column, log_prob.masked_fill(finished, 0.0)[:, None])
            alive.index_copy_(1, column, (~finished).float()[:, None])
            finished.logical_or_(drawn == self.eos_token_id)
            token.copy_(drawn)

        def advance(columns: int) -> None:
            """One decoding step: the last sampled token into the cache, the next one sampled."""
            logits = decoder.step(token, position, slot, columns=columns)
            position.add_(1)
            slot.add_(1)
            column.add_(1)
            record(logits)

        record(decoder.prefill(ids, mask, positions))
        timing = {"prefill_seconds": clock.lap()}
        graphs: dict[int, torch.cuda.CUDAGraph] = {}
        for step in range(1, steps):  # step s writes cache column width + s - 1
            if step % FINISH_CHECK_EVERY == 0 and bool(finished.all()):
                break
            columns = min(width + steps, -(-(width + step) // self.span_step) * self.span_step)
            if not self.cuda_graphs:
                advance(columns)
            elif columns in graphs:
                graphs[columns].replay()
            elif min(columns - width, steps - 1) == step:  # the span's only step: not worth a graph
                advance(columns)
            else:  # the capture's eager run is this step
                pool = next(iter(graphs.values())).pool() if graphs else None
                graphs[columns] = capture_step(functools.partial(advance, columns), pool)
        # Columns past the last one any row was alive in are padding for every row.
        length = int(alive.any(dim=0).nonzero().max()) + 1
        timing["decode_seconds"] = clock.lap()
        self.last_timing = timing | {"graphs_captured": len(graphs)}
        return Generation(
            response_tokens=tokens[:, :length].cpu(),
            response_mask=alive[:, :length].cpu(),
            log_probs=log_probs[:, :length].cpu(),
        )

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the served weights in place (any device, any
        subset, awake or asleep): the engine's tensors keep their storage."""
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = self._weights.get(name)
                if target is None:
                    known = ", ".join(sorted(self._weights)[:5])
                    raise ValueError(
                        f"weight {name!r} is not in the served model (names look like: {known}, ...)"
                    )
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"weight {name!r} has shape {tuple(tensor.shape)}; the served model expects "
                        f"{tuple(target.shape)}: actor and rollout must use the same model"
                    )
                target.copy_(tensor)

    def sleep(self) -> None:
        """Weights to host memory (pinned on CUDA) and the device's cache released; no-op when asleep.

        The KV cache lives only inside `generate`, so no cache survives to be dropped here.
        """
        if self.asleep:
            return
        self._move_weights("sleep")
        self.asleep = True

    def wake_up(self) -> None:
        """Weights back on the device; no-op when awake."""
        if not self.asleep:
            return
        self._move_weights("wake_up")
        self.asleep = False

    def _move_weights(self, direction: str) -> None:
        """Parameters and buffers through the mirror's one flat buffer."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        move = self._mirror.to_host if direction == "sleep" else self._mirror.to_device
        with torch.no_grad():
            move([t.data for t in tensors], lambda index, moved: setattr(tensors[index], "data", moved),
                 direction=direction)
        self.last_transfer = dict(self._mirror.last_transfer)


def _check_params(params: SamplingParams) -> None:
    if params.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
    if params.temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")


class _Clock:
    """Seconds between laps, the device's queued work included."""

    def __init__(self, device: torch.device):
        self.device = device
        self._last = time.perf_counter()

    def lap(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        return seconds
