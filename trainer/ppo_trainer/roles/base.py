"""What every training role's rank has in common: a backend, a residency, and taking turns on the device.

A `RoleWorker` is a plain Python class (Ray turns it into an actor in `roles/group.py`, tests may
use it in-process). It owns one rank's backend and its `Residency`; `turn(action)` wakes the
rank, checks it is awake, runs the work, and puts it back to sleep when train-side offload is on,
so actor, critic and reference take turns on the same devices. Every transition is recorded and
handed to the driver by `drain_transitions`. A role's ranks form a process group
(`distributed.py`) that is built right after they wake and destroyed right before they sleep
(unless `spec.offload.processGroups` is false: then it is built once and kept):
with the Torch backend the actor's and critic's ranks when there are several (data parallelism);
with a backend that builds on it (Megatron) every role, one rank included (its model-parallel groups live on that group, and
are destroyed and rebuilt with it). Waking is then collective, so a multi-rank role is always
called on all its ranks at once (`RoleGroup`). A Megatron rank builds its model only once the
group exists (right away for one rank; at `join_process_group` for several). Megatron ranks are
ordered tensor-parallel first: ranks 2i and 2i+1 of a tensor-parallel size 2 hold halves of one
model and read the same rows (data rank i). Each role has its own settings and layout
(`PPOJobSpec.training_role`: the critic's own model, backend, micro-batch and parallelism);
`backends/build.py` builds the backend and says whether it lives on the role's group. Must not
depend on Ray.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from ppo_trainer.algorithms import BatchCounts, batch_counts
from ppo_trainer.backends.base import TrainBackend
from ppo_trainer.backends.build import build_backend, builds_on_process_group
from ppo_trainer.batch import RolloutBatch
from ppo_trainer.distributed import RoleProcessGroup
from ppo_trainer.offload import Residency, Transition
from ppo_trainer.roles.handoff import shard_sample_ids
from ppo_trainer.rollout.layout import merge_batches
from ppojob_api.spec import PPOJobSpec


def take_rows(tensor: torch.Tensor, rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Rows of a CPU batch tensor, on the device of the model output `like` (a loss compares them)."""
    return tensor[rows.to(tensor.device)].to(like.device, non_blocking=True)


def batch_size(parts: tuple[RolloutBatch, ...]) -> int:
    """Samples in the step's batch: the engines' parts together."""
    return sum(part.size for part in parts)


def use_all_cores(device: str) -> None:
    """Ray pins a fractional-CPU actor to one thread; roles take turns, so each may use every core."""
    if device == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)


DATA_PARALLEL_ROLES = ("actor", "critic")
"""The roles that train, and so sum their gradients over their ranks."""


