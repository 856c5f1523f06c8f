"""The built-in rollout engine: batched sampling from a Hugging Face causal LM with a KV cache.

It owns its decode loop (one prefill over the left-padded prompts, then one token per step for
the whole batch with the key/value cache), so that the per-step work is a fixed, small graph a
GPU build can capture. Sampling is temperature and top-p with a per-call seeded generator,
batched without host synchronisation (exponential-race sampling instead of multinomial).
Reported log-probs are those of the sampled tokens under the temperature-scaled logits, before
top-p filtering: log_softmax(logits / temperature). With temperature 0 (greedy) they are under
the unscaled logits. A trainer recomputes the same numbers with
TorchBackend(logits_temperature=temperature). Must not depend on Ray or the PPO loop.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
from ppojob_api.spec import ModelSpec
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache

from ppo_trainer.algorithms import log_probs_from_logits
from ppo_trainer.models.builtin import build_policy
from ppo_trainer.models.residency import HostMirror
from ppo_trainer.models.tokenizer import load_tokenizer
from ppo_trainer.rollout.base import Generation, SamplingParams
from ppo_trainer.rollout.layout import left_pad, position_ids

# cuDNN attention builds a new graph for every key length, i.e. at every decoding step (about
# 2.6 ms of host time per layer per step measured on an H200): the decode loop goes without it.
DECODE_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """[B, V] logits with -inf outside the smallest set of most likely tokens whose mass reaches
    `top_p` (the most likely token is always kept)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample_tokens(
    logits: torch.Tensor, *, temperature: float, top_p: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V] float logits -> ([B] sampled tokens, [B] their log-probs under logits / temperature).

    Temperature 0 is greedy (argmax), its log-probs under the unscaled logits.
    """
    scaled = logits if temperature == 0 else logits / temperature
    if temperature == 0:
        tokens = scaled.argmax(dim=-1)
    else:
        candidates = top_p_filter(scaled, top_p) if top_p < 1.0 else scaled
        probs = candidates.softmax(dim=-1)
        # argmax(p / E) with E ~ Exp(1) draws from p, with no host round trip.
        race = torch.empty_like(probs).exponential_(generator=generator)
        tokens = (probs / race).argmax(dim=-1)
    return tokens, log_probs_from_logits(scaled.unsqueeze(1), tokens.unsqueeze(1)).squeeze(1)


class TorchRolloutEngine:
    """A RolloutEngine over `build_policy(model_spec, seed=seed)`, awake after construction.

    EOS and PAD ids come from the model's tokenizer unless given.
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
    ):
        self.device = torch.device(device)
        self.model = build_policy(model_spec, seed=seed, device=self.device, dtype=dtype)
        self.model.requires_grad_(False).eval()
        if eos_token_id is None or pad_token_id is None:
            tokenizer = load_tokenizer(model_spec)
            eos_token_id = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
            pad_token_id = tokenizer.pad_token_id if pad_token_id is None else pad_token_id
        self.eos_token_id = int(eos_token_id)
        self.pad_token_id = int(pad_token_id)
        # Parameters by every name they answer to (tied weights answer to two).
        self._weights = self.model.state_dict(keep_vars=True)
        # transformers 5.2x renamed the forward's `past_key_values` to `cache`; accept both.
        forward_parameters = inspect.signature(type(self.model).forward).parameters
        self._cache_kw = "cache" if "cache" in forward_parameters else "past_key_values"
        self._mirror = HostMirror(device=self.device)
        self.asleep = False
        self.last_transfer: dict = {"direction": None, "bytes": 0, "seconds": 0.0}

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
        with torch.inference_mode(), sdpa_kernel(DECODE_ATTENTION_BACKENDS):
            return self._decode(ids.to(self.device), mask.to(self.device), params)

    def _decode(self, ids: torch.Tensor, mask: torch.Tensor, params: SamplingParams) -> Generation:
        batch, steps = ids.shape[0], params.max_new_tokens
        generator = torch.Generator(device=self.device).manual_seed(params.seed)
        tokens = torch.full((batch, steps), self.pad_token_id, dtype=torch.long, device=self.device)
        log_probs = torch.zeros((batch, steps), dtype=torch.float32, device=self.device)
        alive = torch.zeros((batch, steps), dtype=torch.float32, device=self.device)
        finished = torch.zeros(batch, dtype=torch.bool, device=self.device)
        positions = position_ids(mask)
        cache = DynamicCache(config=self.model.config)
        logits = (
            self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_kw: cache},
            )
            .logits[:, -1]
            .float()
        )
        next_position = positions[:, -1:] + 1
        length = 0
        for step in range(steps):
            token, log_prob = sample_tokens(
                logits, temperature=params.temperature, top_p=params.top_p, generator=generator
            )
            token = token.masked_fill(finished, self.pad_token_id)
            tokens[:, step] = token
            log_probs[:, step] = log_prob.masked_fill(finished, 0.0)
            alive[:, step] = (~finished).float()
            finished = finished | (token == self.eos_token_id)
            length = step + 1
            if step + 1 == steps or bool(finished.all()):
                break
            mask = torch.cat([mask, mask.new_ones((batch, 1))], dim=1)
            logits = (
                self.model(
                    input_ids=token.unsqueeze(1),
                    attention_mask=mask,
                    position_ids=next_position,
                    use_cache=True,
                    **{self._cache_kw: cache},
                )
                .logits[:, -1]
                .float()
            )
            next_position = next_position + 1
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
        move = self._mirror.to_host if direction == "sleep" else self._mirror.to_device
        self._mirror.begin()
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                param.data = move(("param", name), param.data)
            for name, buffer in self.model.named_buffers():
                buffer.data = move(("buffer", name), buffer.data)
        self.last_transfer = self._mirror.end(direction=direction)


def _check_params(params: SamplingParams) -> None:
    if params.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
    if params.temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
