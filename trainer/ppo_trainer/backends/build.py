"""The one place that knows which backend class serves which `TrainingRole.backend`.

`build_backend(spec, role=..., device=...)` builds one rank's backend from the role's settings
(`PPOJobSpec.training_role`: the critic's own model, backend, learning rate, micro-batch,
gradient clip and layout, the actor's where unset). `builds_on_process_group` says whether a
backend's model lives on the role's process group (Megatron's model-parallel groups, even for one
rank), so that a role builds the group first; roles ask it instead of naming backends. Heavy
imports stay inside each backend's module. Must not depend on Ray or the PPO loop.
"""

from __future__ import annotations

from ppo_trainer.backends.base import TrainBackend
from ppojob_api.spec import PPOJobSpec, TrainingRole
from ppojob_api.vocabulary import TrainBackend as BackendKind


def builds_on_process_group(training: TrainingRole) -> bool:
    """True when the backend's model needs the role's process group before it is built."""
    return training.backend == BackendKind.MEGATRON


def build_backend(spec: PPOJobSpec, *, role: str, device: str) -> TrainBackend:
    """The training backend of one rank of `role` ("actor", "critic" or "ref")."""
    training = spec.training_role(role)
    kwargs = {
        "model_spec": training.model,
        "role": role,
        "learning_rate": training.learning_rate,
        "max_grad_norm": training.max_grad_norm,
        "device": device,
        "seed": spec.seed,
        "dtype": spec.model.dtype,
        "logits_temperature": spec.rollout.temperature or 1.0,  # log-probs of the distribution sampled from
        "forward_micro_batch_size": training.micro_batch_size,
        "compile": spec.actor.compile and device.startswith("cuda"),
    }
    if training.backend == BackendKind.MEGATRON:
        from ppo_trainer.backends.megatron.backend import MegatronBackend

        return MegatronBackend(**kwargs, tensor_parallel=training.tensor, pipeline_parallel=training.pipeline)
    from ppo_trainer.backends.torch_backend import TorchBackend

    return TorchBackend(**kwargs)