class RoleWorker:
    """One rank of a training role; subclasses add the role's work."""

    role = "role"

    def __init__(
        self, spec: PPOJobSpec, *, rank: int, world_size: int, device: str, offload: bool, shared_process: bool = False
    ) -> None:
        """`shared_process`: this rank shares its process with other roles' ranks (the one-process GPU
        benchmark); they then share one world of one rank that lives as long as the process."""
        use_all_cores(device)
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.offload = offload
        self._transitions: list[Transition] = []
        self.residency = Residency.for_train_role(self.role, rank=rank, listener=self._transitions.append)
        self.training = spec.training_role(self.role)
        model_parallel = self.training.model_parallel_size
        if world_size % model_parallel:
            raise ValueError(
                f"{self.role}: {world_size} ranks do not split into models of {self.training.field}.parallelism.tensor"
                f" * pipeline = {model_parallel} ranks; make the rank count a multiple of it"
            )
        self.data_rank, self.data_size = rank // model_parallel, world_size // model_parallel
        on_group = builds_on_process_group(self.training)
        self.process_group: RoleProcessGroup | None = None
        if not shared_process and (on_group or (world_size > 1 and self.role in DATA_PARALLEL_ROLES)):
            self.process_group = RoleProcessGroup(
                role=self.role, rank=rank, world_size=world_size, device=device, listener=self._transitions.append
            )
        self.backend: TrainBackend | None = None
        if on_group and self.process_group is not None:
            if world_size == 1:  # its own rendezvous; with several ranks, join_process_group builds the model
                self.process_group.host("127.0.0.1")
                self._build_backend()
        else:
            self._build_backend()

    def _build_backend(self) -> None:
        """Build the model (on the live group when there is one: a backend's own groups then follow it
        through every sleep), let the role finish it (`backend_built`), and sleep when offloading."""
        if self.process_group is not None and builds_on_process_group(self.training):
            self.process_group.connect()
        self.backend = build_backend(self.spec, role=self.role, device=self.device)
        if self.process_group is not None:
            self.process_group.on_connect = self.backend.attach_process_groups
            self.process_group.on_disconnect = self.backend.release_process_groups
        self.backend_built()
        if self.offload:
            self.sleep()

    def backend_built(self) -> None:
        """Called once the backend exists, awake; a role that starts from a checkpoint loads it here."""

    # Explicit transitions: idempotent (a second sleep is a no-op).
    def sleep(self) -> bool:
        if self.process_group is not None and self.spec.offload.process_groups:
            self.process_group.disconnect()  # before the role sleeps: a sleeping role holds no communicator
        return self.residency.sleep(self._require_backend().offload)

    def wake(self) -> bool:
        changed = self.residency.wake(self._require_backend().onload)
        if self.process_group is not None:
            self.process_group.connect()  # after it wakes, together with the role's other ranks
        return changed

    # The process group's rendezvous, set up once by the driver (RoleGroup.setup_process_group).
    def host_process_group(self, address: str) -> tuple[str, int] | None:
        """Rank 0 of a role whose ranks need a rendezvous: serve it; None when there is nothing to set up."""
        if self.process_group is None or self.process_group.has_rendezvous:
            return None
        return self.process_group.host(address)

    def join_process_group(self, address: str, port: int) -> None:
        """Attach to rank 0's store; an awake rank builds the group now, a Megatron rank its model
        (every rank is called at once)."""
        if self.process_group is None:
            raise RuntimeError(f"{self.role}[{self.rank}] has no process group to join")
        self.process_group.attach(address, port)
        if self.backend is None:
            self._build_backend()
        elif self.residency.awake:
            self.process_group.connect()

    def _require_backend(self) -> TrainBackend:
        if self.backend is None:
            raise RuntimeError(
                f"{self.role}[{self.rank}]: the model is built once the role's ranks have joined their process"
                " group (RoleGroup.setup_process_group, called by roles/build.py)"
            )
        return self.backend

    def state(self) -> str:
        return self.residency.state

    def drain_transitions(self) -> list[Transition]:
        drained, self._transitions[:] = list(self._transitions), []
        return drained

    @contextlib.contextmanager
    def turn(self, action: str, *, stay_awake: bool = False) -> Iterator[None]:
        """Wake, do `action`, and sleep again when train-side offload is on (even if `action` fails).
        `stay_awake`: a successful `action` leaves the rank awake for the caller's next use of it."""
        self.wake()
        self.residency.require_awake(action)
        done = False
        try:
            yield
            done = True
        finally:
            if self.offload and not (done and stay_awake):
                self.sleep()

    def shard(self, parts: tuple[RolloutBatch, ...]) -> RolloutBatch:
        """This rank's rows of the step's batch (the engines' parts merged, then rows data_rank::data_size)."""
        return self.training_batch(parts)[0]

    def training_batch(self, parts: tuple[RolloutBatch, ...]) -> tuple[RolloutBatch, BatchCounts]:
        """This rank's rows, and the counts of the whole step's batch that every rank's loss terms are
        divided by (every rank receives all the engines' parts, so no collective is needed)."""
        merged = merge_batches(list(parts))
        return merged.shard(self.data_rank, self.data_size), batch_counts(merged.response_mask)

    def sample_ids(self, batch: RolloutBatch, parts: tuple[RolloutBatch, ...]) -> torch.Tensor:
        """The sample ids (rows of the merged batch) of this rank's shard `batch`."""
        ids = shard_sample_ids(batch_size(parts), data_rank=self.data_rank, data_size=self.data_size)
        if len(ids) != batch.size:
            raise RuntimeError(f"{self.role}[{self.rank}]: {batch.size} rows for {len(ids)} sample ids")
        return ids

    def log_probs(self, *parts: RolloutBatch) -> torch.Tensor:
        """[B_rank, T] float32 CPU log-probs of the sampled tokens under this rank's policy."""
        batch = self.shard(parts)
        with self.turn("compute log-probs"):
            return self.backend.forward(batch)["log_probs"]

    def save(self, directory: str) -> str:
        """Write this rank's model and optimizer state into `directory` (a checkpoint being written)."""
        from ppo_trainer.checkpoint import write_role_state

        with self.turn("save a checkpoint"):
            state = {"backend": self.backend.state_dict(), "rng": torch.get_rng_state()}
        return write_role_state(directory, role=self.role, rank=self.rank, state=state)

    def export(self, directory: str, *, dtype: str) -> str | None:
        """This role's model as a Hugging Face directory (`export.py`), written by rank 0 in `dtype`;
        every rank takes part, since gathering the weights is collective. Returns the path on rank 0."""
        from ppo_trainer.export import export_source, write_export
        from ppo_trainer.models import resolve_dtype
        from ppo_trainer.weight_sync.base import drain

        with self.turn("export"):
            weights = self.backend.named_weights()
            if self.rank != 0:
                drain(weights)  # this rank's part of each gather
                return None
            model = self.spec.model
            source = export_source(self.training.model, tokenizer=model.tokenizer or model.path,
                                   value_model=self.backend.is_value_model)
            return str(write_export(directory, weights, source=source, dtype=resolve_dtype(dtype)))

    def load(self, directory: str) -> None:
        from ppo_trainer.checkpoint import read_role_state

        state = read_role_state(directory, role=self.role, rank=self.rank)
        with self.turn("load a checkpoint"):
            self.backend.load_state_dict(state["backend"])
        torch.set_rng_state(state["rng"])
