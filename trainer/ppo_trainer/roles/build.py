"""Placement and construction of the roles: one shared placement group, fractional shares, the engines.

`compute_layout` decides, from the spec and whether the cluster has GPUs, how many training
ranks and rollout engines there are and what one bundle holds ({"GPU": 1, "CPU": 1} there,
{"CPU": 1} here). Actor, critic and reference rank i share bundle i, each with a fractional
share of it; the rollout engines share those bundles when placement is Colocate and get a
placement group of their own when Disaggregated. A role's device follows its share: a GPU share
means "cuda". `build_roles` waits for the placement groups for a bounded time and fails with
what was asked and what the cluster has, instead of hanging; it then sets up the data-parallel
groups of the actor and the critic. An SGLang engine's server is launched by its rollout worker,
on the worker's bundle; `builtin_sglang_server` serves it with the built-in server instead (tests
and development on CPUs), through the same launcher.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ppo_trainer.offload import Transition
from ppo_trainer.roles.actor import ActorWorker
from ppo_trainer.roles.critic import CriticWorker
from ppo_trainer.roles.group import RoleGroup
from ppo_trainer.roles.ref import RefWorker
from ppo_trainer.roles.rollout import RolloutWorker
from ppojob_api.spec import PPOJobSpec
from ppojob_api.vocabulary import Placement, TrainBackend
from ppojob_api.vocabulary import RolloutEngine as EngineKind

logger = logging.getLogger(__name__)


class PlacementError(RuntimeError):
    """The placement groups could not be placed in time, or the layout is impossible."""


@dataclass(frozen=True)
class Layout:
    use_gpus: bool
    train_ranks: int
    rollout_engines: int
    colocate: bool
    with_critic: bool
    cuda_ipc_weights: bool = False
    """Colocated torch engines on GPUs copy the weights from the actor rank on their GPU (CUDA IPC)."""

    @property
    def device(self) -> str:
        return "cuda" if self.use_gpus else "cpu"

    @property
    def bundle(self) -> dict[str, float]:
        return {"GPU": 1.0, "CPU": 1.0} if self.use_gpus else {"CPU": 1.0}

    @property
    def roles_per_train_bundle(self) -> int:
        """actor + ref (+ critic) (+ a colocated engine)."""
        return 2 + int(self.with_critic) + int(self.colocate)

    def share(self, *, shared: bool) -> dict[str, float]:
        """Ray resources of one role's rank: a fraction of a training bundle, or a whole one."""
        fraction = 1.0 / self.roles_per_train_bundle if shared else 1.0
        key = "num_gpus" if self.use_gpus else "num_cpus"
        return {key: fraction, "num_cpus": fraction} if self.use_gpus else {key: fraction}


def compute_layout(spec: PPOJobSpec, *, use_gpus: bool, cpu_ranks: int = 1) -> Layout:
    """Training ranks and engines: from the spec's GPUs on a GPU cluster, `cpu_ranks` and one engine on CPUs."""
    colocate = spec.placement == Placement.COLOCATE
    parallel = spec.actor.parallelism
    if parallel.model_parallel_size != 1 and spec.actor.backend != TrainBackend.MEGATRON:
        raise PlacementError(
            "the Torch backend runs one device per rank: set actor.parallelism and critic.parallelism to 1,"
            " or use actor.backend Megatron for tensor and pipeline parallelism"
        )
    if spec.rollout.tensor_parallel != 1:
        raise PlacementError("the rollout engines run one device each for now: set rollout.tensorParallel to 1")
    if use_gpus:
        train_gpus = spec.resources.total_gpus - (0 if colocate else spec.rollout.gpus)
        if train_gpus < 1:
            raise PlacementError(
                f"no GPUs left for training: resources give {spec.resources.total_gpus} and rollout.gpus takes "
                f"{spec.rollout.gpus}; raise resources.gpusPerNode or lower rollout.gpus"
            )
        engines = train_gpus if colocate else spec.rollout.gpus
        if spec.rollout.batch_size < engines:
            raise PlacementError(
                f"rollout.batchSize ({spec.rollout.batch_size}) is smaller than the number of rollout engines"
                f" ({engines}), which share a step's prompts: raise it to at least {engines}"
            )
        cuda_ipc = colocate and spec.rollout.engine == EngineKind.TORCH  # SGLang's servers take IPC from the worker
        return Layout(True, train_gpus, engines, colocate, spec.critic.enabled, cuda_ipc_weights=cuda_ipc)
    return Layout(False, cpu_ranks, 1, colocate, spec.critic.enabled)


