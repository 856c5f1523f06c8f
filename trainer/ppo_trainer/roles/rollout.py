"""A rollout engine's rank: generate and score a share of the prompts, sleep and wake, take new weights.

`generate` returns two objects (two Ray return refs): the scored `RolloutBatch`, which goes to
the training ranks without passing through the driver, and small statistics the driver reads.
Weights arrive either as a dict of CPU tensors through Ray (Colocate) or over the weight-sync
group (Disaggregated, `roles/link.py`). `merge_batches` joins the engines' parts into one batch.
Engines are built by `build_engine`, the one place that knows which class serves which
`spec.rollout.engine`. Must not depend on Ray except through `roles/link.py`.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from ppo_trainer.batch import RolloutBatch
from ppo_trainer.data import Prompt
from ppo_trainer.offload import Residency, Transition
from ppo_trainer.rewards import build_reward
from ppo_trainer.roles.base import use_all_cores
from ppo_trainer.rollout.base import RolloutEngine, SamplingParams
from ppo_trainer.rollout.layout import build_rollout_batch
from ppojob_api.spec import PPOJobSpec
from ppojob_api.vocabulary import RewardType
from ppojob_api.vocabulary import RolloutEngine as EngineKind

REWARD_KINDS = {RewardType.SYNTHETIC: "synthetic", RewardType.EXACT_ANSWER: "exact_answer", RewardType.CUSTOM: "custom"}


def build_engine(spec: PPOJobSpec, *, device: str) -> RolloutEngine:
    if spec.rollout.engine != EngineKind.TORCH:
        raise NotImplementedError(f"rollout.engine {spec.rollout.engine.value} is not available in this build; use Torch")
    from ppo_trainer.rollout.torch_engine import TorchRolloutEngine

    return TorchRolloutEngine(model_spec=spec.model, device=device, seed=spec.seed, dtype=spec.model.dtype)


def merge_batches(parts: list[RolloutBatch]) -> RolloutBatch:
    """One batch from the engines' parts: prompts re-padded on the left, responses on the right.

    New padding holds token 0 with attention mask 0, so no model ever attends to it."""
    if len(parts) == 1:
        return parts[0]
    prompt_len = max(p.prompt_length for p in parts)
    response_len = max(p.response_length for p in parts)

    def pad(part: RolloutBatch, tensor: torch.Tensor, value: float, sequence: bool) -> torch.Tensor:
        if not sequence:
            return F.pad(tensor, (0, response_len - part.response_length), value=value)
        left, right = prompt_len - part.prompt_length, response_len - part.response_length
        return F.pad(tensor, (left, right), value=value)

    return RolloutBatch(
        tokens=torch.cat([pad(p, p.tokens, 0, True) for p in parts]),
        attention_mask=torch.cat([pad(p, p.attention_mask, 0, True) for p in parts]),
        response_mask=torch.cat([pad(p, p.response_mask, 0.0, False) for p in parts]),
        prompt_length=prompt_len,
        rollout_log_probs=torch.cat([pad(p, p.rollout_log_probs, 0.0, False) for p in parts]),
        scores=torch.cat([p.scores for p in parts]),
        prompts=[text for p in parts for text in p.prompts],
        responses=[text for p in parts for text in p.responses],
    )


class RolloutWorker:
    """One rollout engine with its tokenizer, reward function, residency and weight-sync membership."""

    role = "rollout"

    def __init__(self, spec: PPOJobSpec, *, rank: int, device: str) -> None:
        from ppo_trainer.models.tokenizer import load_tokenizer
        from ppo_trainer.roles.link import EngineSide

        use_all_cores(device)
        self.spec = spec
        self.rank = rank
        self.tokenizer = load_tokenizer(spec.model)
        self.engine = build_engine(spec, device=device)
        self.reward = build_reward(REWARD_KINDS[spec.reward.type], custom_function=spec.reward.function)
        self._transitions: list[Transition] = []
        self.residency = Residency.for_rollout(rank=rank, listener=self._transitions.append)
        self.link = EngineSide()

    def generate(self, prompts: list[Prompt], *, seed: int) -> tuple[RolloutBatch, dict[str, float]]:
        self.wake()
        self.residency.require_awake("generate")
        started = time.perf_counter()
        rollout = self.spec.rollout
        repeated = [p for p in prompts for _ in range(rollout.samples_per_prompt)]
        token_ids = [self.tokenizer.encode_prompt(p.text) for p in repeated]
        params = SamplingParams(
            max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature, top_p=rollout.top_p, seed=seed
        )
        generation = self.engine.generate(token_ids, params)
        responses = [
            self.tokenizer.decode(row[mask.bool()].tolist())
            for row, mask in zip(generation.response_tokens, generation.response_mask)
        ]
        texts, labels = [p.text for p in repeated], [p.label for p in repeated]
        scores = torch.tensor(self.reward.score(texts, responses, labels), dtype=torch.float32)
        batch = build_rollout_batch(
            token_ids, generation, scores, self.tokenizer.pad_token_id, prompts=texts, responses=responses
        )
        stats = {
            "reward_sum": float(scores.sum()),
            "samples": float(len(repeated)),
            "response_tokens": float(batch.num_response_tokens),
            "seconds": time.perf_counter() - started,
        }
        return batch, stats

    def sleep(self) -> bool:
        return self.residency.sleep(self.engine.sleep)

    def wake(self) -> bool:
        return self.residency.wake(self.engine.wake_up)

    def state(self) -> str:
        return self.residency.state

    def drain_transitions(self) -> list[Transition]:
        drained, self._transitions[:] = list(self._transitions), []
        return drained

    def update_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Colocate: new weights arrived through Ray as CPU tensors."""
        self.wake()
        self.engine.update_weights(weights.items())

    # Disaggregated: membership of the actor's weight-sync group.
    def join_link(self, host: str, port: int, rank: int, world: int) -> None:
        self.link.join(host, port, rank, world)

    def leave_link(self) -> None:
        self.link.leave()

    def link_connected(self) -> bool:
        return self.link.connected

    def receive_weights(self, meta) -> None:
        self.wake()
        self.engine.update_weights(self.link.receive(meta))
