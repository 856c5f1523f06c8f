"""A rollout engine's rank: generate and score a share of the prompts, sleep and wake, take new weights.

`generate` returns two objects (two Ray return refs): the scored `RolloutBatch`, which goes to
the training ranks without passing through the driver, and small statistics the driver reads.
Engines are built by `build_engine`, the one place that knows which class serves which
`spec.rollout.engine`: the built-in torch engine in this process, or an SGLang server that this
worker launches on its bundle (`rollout/sglang/launcher.py`) and drives through
`SGLangRolloutEngine`; its URL is exposed (`server_urls`) and it is stopped by `close`.
`receive_weights` is the one way new weights come in: the worker's `Receiver`, built around its
engine from the run's weight-sync path (`weight_sync/`), takes whatever that path's sender sends
(CUDA IPC handles, CPU tensors, or the steps of a broadcast over the weight-update group).
Imports no Ray itself (this node's address comes from `roles/group.py`).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

from ppo_trainer.batch import RolloutBatch
from ppo_trainer.data import Prompt
from ppo_trainer.offload import Residency, Transition
from ppo_trainer.reward_model import ModelReward, RewardModel
from ppo_trainer.rewards import Reward, build_reward
from ppo_trainer.roles.base import use_all_cores
from ppo_trainer.rollout.base import RolloutEngine, SamplingParams
from ppo_trainer.rollout.layout import build_rollout_batch
from ppo_trainer.rollout.sglang.server_args import SGLANG, ServerProgram
from ppo_trainer.weight_sync import weight_sync_path
from ppojob_api.spec import PPOJobSpec
from ppojob_api.vocabulary import RewardType, RuleReward
from ppojob_api.vocabulary import RolloutEngine as EngineKind

REWARD_KINDS = {RuleReward.SYNTHETIC: "synthetic", RuleReward.EXACT_ANSWER: "exact_answer", RuleReward.CUSTOM: "custom",
                RuleReward.REMOTE: "remote"}


def build_rule_reward(spec: PPOJobSpec) -> Reward | None:
    """The rule-based reward of `spec.reward` (its type, or with type Model the one it combines with;
    None: none), with the endpoint's settings for Remote."""
    reward = spec.reward
    if reward.rule is None:
        return None
    options = {}
    if reward.rule == RuleReward.REMOTE:
        remote = reward.remote
        options = {"url": remote.url, "timeout_seconds": remote.timeout_seconds, "max_retries": remote.max_retries,
                   "max_concurrency": remote.max_concurrency, "batch_size": remote.batch_size,
                   "headers_from_env": {header.name: header.from_env for header in remote.headers or []}}
    return build_reward(REWARD_KINDS[reward.rule], custom_function=reward.function, **options)


def load_reward_model(spec: PPOJobSpec, *, device: str) -> RewardModel | None:
    """The reward model of reward.type Model, loaded on `device` with the engines' dtype; None for the other types."""
    if spec.reward.type != RewardType.MODEL:
        return None
    settings = spec.reward.model
    return RewardModel(settings.path, device=device, dtype=spec.model.dtype,
                       micro_batch_size=settings.micro_batch_size, max_length=settings.max_length)


def build_spec_reward(spec: PPOJobSpec, *, reward_model: RewardModel | None = None) -> Reward:
    """The reward of `spec.reward`: its rule-based reward, or with type Model `reward_model`'s
    weighted score combined with the rule of reward.model.combineWith, if any."""
    rule = build_rule_reward(spec)
    if spec.reward.type != RewardType.MODEL:
        return rule
    if reward_model is None:
        raise ValueError("reward.type Model scores with a reward model: load it first (load_reward_model)")
    settings = spec.reward.model
    return ModelReward(model=reward_model, rule=rule, weight=settings.weight, combine=settings.combine)


@dataclass(frozen=True, kw_only=True)
class BuiltEngine:
    """An engine and the server processes it runs on (SGLang)."""

    engine: RolloutEngine
    servers: list[Any]
    """`ServerProcess`es this worker launched and must stop (none for the torch engine)."""


def build_engine(
    spec: PPOJobSpec, *, device: str, rank: int, pad_token_id: int, sglang_server: ServerProgram = SGLANG
) -> BuiltEngine:
    """The engine of rollout rank `rank`. With rollout.engine SGLang this launches its server here
    (`sglang_server`: SGLang's own, or a stand-in that speaks its protocol), on the bundle this
    process holds."""
    if spec.rollout.engine == EngineKind.SGLANG:
        return _launch_sglang(spec, rank=rank, pad_token_id=pad_token_id, program=sglang_server)
    from ppo_trainer.rollout.torch_engine import TorchRolloutEngine

    engine = TorchRolloutEngine(model_spec=spec.model, device=device, seed=spec.seed, dtype=spec.model.dtype)
    return BuiltEngine(engine=engine, servers=[])


def _launch_sglang(spec: PPOJobSpec, *, rank: int, pad_token_id: int, program: ServerProgram) -> BuiltEngine:
    from ppo_trainer.roles.group import node_ip
    from ppo_trainer.rollout.sglang.engine import SGLangRolloutEngine
    from ppo_trainer.rollout.sglang.launcher import launch_engine_server

    server = launch_engine_server(
        spec,
        engine_index=rank,
        host=node_ip(),
        log_dir=tempfile.mkdtemp(prefix=f"ppo-rollout-{rank}-"),
        program=program,
    )
    engine = SGLangRolloutEngine(
        servers=[server.client()], pad_token_id=pad_token_id, tensor_parallel=spec.rollout.tensor_parallel
    )
    return BuiltEngine(engine=engine, servers=[server])


