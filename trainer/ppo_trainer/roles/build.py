"""Placement and construction of the roles: one shared placement group, fractional shares, the engines.

`compute_layout` decides, from the spec and whether the cluster has GPUs, how many training
bundles and rollout engines there are, what one bundle holds ({"GPU": 1, "CPU": 1} there,
{"CPU": 1} here) and each training role's ranks (`RoleLayout`: model-parallel size times
data-parallel size, from `actor.parallelism` and `critic.parallelism`; a layout that does not fit
the bundles is a `PlacementError` naming the field). Actor, critic and reference rank i share
bundle i, each with a fractional share of it (a role with fewer ranks uses the first bundles;
the reference follows the actor); the rollout engines share those bundles when placement is Colocate and get a
placement group of their own when Disaggregated. A role's device follows its share: a GPU share
means "cuda". `build_roles` waits for the placement groups for a bounded time and fails with
what was asked and what the cluster has, instead of hanging; it then sets up the data-parallel
groups of the actor and the critic. Every role's process gets the compile caches' environment
(`compile_cache.py`: under the checkpoint directory, so a restarted job finds them), and
`Roles.take_compile_seconds` says how long the roles' processes spent compiling. An
SGLang engine's server is launched by its rollout worker, on the worker's bundle, as the
`ServerProgram` says (SGLang's own; the tests hand in their CPU stand-in, `tests/doubles/`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ppo_trainer.compile_cache import compile_cache_dir, compile_cache_env, compile_seconds
from ppo_trainer.offload import Transition
from ppo_trainer.roles.actor import ActorWorker
from ppo_trainer.roles.critic import CriticWorker
from ppo_trainer.roles.group import PerRank, RoleGroup
from ppo_trainer.roles.handoff import ranks_sharing_samples
from ppo_trainer.roles.ref import RefWorker
from ppo_trainer.roles.rollout import RolloutWorker
from ppo_trainer.rollout.sglang.server_args import SGLANG, ServerProgram
from ppo_trainer.weight_sync import CUDA_IPC, WeightSyncPath, choose_path, weight_sync_path
from ppojob_api.spec import PPOJobSpec, TrainingRole
from ppojob_api.vocabulary import Placement, TrainBackend
from ppojob_api.vocabulary import RolloutEngine as EngineKind

logger = logging.getLogger(__name__)

STATUS_CALLS = "status"
"""The rollout workers' concurrency group for `drain_transitions` and `state`."""


class PlacementError(RuntimeError):
    """The placement groups could not be placed in time, or the layout is impossible."""


@dataclass(frozen=True)
class Layout:
    use_gpus: bool
    train_ranks: int
    """Training bundles: one device each (a GPU, or a CPU share)."""
    rollout_engines: int
    colocate: bool
    with_critic: bool
    actor: RoleLayout
    critic: RoleLayout | None
    weight_sync: str
    """How the actor's weights reach the engines: a path of `weight_sync.PATHS` (`choose_path`)."""

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


@dataclass(frozen=True)
class RoleLayout:
    """A training role's ranks: rank r sits on training bundle r and is data rank r // model_parallel."""

    model_parallel: int
    data: int

    @property
    def ranks(self) -> int:
        return self.model_parallel * self.data


