"""The closed vocabulary of the PPOJob API: phases, stages, residencies, condition types, reasons.

Handlers, the trainer and tests use these enums, never string literals. The values are the
strings the CRD's enums accept (crds/ppojobs.ppojob.io.yaml); a unit test checks they agree.
Depends on nothing but the standard library.
"""

from __future__ import annotations

import enum

GROUP = "ppojob.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "PPOJob"
PLURAL = "ppojobs"

# Labels put on every object created for a job, so that they can be listed and cleaned up.
LABEL_JOB_NAME = "ppojob.io/job-name"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "ppojob-operator"
# The attempt a child belongs to (status.attempt); children of other attempts are torn down.
LABEL_ATTEMPT = "ppojob.io/attempt"
# Which part of the job a Ray pod template is: head, train (actor and critic), rollout.
LABEL_ROLE = "ppojob.io/role"
ROLE_HEAD = "head"
# The trainer reports to a ConfigMap of its job's (named in this environment variable), under this
# key, as the JSON of `status.progress`; the operator folds it into the PPOJob's status.
ENV_PROGRESS_CONFIGMAP = "PPOJOB_PROGRESS_CONFIGMAP"
PROGRESS_KEY = "progress"


class Phase(str, enum.Enum):
    PENDING = "Pending"
    QUEUED = "Queued"  # waiting for Kueue to admit the RayCluster (first, or again after an eviction)
    SCHEDULING = "Scheduling"
    INITIALIZING = "Initializing"
    CRITIC_WARMUP = "CriticWarmup"
    TRAINING = "Training"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"
    RESTARTING = "Restarting"

    @property
    def is_finished(self) -> bool:
        return self in (Phase.SUCCEEDED, Phase.FAILED)


class Stage(str, enum.Enum):
    """What the trainer is doing within a step (ppo.schedule OneStepOverlap: two things at once, the
    engines generating the next step's batch while a role trains on this one's)."""

    STARTING = "Starting"
    GENERATE = "Generate"
    CRITIC_TRAIN = "CriticTrain"
    ACTOR_TRAIN = "ActorTrain"
    GENERATE_CRITIC_TRAIN = "Generate+CriticTrain"
    GENERATE_ACTOR_TRAIN = "Generate+ActorTrain"
    WEIGHT_SYNC = "WeightSync"
    EVALUATE = "Evaluate"
    """The policy answers the held-out prompts of data.validation."""
    CHECKPOINT = "Checkpoint"
    DONE = "Done"


class TrainResidency(str, enum.Enum):
    """Where a training role's weights and optimizer state live."""

    ON_DEVICE = "OnDevice"
    OFFLOADED = "Offloaded"


class RolloutResidency(str, enum.Enum):
    AWAKE = "Awake"
    ASLEEP = "Asleep"


class ConditionType(str, enum.Enum):
    VALID = "Valid"  # the spec passed the checks the schema cannot make
    ADMITTED = "Admitted"  # Kueue admitted the RayCluster's workload (its reason is Kueue's own)
    GANG_SCHEDULED = "GangScheduled"  # every pod of the job was placed together
    CLUSTER_READY = "ClusterReady"  # the RayCluster reports ready
    PODS_READY = "PodsReady"  # every pod of the running attempt is ready (its node reports)
    TRAINER_RUNNING = "TrainerRunning"  # the trainer was started and reports a heartbeat
    CRITIC_WARMUP = "CriticWarmup"  # in the critic-only warm-up steps
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class Reason(str, enum.Enum):
    """Reasons of conditions and events (CamelCase, as Kubernetes' own)."""

    CREATED = "Created"
    INVALID_SPEC = "InvalidSpec"
    QUEUED = "Queued"
    ADMITTED = "Admitted"
    EVICTED = "Evicted"
    QUEUE_CAPACITY_EXCEEDED = "QueueCapacityExceeded"
    GANG_PENDING = "GangPending"
    GANG_SCHEDULED = "GangScheduled"
    GANG_TIMEOUT = "GangScheduleTimeout"
    CLUSTER_READY = "ClusterReady"
    CLUSTER_NOT_READY = "ClusterNotReady"
    PODS_READY = "PodsReady"
    PODS_NOT_READY = "PodsNotReady"
    TRAINER_PENDING = "TrainerPending"
    TRAINER_STARTED = "TrainerStarted"
    TRAINER_LOST = "TrainerLost"
    TRAINER_FAILED = "TrainerFailed"
    WARMUP_STEP = "CriticWarmupStep"
    WARMUP_DONE = "CriticWarmupDone"
    TRAINING = "Training"
    CHECKPOINT_WRITTEN = "CheckpointWritten"
    EVALUATED = "Evaluated"
    POD_LOST = "PodLost"
    RESTARTING = "Restarting"
    BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    SUSPENDED = "Suspended"
    RESUMED = "Resumed"
    SUCCEEDED = "Succeeded"
    TTL_EXPIRED = "TTLExpired"
    CLUSTER_DELETED = "ClusterDeleted"
    DUPLICATE_HEAD_DELETED = "DuplicateHeadPodDeleted"
    RECONCILE_ERROR = "ReconcileError"
    REPORT_REFUSED = "ReportRefused"


class RewardType(str, enum.Enum):
    SYNTHETIC = "Synthetic"
    EXACT_ANSWER = "ExactAnswer"
    CUSTOM = "Custom"
    REMOTE = "Remote"
    MODEL = "Model"
    """A Hugging Face sequence-classification model's score (reward.model)."""


class RuleReward(str, enum.Enum):
    """The rule-based rewards a reward model's score may be combined with (reward.model.combineWith)."""

    SYNTHETIC = "Synthetic"
    EXACT_ANSWER = "ExactAnswer"
    CUSTOM = "Custom"
    REMOTE = "Remote"


class RewardCombine(str, enum.Enum):
    """How a reward model's weighted score meets the rule's: added to it, or counted only where the rule passes."""

    SUM = "Sum"
    GATE = "Gate"


class Placement(str, enum.Enum):
    COLOCATE = "Colocate"
    DISAGGREGATED = "Disaggregated"


class Schedule(str, enum.Enum):
    """When each step's batch is generated: after the previous step's weight sync (Synchronous), or
    while the previous step trains, with the weights the engines hold (OneStepOverlap)."""

    SYNCHRONOUS = "Synchronous"
    ONE_STEP_OVERLAP = "OneStepOverlap"


class RolloutEngine(str, enum.Enum):
    TORCH = "Torch"
    SGLANG = "SGLang"


class TrainBackend(str, enum.Enum):
    TORCH = "Torch"
    MEGATRON = "Megatron"


class GangScheduler(str, enum.Enum):
    COSCHEDULING = "Coscheduling"
    KUEUE = "Kueue"
    NONE = "None"


class KLEstimator(str, enum.Enum):
    K1 = "k1"
    K2 = "k2"
    K3 = "k3"


class LossAggregation(str, enum.Enum):
    """How per-token losses are reduced over a step's batch (the same for any micro-batch size and rank count)."""

    TOKEN_MEAN = "TokenMean"
    SEQUENCE_MEAN_TOKEN_MEAN = "SequenceMeanTokenMean"
    SEQUENCE_MEAN_TOKEN_SUM = "SequenceMeanTokenSum"


class RolloutCorrection(str, enum.Enum):
    """How the policy loss accounts for the rollout engine's log-probs differing from the trainer's."""

    NONE = "None"
    TRUNCATED_IMPORTANCE_SAMPLING = "TruncatedImportanceSampling"