class RolloutWorker:
    """One rollout engine with its tokenizer, reward function, residency and end of the weight sync;
    with reward.type Model, the reward model beside the engine, on its device, with a residency of its
    own ("reward"): it sleeps with the engine and wakes only to score."""

    role = "rollout"

    def __init__(
        self, spec: PPOJobSpec, *, rank: int, device: str, weight_sync: str, sglang_server: ServerProgram = SGLANG
    ) -> None:
        """`weight_sync`: the run's weight-sync path (`weight_sync.PATHS`); `sglang_server`: what serves
        rollout.engine SGLang."""
        from ppo_trainer.models.tokenizer import load_tokenizer

        use_all_cores(device)
        self.spec = spec
        self.rank = rank
        self.device = device
        self.tokenizer = load_tokenizer(spec.model)
        built = build_engine(
            spec, device=device, rank=rank, pad_token_id=self.tokenizer.pad_token_id, sglang_server=sglang_server
        )
        self.engine, self.servers = built.engine, built.servers
        self.reward_model = load_reward_model(spec, device=device)
        self.reward = build_spec_reward(spec, reward_model=self.reward_model)
        self._transitions: list[Transition] = []
        self.residency = Residency.for_rollout(rank=rank, listener=self._transitions.append)
        self.reward_residency = None if self.reward_model is None else Residency.for_rollout(
            "reward", rank=rank, listener=self._transitions.append)
        self.receiver = weight_sync_path(weight_sync).receiver(engine=self.engine, device=device, wake=self.wake)
        self.weights_version = 0
        """The actor updates in the weights this engine serves (0: the initial ones); stamped on each batch."""

    def generate(self, prompts: list[Prompt], *, seed: int) -> tuple[RolloutBatch, dict[str, float]]:
        self.wake()
        self.residency.require_awake("generate")
        started, started_at = time.perf_counter(), time.time()
        rollout = self.spec.rollout
        repeated = [p for p in prompts for _ in range(rollout.samples_per_prompt)]
        params = SamplingParams(
            max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature, top_p=rollout.top_p, seed=seed
        )
        token_ids, generation, responses, scored = self._answer(repeated, params)
        scores = torch.tensor(scored, dtype=torch.float32)
        batch = build_rollout_batch(
            token_ids, generation, scores, self.tokenizer.pad_token_id, prompts=[p.text for p in repeated],
            responses=responses,
        )
        stats = {
            "reward_sum": float(scores.sum()),
            "samples": float(len(repeated)),
            "response_tokens": float(batch.num_response_tokens),
            "seconds": time.perf_counter() - started,
            "started_at": started_at,
            "finished_at": time.time(),
            "weights_version": float(self.weights_version),
        }
        return batch, stats

    def evaluate(self, prompts: list[Prompt], *, seed: int, temperature: float, max_new_tokens: int) -> list[float]:
        """The reward's score of one response per held-out prompt, with the weights this engine serves
        (rollout.topP); nothing else is kept. `seed`: the evaluation's own, never a training step's."""
        if not prompts:  # more engines than held-out prompts
            return []
        self.wake()
        self.residency.require_awake("evaluate")
        params = SamplingParams(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=self.spec.rollout.top_p, seed=seed
        )
        return self._answer(prompts, params)[3]

    def _answer(self, prompts: list[Prompt], params: SamplingParams):
        """Each prompt's tokens, the engine's generation, the decoded responses and the reward's scores."""
        token_ids = [self.tokenizer.encode_prompt(p) for p in prompts]
        generation = self.engine.generate(token_ids, params)
        responses = [
            self.tokenizer.decode(row[mask.bool()].tolist())
            for row, mask in zip(generation.response_tokens, generation.response_mask)
        ]
        if self.reward_residency is not None:  # asleep since the engines last slept: back to score
            self.reward_residency.wake(self.reward_model.wake_up)
        scores = self.reward.score([p.text for p in prompts], responses, [p.label for p in prompts])
        return token_ids, generation, responses, scores

    def serve_weights_version(self, version: int) -> None:
        """The weights just received hold `version` actor updates (the driver counts them)."""
        self.weights_version = version

    def sleep(self) -> bool:
        """The engine and the reward model release their device memory; whether the engine's changed."""
        if self.reward_residency is not None:
            self.reward_residency.sleep(self.reward_model.sleep)
        return self.residency.sleep(self.engine.sleep)

    def wake(self) -> bool:
        """The engine back on its device (the reward model wakes when it scores)."""
        return self.residency.wake(self.engine.wake_up)

    def state(self) -> str:
        return self.residency.state

    def reward_state(self) -> str | None:
        """The reward model's residency; None without one."""
        return None if self.reward_residency is None else self.reward_residency.state

    def drain_transitions(self) -> list[Transition]:
        # Runs beside a generation (its own concurrency group, roles/build.py): pop one by one, so a
        # transition appended meanwhile is never lost.
        drained = []
        while self._transitions:
            drained.append(self._transitions.pop(0))
        return drained

    def server_urls(self) -> list[str]:
        """The URLs of the servers this worker launched (SGLang), e.g. for a router; empty for the torch engine."""
        return [server.url for server in self.servers]

    def close(self) -> None:
        """Stop the servers this worker launched (the driver calls it before it kills the worker)."""
        for server in self.servers:
            server.stop()

    def receive_weights(self, payload: Any) -> Any:
        """What the actor's end of the weight sync sent (through the driver, or straight from the
        actor): new weights, or one step of their transfer; this worker's receiver takes it."""
        return self.receiver.receive(payload)