def route(refs: PerRank, *, source: RoleLayout, target: RoleLayout) -> PerRank:
    """For each rank of the target role, the refs of the source role's data ranks that share its
    samples (each data rank's first model-parallel rank: the others hold the same rows)."""
    return PerRank(
        [refs[d * source.model_parallel] for d in ranks_sharing_samples(
            data_rank=rank // target.model_parallel, data_size=target.data, other_data_size=source.data)]
        for rank in range(target.ranks)
    )


def compute_role_layout(training: TrainingRole, *, bundles: int, what: str) -> RoleLayout:
    """The role's ranks on the first of `bundles` training bundles ("what": how the bundles are counted)."""
    field, model_parallel = training.field, training.model_parallel_size
    if model_parallel != 1 and training.backend != TrainBackend.MEGATRON:
        raise PlacementError(
            f"the Torch backend runs one device per rank: set {field}.parallelism.tensor and pipeline to 1,"
            f" or use {field}.backend Megatron for tensor and pipeline parallelism"
        )
    if training.data is None:
        if bundles % model_parallel:
            raise PlacementError(
                f"{bundles} training bundles ({what}) do not split into models of {field}.parallelism.tensor *"
                f" pipeline = {model_parallel} ranks: make the count a multiple, or set {field}.parallelism.data"
            )
        return RoleLayout(model_parallel=model_parallel, data=bundles // model_parallel)
    if training.data * model_parallel > bundles:
        raise PlacementError(
            f"{field}.parallelism.data ({training.data}) * tensor * pipeline ({model_parallel}) ="
            f" {training.data * model_parallel} ranks do not fit the {bundles} training bundles ({what}):"
            f" lower {field}.parallelism.data, or leave it unset to use every bundle"
        )
    return RoleLayout(model_parallel=model_parallel, data=training.data)


def compute_layout(spec: PPOJobSpec, *, use_gpus: bool, cpu_ranks: int = 1) -> Layout:
    """Training bundles and engines (from the spec's GPUs on a GPU cluster, `cpu_ranks` and one
    engine on CPUs), and each training role's ranks on them."""
    colocate = spec.placement == Placement.COLOCATE
    if spec.rollout.tensor_parallel != 1:
        raise PlacementError("the rollout engines run one device each for now: set rollout.tensorParallel to 1")
    if use_gpus:
        train_ranks = spec.resources.total_gpus - (0 if colocate else spec.rollout.gpus)
        if train_ranks < 1:
            raise PlacementError(
                f"no GPUs left for training: resources give {spec.resources.total_gpus} and rollout.gpus takes "
                f"{spec.rollout.gpus}; raise resources.gpusPerNode or lower rollout.gpus"
            )
        engines = train_ranks if colocate else spec.rollout.gpus
        what = "resources.nodes * resources.gpusPerNode" + ("" if colocate else " - rollout.gpus")
    else:
        train_ranks, engines, what = cpu_ranks, 1, "--cpu-ranks"
    actor = compute_role_layout(spec.training_role("actor"), bundles=train_ranks, what=what)
    critic = (compute_role_layout(spec.training_role("critic"), bundles=train_ranks, what=what)
              if spec.critic.enabled else None)
    weight_sync = choose_path(colocate=colocate, use_gpus=use_gpus, engine=spec.rollout.engine)
    if weight_sync == CUDA_IPC and actor.ranks != train_ranks:
        raise PlacementError(
            f"colocated Torch engines on GPUs take the weights from the actor rank on their GPU, and"
            f" actor.parallelism.data leaves {train_ranks - actor.ranks} of the {train_ranks} GPUs without one:"
            " leave actor.parallelism.data unset"
        )
    if use_gpus and spec.rollout.batch_size < engines:
        raise PlacementError(
            f"rollout.batchSize ({spec.rollout.batch_size}) is smaller than the number of rollout engines"
            f" ({engines}), which share a step's prompts: raise it to at least {engines}"
        )
    samples = spec.rollout.batch_size * spec.rollout.samples_per_prompt
    for name, role in (("actor", actor), ("critic", critic)):
        if role is not None and role.data > samples:
            raise PlacementError(
                f"a step's {samples} samples (rollout.batchSize * samplesPerPrompt) are fewer than the {role.data}"
                f" data-parallel ranks of the {name}, each of which trains on its own share: raise rollout.batchSize"
                f" to make at least {role.data} samples, or set {name}.parallelism.data to at most {samples}"
            )
    return Layout(use_gpus, train_ranks, engines, colocate, spec.critic.enabled, actor=actor, critic=critic,
                  weight_sync=weight_sync)


@dataclass
class Roles:
    """The role groups of one run, and the operations that span them."""

    layout: Layout
    rollout: RoleGroup
    actor: RoleGroup
    ref: RoleGroup
    critic: RoleGroup | None
    weight_sync: WeightSyncPath
    placement_groups: list[PlacementGroup] = field(default_factory=list)
    compiled_seconds: float = 0.0
    """What `take_compile_seconds` last read, summed over the roles' processes."""

    @property
    def groups(self) -> list[RoleGroup]:
        return [g for g in (self.rollout, self.actor, self.critic, self.ref) if g is not None]

    def take_compile_seconds(self) -> float:
        """Seconds every role's processes (engines, actor, critic, reference; every rank) spent in
        torch.compile since the last call (the first: since they started), summed over the
        processes. An engine answers beside a generation in flight (ppo.schedule OneStepOverlap)."""
        calls = [h.__ray_call__.remote(process_compile_seconds) for g in (self.actor, self.critic, self.ref)
                 if g is not None for h in g.handles]
        calls += [h.__ray_call__.options(concurrency_group=STATUS_CALLS).remote(process_compile_seconds)
                  for h in self.rollout.handles]
        total = sum(ray.get(calls))
        seconds, self.compiled_seconds = total - self.compiled_seconds, total
        return seconds

    def sync_weights(self, *, version: int) -> None:
        """New actor weights to every engine, by the path chosen from the layout (`weight_sync/`);
        `version`: the actor updates they hold, which the engines stamp on the batches they generate next."""
        self.weight_sync.sync(actor=self.actor, rollout=self.rollout)
        self.rollout.call(RolloutWorker.serve_weights_version, version)

    def values_for_actor(self, values: PerRank) -> PerRank:
        """For each actor rank, the refs (one per critic rank, as the critic's train returned them) of
        the critic data ranks that hold its samples: the first model-parallel rank of each."""
        return route(values, source=self.layout.critic, target=self.layout.actor)

    def log_probs_for_critic(self, old_log_probs: PerRank, ref_log_probs: PerRank) -> PerRank:
        """For each critic rank, the actor's then the reference's log-probs refs of the actor data ranks
        that hold its samples (in `ranks_sharing_samples` order)."""
        actor, critic = self.layout.actor, self.layout.critic
        old = route(old_log_probs, source=actor, target=critic)
        ref = route(ref_log_probs, source=actor, target=critic)
        return PerRank(o + r for o, r in zip(old, ref, strict=True))

    def poll(self) -> tuple[list[Transition], dict[str, str]]:
        """Every rank's transitions since the last poll (in time order), and each role's state (rank 0's),
        the reward model's ("reward") among them when the engines hold one."""
        def beside_generation(group: RoleGroup, call):  # a rollout worker answers while it generates
            return call.options(concurrency_group=STATUS_CALLS) if group is self.rollout else call

        drained = ray.get([beside_generation(g, h.drain_transitions).remote() for g in self.groups for h in g.handles])
        *states, reward = ray.get([beside_generation(g, g.handles[0].state).remote() for g in self.groups]
                                  + [beside_generation(self.rollout, self.rollout.handles[0].reward_state).remote()])
        transitions = sorted((t for ts in drained for t in ts), key=lambda t: t.time)
        residencies = {g.role: s for g, s in zip(self.groups, states)}
        return transitions, residencies if reward is None else {**residencies, "reward": reward}

    def shutdown(self) -> None:
        try:  # the servers the engines launched run in their own process groups: stop them first
            ray.get([handle.close.remote() for handle in self.rollout.handles], timeout=60)
        except Exception:  # a dead worker's servers are beyond reach; kill the rest anyway
            logger.warning("stopping the rollout servers failed; killing the workers anyway", exc_info=True)
        for group in self.groups:
            group.kill()
        for pg in self.placement_groups:
            remove_placement_group(pg)


def process_compile_seconds(_worker) -> float:
    """Inside a role's process (through Ray's `__ray_call__`): its seconds in torch.compile so far."""
    return compile_seconds()


def _wait(pg: PlacementGroup, *, what: str, bundles: list[dict], timeout: float) -> None:
    ready, _ = ray.wait([pg.ready()], timeout=timeout)
    if not ready:
        remove_placement_group(pg)
        raise PlacementError(
            f"the {what} placement group ({len(bundles)} x {bundles[0]}) was not placed within {timeout:.0f}s; "
            f"the cluster has {ray.available_resources()} available: free resources or lower the request"
        )


def build_roles(spec: PPOJobSpec, layout: Layout, *, timeout: float, sglang_server: ServerProgram = SGLANG,
                checkpoint_dir: str | None = None) -> Roles:
    """Place and build every role. `sglang_server` serves rollout.engine SGLang: SGLang's own server,
    or (tests) a stand-in that speaks its protocol, on CPUs if it says so. Every role's
    process compiles into `compile_cache_dir(checkpoint_dir)` (`PPO_COMPILE_CACHE_DIR` in this
    process's environment moves it; neither: the compilers' own defaults)."""
    if spec.rollout.engine == EngineKind.SGLANG and not layout.use_gpus and sglang_server.on_gpu:
        raise PlacementError(
            "rollout.engine SGLang needs GPUs (SGLang is CUDA-only) and this cluster has none: "
            "use rollout.engine Torch on CPUs"
        )
    train_bundles = [dict(layout.bundle) for _ in range(layout.train_ranks)]
    train_pg = placement_group(train_bundles, strategy="PACK")
    _wait(train_pg, what="training", bundles=train_bundles, timeout=timeout)
    pgs = [train_pg]
    offload = spec.offload.train

    cache_env = compile_cache_env(compile_cache_dir(checkpoint_dir))
    runtime_env = {"runtime_env": {"env_vars": cache_env}} if cache_env else {}

    def on(pg: PlacementGroup, index: int, share: dict[str, float]) -> dict:
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
        return {**share, "scheduling_strategy": strategy, **runtime_env}

    if layout.colocate:
        rollout_pg, engine_share = train_pg, layout.share(shared=True)
        engine_bundle = [i % layout.train_ranks for i in range(layout.rollout_engines)]
    else:
        rollout_bundles = [dict(layout.bundle) for _ in range(layout.rollout_engines)]
        rollout_pg = placement_group(rollout_bundles, strategy="PACK")
        _wait(rollout_pg, what="rollout", bundles=rollout_bundles, timeout=timeout)
        pgs.append(rollout_pg)
        engine_share, engine_bundle = layout.share(shared=False), list(range(layout.rollout_engines))

    engines = [  # status calls (Roles.poll) answer beside a generation in flight (ppo.schedule OneStepOverlap)
        ray.remote(concurrency_groups={STATUS_CALLS: 1})(RolloutWorker)
        .options(**on(rollout_pg, engine_bundle[rank], engine_share))
        .remote(spec, rank=rank, device=layout.device, weight_sync=layout.weight_sync,
                sglang_server=sglang_server)
        for rank in range(layout.rollout_engines)
    ]
    share = layout.share(shared=True)

    def group(cls, role: str, ranks: int, **extra) -> RoleGroup:
        common = {"world_size": ranks, "device": layout.device, "offload": offload}
        handles = [
            ray.remote(cls).options(**on(train_pg, rank, share)).remote(spec, rank=rank, **common, **extra)
            for rank in range(ranks)
        ]
        return RoleGroup(role, handles, cls)

    actor = group(ActorWorker, "actor", layout.actor.ranks, weight_sync=layout.weight_sync, rollout_workers=engines)
    rollout = RoleGroup("rollout", engines, RolloutWorker)
    roles = Roles(
        layout=layout,
        rollout=rollout,
        actor=actor,
        ref=group(RefWorker, "ref", layout.actor.ranks),
        critic=group(CriticWorker, "critic", layout.critic.ranks) if layout.critic is not None else None,
        weight_sync=weight_sync_path(layout.weight_sync),
        placement_groups=pgs,
    )
    try:
        ray.get([h.state.remote() for g in roles.groups for h in g.handles])  # constructors done
        for role_group in (roles.actor, roles.critic, roles.ref):
            if role_group is not None:
                role_group.setup_process_group()
    except BaseException:
        roles.shutdown()  # no server or placement group outlives a failed build
        raise
    return roles
