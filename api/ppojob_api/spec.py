"""The PPOJob spec as typed, frozen Python models, and its parser.

The CRD in crds/ is the source of truth; these models follow it field for field (names, types,
defaults, enums, bounds), and tests/unit/api/test_crd_drift.py fails when they drift. The
operator and the trainer both parse specs here, so a job means the same thing on both sides.

`parse_spec` turns a dict (a PPOJob manifest's spec, or a trainer YAML) into a `PPOJobSpec`, or
raises `SpecError` naming every bad field with its fix: unknown keys list the valid ones, keys
removed or renamed from the seed framework name their replacement, numbers written as strings
(`"1e-5"`) are read as numbers. `check_semantics` holds the cross-field rules that the CRD states
in CEL, for specs that never pass through an API server (the trainer's CLI).

Depends on pydantic and the standard library only (the operator image has no torch).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any

import pydantic
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from ppojob_api.vocabulary import (
    GangScheduler,
    KLEstimator,
    LossAggregation,
    Placement,
    RewardCombine,
    RewardType,
    RolloutCorrection,
    RolloutEngine,
    RuleReward,
    Schedule,
    TrainBackend,
)


class SpecError(ValueError):
    """A spec that cannot run. `problems` lists one 'field: what is wrong and how to fix it' each."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid PPOJob spec:\n  - " + "\n  - ".join(self.problems))


class _Model(BaseModel):
    # Lax mode keeps "1e-5" -> 1e-05 for floats; forbid turns unknown keys into errors.
    model_config = ConfigDict(
        frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True
    )


class Parallelism(_Model):
    tensor: int = Field(1, ge=1)
    """Tensor-parallel size."""
    pipeline: int = Field(1, ge=1)
    """Pipeline-parallel size."""
    data: int | None = Field(None, ge=1)
    """Data-parallel size; by default as many as the training GPUs (or CPU ranks) hold."""

    @property
    def model_parallel_size(self) -> int:
        return self.tensor * self.pipeline


class CriticParallelism(_Model):
    tensor: int | None = Field(None, ge=1)
    """Defaults to actor.parallelism.tensor."""
    pipeline: int | None = Field(None, ge=1)
    """Defaults to actor.parallelism.pipeline."""
    data: int | None = Field(None, ge=1)
    """Defaults to actor.parallelism.data."""

    @property
    def is_set(self) -> bool:
        """Whether any size is the critic's own; otherwise its layout is the actor's."""
        return any(size is not None for size in (self.tensor, self.pipeline, self.data))


class ModelSpec(_Model):
    path: str = "builtin:tiny"
    """Actor checkpoint: a Hugging Face directory, or builtin:tiny / builtin:smollm2-135m."""
    tokenizer: str | None = None
    """Tokenizer directory; defaults to `path`."""
    dtype: str = Field("float32", pattern="^(float32|bfloat16)$")


class ActorSpec(_Model):
    backend: TrainBackend = TrainBackend.TORCH
    learning_rate: float = Field(1.0e-6, gt=0)
    micro_batch_size: int = Field(8, ge=1)
    max_grad_norm: float = Field(1.0, ge=0)
    compile: bool = True
    """On GPUs: torch.compile the output layer's softmax and the decoder layers (Megatron's at tensor parallel 1)."""
    parallelism: Parallelism = Parallelism()


class CriticSpec(_Model):
    enabled: bool = True
    model: str | None = None
    """The critic's own model (another size or architecture, the actor's tokenizer); defaults to model.path."""
    learning_rate: float | None = Field(None, gt=0)
    """Defaults to the actor's learning rate."""
    backend: TrainBackend | None = None
    """Defaults to actor.backend."""
    micro_batch_size: int | None = Field(None, ge=1)
    """Defaults to actor.microBatchSize."""
    max_grad_norm: float | None = Field(None, ge=0)
    """Defaults to actor.maxGradNorm."""
    load: str | None = None
    """A critic checkpoint of ours to start from (a step directory, or a folder of them: the latest)."""
    save: str | None = Field(None, max_length=4096)
    """A folder the critic's checkpoints are written to as well, one step directory each; with
    checkpoint.volumeClaim, a folder under checkpoint.path (`CRITIC_SAVE_OFF_THE_VOLUME`)."""
    updates_per_actor_update: int = Field(1, ge=1, le=16)
    """K critic optimisation passes per actor update."""
    parallelism: CriticParallelism = CriticParallelism()