@dataclass
class Roles:
    """The role groups of one run, and the operations that span them."""

    layout: Layout
    rollout: RoleGroup
    actor: RoleGroup
    ref: RoleGroup
    critic: RoleGroup | None
    placement_groups: list[PlacementGroup] = field(default_factory=list)

    @property
    def groups(self) -> list[RoleGroup]:
        return [g for g in (self.rollout, self.actor, self.critic, self.ref) if g is not None]

    def sync_weights(self) -> None:
        """New actor weights to every engine. Colocated torch engines on GPUs: engine i copies them from
        actor rank i on its GPU (CUDA IPC); otherwise colocated: through Ray from rank 0; Disaggregated:
        over the weight-update group (the engines wake first to take them). Every actor rank takes the turn."""
        if self.layout.cuda_ipc_weights:
            shared = self.actor.call("share_weights")
            try:
                ray.get([engine.update_weights_shared.remote(s) for engine, s in zip(self.rollout.handles, shared)])
            finally:
                self.actor.call("release_weights")
        elif self.layout.colocate:
            exported = self.actor.async_call("export_weights")
            ray.get([engine.update_weights.remote(exported[0]) for engine in self.rollout.handles] + list(exported))
        else:
            self.rollout.call("wake")
            self.actor.call("broadcast_weights")

    def poll(self) -> tuple[list[Transition], dict[str, str]]:
        """Every rank's transitions since the last poll (in time order), and each role's state (rank 0's)."""
        handles = [h for g in self.groups for h in g.handles]
        drained = ray.get([h.drain_transitions.remote() for h in handles])
        states = ray.get([g.handles[0].state.remote() for g in self.groups])
        transitions = sorted((t for ts in drained for t in ts), key=lambda t: t.time)
        return transitions, {g.role: s for g, s in zip(self.groups, states)}

    def shutdown(self) -> None:
        try:  # the servers the engines launched run in their own process groups: stop them first
            ray.get([handle.close.remote() for handle in self.rollout.handles], timeout=60)
        except Exception:  # a dead worker's servers are beyond reach; kill the rest anyway
            logger.warning("stopping the rollout servers failed; killing the workers anyway", exc_info=True)
        for group in self.groups:
            group.kill()
        for pg in self.placement_groups:
            remove_placement_group(pg)


def _wait(pg: PlacementGroup, *, what: str, bundles: list[dict], timeout: float) -> None:
    ready, _ = ray.wait([pg.ready()], timeout=timeout)
    if not ready:
        remove_placement_group(pg)
        raise PlacementError(
            f"the {what} placement group ({len(bundles)} x {bundles[0]}) was not placed within {timeout:.0f}s; "
            f"the cluster has {ray.available_resources()} available: free resources or lower the request"
        )


def build_roles(spec: PPOJobSpec, layout: Layout, *, timeout: float, builtin_sglang_server: bool = False) -> Roles:
    """Place and build every role. `builtin_sglang_server` (tests, development) serves rollout.engine
    SGLang with the built-in server, which speaks SGLang's protocol and runs on a CPU."""
    if spec.rollout.engine == EngineKind.SGLANG and not layout.use_gpus and not builtin_sglang_server:
        raise PlacementError(
            "rollout.engine SGLang needs GPUs (SGLang is CUDA-only) and this cluster has none: "
            "use rollout.engine Torch on CPUs"
        )
    train_bundles = [dict(layout.bundle) for _ in range(layout.train_ranks)]
    train_pg = placement_group(train_bundles, strategy="PACK")
    _wait(train_pg, what="training", bundles=train_bundles, timeout=timeout)
    pgs = [train_pg]
    offload = spec.train_offload

    def on(pg: PlacementGroup, index: int, share: dict[str, float]) -> dict:
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
        return {**share, "scheduling_strategy": strategy}

    if layout.colocate:
        rollout_pg, engine_share = train_pg, layout.share(shared=True)
        engine_bundle = [i % layout.train_ranks for i in range(layout.rollout_engines)]
    else:
        rollout_bundles = [dict(layout.bundle) for _ in range(layout.rollout_engines)]
        rollout_pg = placement_group(rollout_bundles, strategy="PACK")
        _wait(rollout_pg, what="rollout", bundles=rollout_bundles, timeout=timeout)
        pgs.append(rollout_pg)
        engine_share, engine_bundle = layout.share(shared=False), list(range(layout.rollout_engines))

    engines = [
        ray.remote(RolloutWorker)
        .options(**on(rollout_pg, engine_bundle[rank], engine_share))
        .remote(spec, rank=rank, device=layout.device, builtin_server=builtin_sglang_server)
        for rank in range(layout.rollout_engines)
    ]
    share, ranks = layout.share(shared=True), range(layout.train_ranks)
    common = {"world_size": layout.train_ranks, "device": layout.device, "offload": offload}
    workers = None if layout.colocate else engines

    def group(cls, role: str, **extra) -> RoleGroup:
        handles = [
            ray.remote(cls).options(**on(train_pg, rank, share)).remote(spec, rank=rank, **common, **extra)
            for rank in ranks
        ]
        return RoleGroup(role, handles)

    roles = Roles(
        layout=layout,
        rollout=RoleGroup("rollout", engines),
        actor=group(ActorWorker, "actor", rollout_workers=workers),
        ref=group(RefWorker, "ref"),
        critic=group(CriticWorker, "critic") if layout.with_critic else None,
        placement_groups=pgs,
    )
    try:
        ray.get([h.state.remote() for g in roles.groups for h in g.handles])  # constructors done
        for group in (roles.actor, roles.critic, roles.ref):
            if group is not None:
                group.setup_process_group()
    except BaseException:
        roles.shutdown()  # no server or placement group outlives a failed build
        raise
    return roles