class RolloutSpec(_Model):
    engine: RolloutEngine = RolloutEngine.TORCH
    gpus: int = Field(0, ge=0)
    tensor_parallel: int = Field(1, ge=1)
    batch_size: int = Field(32, ge=1)
    """Prompts per training step."""
    samples_per_prompt: int = Field(1, ge=1)
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    memory_fraction: float = Field(0.8, gt=0, le=1)


class RolloutCorrectionSpec(_Model):
    type: RolloutCorrection = RolloutCorrection.NONE
    """TruncatedImportanceSampling weights each token's policy loss by min(pi_train / pi_rollout, cap)."""
    cap: float = Field(2.0, ge=1)
    """The largest importance weight (TruncatedImportanceSampling)."""


class PPOSpec(_Model):
    num_rollouts: int = Field(10, ge=1)
    num_critic_only_steps: int = Field(0, ge=0)
    epochs: int = Field(1, ge=1)
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1, alias="lambda")
    clip_eps: float = Field(0.2, gt=0)
    clip_eps_high: float | None = None
    dual_clip: float | None = Field(None, gt=1)
    value_clip: float = Field(0.2, ge=0)
    kl_coef: float = Field(0.01, ge=0)
    kl_estimator: KLEstimator = KLEstimator.K1
    entropy_coef: float = Field(0.0, ge=0)
    normalize_advantages: bool = True
    """Whiten the advantages over the whole batch (every data-parallel rank's rows)."""
    loss_aggregation: LossAggregation = LossAggregation.TOKEN_MEAN
    """How the policy, value and entropy losses reduce over the batch's tokens."""
    rollout_correction: RolloutCorrectionSpec = RolloutCorrectionSpec()
    custom_advantage_function: str | None = Field(None, pattern=r"^[^:]+:[A-Za-z_][A-Za-z0-9_]*$")
    schedule: Schedule = Schedule.SYNCHRONOUS
    """OneStepOverlap: the engines generate step n+1 while step n trains (one step off-policy)."""

    def is_critic_only_step(self, step: int) -> bool:
        """Steps 0 .. numCriticOnlySteps-1 train the critic alone."""
        return step < self.num_critic_only_steps

    def actor_updates_before(self, step: int) -> int:
        """The policy updates the actor has made when step `step` starts (its weights' version):
        one per step after the warm-up."""
        return max(0, step - self.num_critic_only_steps)


class OffloadSpec(_Model):
    train: bool = True
    rollout: bool = True
    process_groups: bool = True
    """With `train`: a sleeping role's ranks also destroy their process groups (NCCL communicators)."""


class ValidationSpec(_Model):
    prompts: str | None = Field(None, min_length=1)
    """Held-out prompts (a JSONL or Parquet file read with data.promptKey and data.labelKey, or
    'synthetic'); unset: no evaluation."""
    count: int | None = Field(None, ge=0)
    """Evaluate on the file's first `count` prompts; unset or 0: all of them."""
    interval: int | None = Field(None, ge=0)
    """Evaluate after every `interval` steps, and after the last; unset or 0: after the last only."""
    temperature: float | None = Field(None, ge=0)
    """Sampling temperature of the evaluation (with rollout.topP); unset or 0: greedy."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Longest response; defaults to rollout.maxNewTokens."""

    @property
    def enabled(self) -> bool:
        return self.prompts is not None


class DataSpec(_Model):
    prompts: str = "synthetic"
    """A JSONL file of prompts, a Parquet file (a name ending in .parquet), or 'synthetic'."""
    prompt_key: str = "prompt"
    """The field holding each record's prompt: a string, or a list of {role, content} chat messages."""
    label_key: str = "label"
    """The field holding each record's optional label: a string, a number (read as its text) or null."""
    validation: ValidationSpec = ValidationSpec()
    """Held-out prompts the policy is evaluated on during training (off while prompts is unset)."""


class RemoteRewardHeader(_Model):
    name: str = Field(max_length=256, pattern=r"^[A-Za-z0-9-]+$")
    """The header's name, e.g. Authorization."""
    from_env: str = Field(max_length=256, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """The environment variable holding its value (e.g. a key of envFromSecret's Secret)."""


class RemoteRewardSpec(_Model):
    url: str | None = Field(None, max_length=2048, pattern=r"^https?://[^/\s?#]+\S*$")
    """The scoring endpoint, http:// or https://; POST {prompts, responses, labels} -> {scores}."""
    timeout_seconds: float = Field(60, gt=0, le=3600)
    """How long a request waits on the endpoint (to connect, then for each read); timed-out ones are retried."""
    max_retries: int = Field(3, ge=0, le=10)
    """Retries after a connection error, a timeout, HTTP 429 or 5xx (never after another 4xx)."""
    max_concurrency: int = Field(4, ge=1, le=256)
    """Requests in flight at once from each rollout engine."""
    batch_size: int = Field(64, ge=1, le=65536)
    """Samples per request."""
    headers: list[RemoteRewardHeader] | None = Field(None, max_length=16)
    """Headers sent with each request, their values read from the trainer's environment."""


class RewardModelSpec(_Model):
    path: str | None = Field(None, min_length=1, max_length=4096)
    """A Hugging Face sequence-classification directory (one label) with its own tokenizer."""
    micro_batch_size: int = Field(8, ge=1, le=4096)
    """Sequences scored per forward pass."""
    max_length: int = Field(2048, ge=1, le=1048576)
    """Longest sequence scored, in the reward model's tokens; a longer one keeps its end."""
    weight: float = Field(1.0, gt=0)
    """The model's score is multiplied by it."""
    combine_with: RuleReward | None = None
    """A rule-based reward the weighted score is combined with; unset: the weighted score alone."""
    combine: RewardCombine = RewardCombine.SUM
    """Sum: weighted score + rule's score. Gate: the weighted score where the rule's score is above 0, else the rule's."""


class RewardSpec(_Model):
    type: RewardType = RewardType.SYNTHETIC
    function: str | None = Field(None, pattern=r"^[^:]+:[A-Za-z_][A-Za-z0-9_]*$")
    remote: RemoteRewardSpec = RemoteRewardSpec()
    model: RewardModelSpec = RewardModelSpec()
    """The reward model of type Model."""

    @property
    def rule(self) -> RuleReward | None:
        """The rule-based reward that scores responses: the type itself, or with type Model the one it combines with."""
        if self.type == RewardType.MODEL:
            return self.model.combine_with
        return RuleReward(self.type.value)


class ExportSpec(_Model):
    interval: int = Field(0, ge=0)
    """Steps between exports, each into <path>/step-NNNNNNNN; 0: only the end's, into <path>/final."""
    path: str | None = Field(None, min_length=1, max_length=4096)
    """Folder the exports are written to; defaults to <checkpoint directory>/export. With
    checkpoint.volumeClaim, a folder under checkpoint.path (`EXPORT_OFF_THE_VOLUME`)."""
    dtype: str | None = Field(None, pattern="^(float32|bfloat16)$")
    """The exported weights' dtype; defaults to model.dtype."""
    critic: bool = False
    """Also the critic, as a value model (AutoModelForTokenClassification, one label), into <path>/critic/."""


class CheckpointSpec(_Model):
    path: str = Field("/checkpoints", max_length=4096)
    volume_claim: str | None = None
    interval: int = Field(1, ge=0)
    keep: int = Field(2, ge=1)
    termination_grace_period_seconds: int = Field(300, ge=1, le=3600)
    """The Ray pods' grace period: a stopped trainer finishes its step and checkpoints within it."""
    export: ExportSpec | None = None
    """The trained actor as a Hugging Face model directory (`ppo_trainer/export.py`); off when unset."""


class ResourcesSpec(_Model):
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(8, ge=0, le=16)
    cpus_per_node: str = "16"
    memory_per_node: str = "128Gi"
    shared_memory: str = "16Gi"
    node_selector: dict[str, str] | None = None
    tolerations: list[dict[str, Any]] | None = None

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


class SchedulingSpec(_Model):
    gang_scheduler: GangScheduler = GangScheduler.COSCHEDULING
    queue: str | None = None
    priority_class_name: str | None = None
    schedule_timeout_seconds: int = Field(600, ge=1)


class RunPolicySpec(_Model):
    backoff_limit: int = Field(3, ge=0)
    active_deadline_seconds: int | None = Field(None, ge=1)
    ttl_seconds_after_finished: int | None = Field(None, ge=0)
    suspend: bool = False


class PPOJobSpec(_Model):
    image: str = Field(min_length=1)
    image_pull_policy: str = Field("IfNotPresent", pattern="^(Always|IfNotPresent|Never)$")
    env_from_secret: str | None = None
    """A Secret whose keys become environment variables of the trainer (e.g. HF_TOKEN)."""
    seed: int = Field(1, ge=0)
    model: ModelSpec = ModelSpec()
    actor: ActorSpec = ActorSpec()
    critic: CriticSpec = CriticSpec()
    rollout: RolloutSpec = RolloutSpec()
    placement: Placement = Placement.COLOCATE
    ppo: PPOSpec = PPOSpec()
    offload: OffloadSpec = OffloadSpec()
    data: DataSpec = DataSpec()
    reward: RewardSpec = RewardSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    resources: ResourcesSpec = ResourcesSpec()
    scheduling: SchedulingSpec = SchedulingSpec()
    run_policy: RunPolicySpec = RunPolicySpec()

    @property
    def critic_learning_rate(self) -> float:
        return self.critic.learning_rate or self.actor.learning_rate

    def training_role(self, role: str) -> TrainingRole:
        """The settings of a training role ("actor", "critic" or "ref"), the critic's unset fields
        taken from the actor (the reference policy is the actor's initial model)."""
        actor = self.actor
        if role != "critic":
            parallel = actor.parallelism
            return TrainingRole(
                field="actor", model=self.model, backend=actor.backend, learning_rate=actor.learning_rate,
                micro_batch_size=actor.micro_batch_size, max_grad_norm=actor.max_grad_norm,
                tensor=parallel.tensor, pipeline=parallel.pipeline, data=parallel.data,
            )
        critic, parallel = self.critic, self.critic.parallelism
        model = self.model if critic.model is None else ModelSpec(path=critic.model, dtype=self.model.dtype)

        def unset(value, default):
            return default if value is None else value

        return TrainingRole(
            field="critic", model=model, backend=unset(critic.backend, actor.backend),
            learning_rate=self.critic_learning_rate,
            micro_batch_size=unset(critic.micro_batch_size, actor.micro_batch_size),
            max_grad_norm=unset(critic.max_grad_norm, actor.max_grad_norm),
            tensor=unset(parallel.tensor, actor.parallelism.tensor),
            pipeline=unset(parallel.pipeline, actor.parallelism.pipeline),
            data=unset(parallel.data, actor.parallelism.data),
        )


@dataclass(frozen=True, kw_only=True)
class TrainingRole:
    """One training role's settings, defaults applied: what its backend and layout are built from."""

    field: str
    """The spec section that sets them ("actor" or "critic"), for error messages."""
    model: ModelSpec
    backend: TrainBackend
    learning_rate: float
    micro_batch_size: int
    max_grad_norm: float
    tensor: int
    pipeline: int
    data: int | None
    """None: as many data-parallel ranks as the training devices hold."""

    @property
    def model_parallel_size(self) -> int:
        return self.tensor * self.pipeline


# Keys of the seed framework (or of earlier drafts) that users will write, and what replaced them.
# Path of the section -> {old key: replacement}.
RENAMED_KEYS: dict[str, dict[str, str]] = {
    "spec": {
        "criticLoad": "critic.load",
        "criticSave": "critic.save",
        "criticLr": "critic.learningRate",
        "useCritic": "critic.enabled",
        "numCriticOnlySteps": "ppo.numCriticOnlySteps",
        "customAdvantageFunctionPath": "ppo.customAdvantageFunction",
        "offloadTrain": "offload.train",
        "offloadRollout": "offload.rollout",
        "colocate": "placement: Colocate",
    },
    "spec.critic": {
        "lr": "critic.learningRate",
        "numNodes": "nothing: the critic shares the actor's GPUs (resources.nodes)",
        "numGpusPerNode": "nothing: the critic shares the actor's GPUs (resources.gpusPerNode)",
        "tensorModelParallelSize": "critic.parallelism.tensor",
        "pipelineModelParallelSize": "critic.parallelism.pipeline",
        "configPath": "the critic section itself: write its overrides here",
    },
    "spec.actor": {
        "lr": "actor.learningRate",
        "tensorModelParallelSize": "actor.parallelism.tensor",
        "pipelineModelParallelSize": "actor.parallelism.pipeline",
    },
    "spec.ppo": {
        "lambd": "ppo.lambda",
        "lam": "ppo.lambda",
        "epsClip": "ppo.clipEps",
        "epsClipHigh": "ppo.clipEpsHigh",
        "klLossCoef": "ppo.klCoef",
        "customAdvantageFunctionPath": "ppo.customAdvantageFunction",
    },
}


def _section_model(path: tuple) -> type[_Model] | None:
    model: type[_Model] = PPOJobSpec
    for key in path:
        if not isinstance(key, str):
            continue
        field = next(
            (f for name, f in model.model_fields.items() if (f.alias or name) == key or name == key), None
        )
        annotation = getattr(field, "annotation", None)
        # An optional section (`ExportSpec | None`) lists the fields of its model.
        annotation = next((a for a in typing.get_args(annotation) if a is not type(None)), annotation)
        if not (isinstance(annotation, type) and issubclass(annotation, _Model)):
            return None
        model = annotation
    return model


def _field_names(model: type[_Model]) -> list[str]:
    return [f.alias or to_camel(name) for name, f in model.model_fields.items()]


def _describe(error: dict, root: str) -> str:
    loc = tuple(error["loc"])
    where = ".".join([root, *(str(p) for p in loc)])
    if error["type"] == "extra_forbidden":
        section = ".".join([root, *(str(p) for p in loc[:-1])])
        key = str(loc[-1])
        replacement = RENAMED_KEYS.get(section, {}).get(key)
        if replacement:
            return f"{where}: was removed; use {replacement}"
        model = _section_model(loc[:-1])
        valid = ", ".join(_field_names(model)) if model else "none"
        return f"{where}: unknown field; valid fields here: {valid}"
    if error["type"] == "missing":
        return f"{where}: required; set it"
    return f"{where}: {error['msg']} (got {error.get('input')!r})"


def parse_spec(raw: dict[str, Any] | None, *, root: str = "spec") -> PPOJobSpec:
    """Parse and validate a spec dict; raise SpecError listing every problem with its fix."""
    if not isinstance(raw, dict):
        raise SpecError([f"{root}: expected a mapping, got {type(raw).__name__}"])
    try:
        spec = PPOJobSpec.model_validate(raw)
    except pydantic.ValidationError as exc:
        raise SpecError([_describe(e, root) for e in exc.errors()]) from None
    problems = check_semantics(spec)
    if problems:
        raise SpecError(problems)
    return spec


OVERLAP_NEEDS_DISAGGREGATED = (
    "ppo.schedule OneStepOverlap generates the next batch on the rollout engines while the current one trains, which"
    " needs engines on GPUs of their own: set placement Disaggregated (and rollout.gpus > 0), or use ppo.schedule"
    " Synchronous"
)
OVERLAP_KEEPS_ENGINES_AWAKE = (
    "ppo.schedule OneStepOverlap keeps the rollout engines generating while training runs, so they never sleep:"
    " set offload.rollout to false, or use ppo.schedule Synchronous"
)
OVERLAP_RATIO_IS_CORRECTED = (
    "ppo.schedule OneStepOverlap takes the PPO ratio against the engines' own log-probs (the policy that generated"
    " each sample), which already corrects for the rollout/training mismatch: set ppo.rolloutCorrection.type to"
    " None, or use ppo.schedule Synchronous"
)

CRITIC_SAVE_OFF_THE_VOLUME = (
    "critic.save must be a folder under checkpoint.path when checkpoint.volumeClaim is set: the claim mounted at"
    " checkpoint.path is the only storage of the job's pods that outlives them, so critics saved elsewhere are lost"
    " with the pods; set critic.save to a folder under checkpoint.path (for example <checkpoint.path>/critic),"
    " without '..'"
)

EXPORT_OFF_THE_VOLUME = (
    "checkpoint.export.path must be a folder under checkpoint.path when checkpoint.volumeClaim is set: the claim"
    " mounted at checkpoint.path is the only storage of the job's pods that outlives them, so exports written"
    " elsewhere are lost with the pods; set checkpoint.export.path to a folder under checkpoint.path, or remove it"
    " to use <checkpoint.path>/export"
)

EXPORT_CRITIC_NEEDS_A_CRITIC = (
    "checkpoint.export.critic exports the critic, but critic.enabled is false: set checkpoint.export.critic to false,"
    " or enable the critic"
)


VALIDATION_NEEDS_PROMPTS = (
    "data.validation.count, interval, temperature and maxNewTokens set how held-out prompts are evaluated, but"
    " data.validation.prompts is unset: set it to a JSONL or Parquet file of prompts (or synthetic), or remove data.validation"
)

REWARD_FUNCTION_NOT_CUSTOM = (
    "reward.function is only called with reward.type Custom (or reward.model.combineWith Custom): set reward.type to"
    " Custom, or remove reward.function"
)

REMOTE_REWARD_NEEDS_URL = "reward.type Remote needs reward.remote.url, the scoring endpoint (http:// or https://)"

REMOTE_REWARD_NOT_REMOTE = (
    "reward.remote is only used with reward.type Remote (or reward.model.combineWith Remote): set reward.type to"
    " Remote, or remove reward.remote.url and reward.remote.headers"
)

COMBINED_CUSTOM_NEEDS_FUNCTION = (
    "reward.model.combineWith Custom needs reward.function, a 'module:function' reference"
)

COMBINED_REMOTE_NEEDS_URL = (
    "reward.model.combineWith Remote needs reward.remote.url, the scoring endpoint (http:// or https://)"
)

MODEL_REWARD_NEEDS_PATH = (
    "reward.type Model needs reward.model.path, a Hugging Face directory of a sequence-classification model with"
    " one label (AutoModelForSequenceClassification) and its tokenizer"
)

MODEL_REWARD_NOT_MODEL = (
    "reward.model is only used with reward.type Model: set reward.type to Model, or remove reward.model.path and"
    " reward.model.combineWith"
)

GATE_NEEDS_A_RULE = (
    "reward.model.combine Gate keeps the model's score only where a rule passes: set reward.model.combineWith"
    " (e.g. ExactAnswer), or use combine Sum"
)


def is_folder_under(path: str, directory: str) -> bool:
    """`path` names a folder inside `directory`, as the CRD's CEL rule reads it: by its characters
    (`directory` and a '/' are a prefix, something follows, no '..' segment), not by the file system."""
    base = directory if directory.endswith("/") else directory + "/"
    return path.startswith(base) and len(path) > len(base) and "/../" not in path and not path.endswith("/..")


def check_semantics(spec: PPOJobSpec) -> list[str]:
    """Cross-field rules; the same ones the CRD states in CEL, with the same messages."""
    problems = []
    ppo = spec.ppo
    if ppo.num_critic_only_steps > ppo.num_rollouts:
        problems.append(
            f"ppo.numCriticOnlySteps ({ppo.num_critic_only_steps}) must not exceed ppo.numRollouts"
            f" ({ppo.num_rollouts}): lower numCriticOnlySteps or raise numRollouts"
        )
    if ppo.num_critic_only_steps > 0 and not spec.critic.enabled:
        problems.append(
            "ppo.numCriticOnlySteps > 0 needs a critic: set critic.enabled to true or numCriticOnlySteps to 0"
        )
    if spec.placement == Placement.DISAGGREGATED and spec.rollout.gpus == 0:
        problems.append(
            "placement Disaggregated needs GPUs of its own for the rollout engines: set rollout.gpus > 0,"
            " or use placement Colocate"
        )
    if spec.placement == Placement.COLOCATE and spec.rollout.gpus != 0:
        problems.append(
            "placement Colocate runs the rollout engines on the training GPUs: set rollout.gpus to 0,"
            " or use placement Disaggregated"
        )
    reward = spec.reward
    combined = reward.type == RewardType.MODEL
    if reward.rule == RuleReward.CUSTOM and not reward.function:
        problems.append(COMBINED_CUSTOM_NEEDS_FUNCTION if combined else
                        "reward.type Custom needs reward.function, a 'module:function' reference")
    if reward.rule != RuleReward.CUSTOM and reward.function is not None:
        problems.append(REWARD_FUNCTION_NOT_CUSTOM)
    if reward.rule == RuleReward.REMOTE and reward.remote.url is None:
        problems.append(COMBINED_REMOTE_NEEDS_URL if combined else REMOTE_REWARD_NEEDS_URL)
    if reward.rule != RuleReward.REMOTE and (reward.remote.url is not None or reward.remote.headers is not None):
        problems.append(REMOTE_REWARD_NOT_REMOTE)
    if combined and reward.model.path is None:
        problems.append(MODEL_REWARD_NEEDS_PATH)
    if not combined and (reward.model.path is not None or reward.model.combine_with is not None):
        problems.append(MODEL_REWARD_NOT_MODEL)
    if reward.model.combine == RewardCombine.GATE and reward.model.combine_with is None:
        problems.append(GATE_NEEDS_A_RULE)
    header_names = [header.name for header in reward.remote.headers or []]
    if len(set(header_names)) != len(header_names):
        problems.append("reward.remote.headers: a header is named twice: keep one entry per name")
    model_parallel = spec.actor.parallelism.model_parallel_size
    if spec.resources.gpus_per_node and spec.resources.total_gpus % model_parallel:
        problems.append(
            "resources.nodes * resources.gpusPerNode must be a multiple of actor.parallelism.tensor *"
            " actor.parallelism.pipeline: adjust the GPU count or the parallel sizes"
        )
    critic = spec.training_role("critic")
    # A critic without sizes of its own has the actor's layout, which the actor's checks cover.
    own_critic_layout = spec.critic.enabled and spec.critic.parallelism.is_set
    if own_critic_layout and spec.resources.gpus_per_node and spec.resources.total_gpus % critic.model_parallel_size:
        problems.append(
            "resources.nodes * resources.gpusPerNode must be a multiple of critic.parallelism.tensor *"
            " critic.parallelism.pipeline (each defaults to the actor's): adjust the GPU count or the parallel sizes"
        )
    training_gpus = spec.resources.total_gpus - (spec.rollout.gpus if spec.placement == Placement.DISAGGREGATED else 0)
    samples = spec.rollout.batch_size * spec.rollout.samples_per_prompt
    for role in [spec.training_role("actor")] + ([critic] if own_critic_layout else []):
        if spec.resources.gpus_per_node and role.data is not None and role.data * role.model_parallel_size > training_gpus:
            problems.append(layout_does_not_fit(role.field))
        # Without GPUs the ranks are the trainer's --cpu-ranks, unknown here: the trainer's layout checks them.
        data = role.data if role.data is not None else training_gpus // role.model_parallel_size if spec.resources.gpus_per_node else 1
        if samples < data:
            problems.append(too_few_samples(role.field))
    if ppo.schedule == Schedule.ONE_STEP_OVERLAP:
        if spec.placement != Placement.DISAGGREGATED:
            problems.append(OVERLAP_NEEDS_DISAGGREGATED)
        if spec.offload.rollout:
            problems.append(OVERLAP_KEEPS_ENGINES_AWAKE)
        if ppo.rollout_correction.type != RolloutCorrection.NONE:
            problems.append(OVERLAP_RATIO_IS_CORRECTED)
    if ppo.clip_eps_high is not None and ppo.clip_eps_high < ppo.clip_eps:
        problems.append(
            "ppo.clipEpsHigh must be at least ppo.clipEps (it widens the upper clip bound); remove it to use"
            " clipEps on both sides"
        )
    validation = spec.data.validation
    settings = (validation.count, validation.interval, validation.temperature, validation.max_new_tokens)
    if not validation.enabled and any(value is not None for value in settings):
        problems.append(VALIDATION_NEEDS_PROMPTS)
    checkpoint = spec.checkpoint
    if checkpoint.volume_claim and spec.critic.save is not None and not is_folder_under(spec.critic.save, checkpoint.path):
        problems.append(CRITIC_SAVE_OFF_THE_VOLUME)
    export = checkpoint.export
    if export is not None and export.critic and not spec.critic.enabled:
        problems.append(EXPORT_CRITIC_NEEDS_A_CRITIC)
    if checkpoint.volume_claim and export is not None and export.path is not None and not is_folder_under(
            export.path, checkpoint.path):
        problems.append(EXPORT_OFF_THE_VOLUME)
    return problems


def layout_does_not_fit(field: str) -> str:
    return (
        f"{field}.parallelism.data * tensor * pipeline ranks do not fit the training GPUs (resources.nodes *"
        f" resources.gpusPerNode, less rollout.gpus when Disaggregated): lower {field}.parallelism.data, or leave"
        " it unset to use every training GPU"
    )


def too_few_samples(field: str) -> str:
    return (
        f"a step's samples (rollout.batchSize * rollout.samplesPerPrompt) are fewer than the {field}'s data-parallel"
        f" ranks ({field}.parallelism.data; unset, the training GPUs / (tensor * pipeline)), each of which trains on"
        f" its own share: raise rollout.batchSize, or lower {field}.parallelism.data"
    )


def spec_from_manifest(manifest: dict[str, Any]) -> PPOJobSpec:
    """A PPOJob manifest (or a bare spec) -> PPOJobSpec."""
    if "spec" in manifest and manifest.get("kind") in (None, "PPOJob"):
        return parse_spec(manifest["spec"])
    return parse_spec(manifest)


def to_manifest_dict(spec: PPOJobSpec) -> dict[str, Any]:
    """The spec as the API server would store it (camelCase, defaults filled, unset optionals dropped)."""
    return spec.model_dump(mode="json", by_alias=True, exclude_none=True)
