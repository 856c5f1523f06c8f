"""compute_layout: how many ranks and engines, and how the weights reach the engines."""

from __future__ import annotations

import pytest

from ppo_trainer.roles.build import PlacementError, compute_layout
from ppo_trainer.weight_sync import CUDA_IPC
from ppojob_api.spec import parse_spec


def spec(**fields):
    base = {"image": "trainer", "model": {"path": "builtin:tiny"}, "resources": {"nodes": 1, "gpusPerNode": 2}}
    return parse_spec({**base, **fields})


def test_colocated_torch_engines_on_gpus_take_the_weights_by_cuda_ipc():
    layout = compute_layout(spec(), use_gpus=True)
    assert (layout.train_ranks, layout.rollout_engines, layout.colocate) == (2, 2, True)
    assert layout.weight_sync == CUDA_IPC  # engine i shares actor rank i's bundle, hence its GPU


@pytest.mark.parametrize(
    ("fields", "use_gpus"),
    [
        ({}, False),  # CPUs: through Ray's object store
        ({"rollout": {"engine": "SGLang"}}, True),  # the SGLang worker hands tensors to its servers itself
        ({"placement": "Disaggregated", "rollout": {"gpus": 1}}, True),  # the weight-update group
    ],
)
def test_other_layouts_do_not_use_cuda_ipc(fields, use_gpus):
    assert compute_layout(spec(**fields), use_gpus=use_gpus).weight_sync != CUDA_IPC


def test_no_gpus_left_for_training_is_a_clear_error():
    with pytest.raises(PlacementError, match="no GPUs left for training"):
        compute_layout(spec(placement="Disaggregated", rollout={"gpus": 2}), use_gpus=True)


@pytest.mark.parametrize("parallel", [{"tensor": 2}, {"pipeline": 2}])
def test_megatron_model_parallel_ranks_are_placed_one_per_gpu(parallel):
    layout = compute_layout(spec(actor={"backend": "Megatron", "parallelism": parallel},
                                 critic={"parallelism": parallel}), use_gpus=True)
    assert (layout.train_ranks, layout.rollout_engines) == (2, 2)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"actor": {"parallelism": {"tensor": 2}}, "critic": {"parallelism": {"tensor": 2}}},
         "Torch backend runs one device per rank"),
        ({"actor": {"parallelism": {"pipeline": 2}}, "critic": {"parallelism": {"pipeline": 2}}},
         "Torch backend runs one device per rank"),
        ({"rollout": {"tensorParallel": 2}}, "rollout.tensorParallel to 1"),
    ],
)
def test_parallelism_the_trainer_cannot_run_is_refused_naming_the_field(fields, message):
    with pytest.raises(PlacementError, match=message):
        compute_layout(spec(**fields), use_gpus=True)


def test_a_step_with_fewer_prompts_than_engines_is_refused():
    with pytest.raises(PlacementError, match=r"rollout.batchSize \(1\) is smaller than the number of rollout engines \(2\)"):
        compute_layout(spec(placement="Disaggregated", rollout={"batchSize": 1, "gpus": 2}, resources={"gpusPerNode": 3}),
                       use_gpus=True)


@pytest.mark.parametrize(
    ("rollout", "message"),
    [
        ({"batchSize": 2}, (r"a step's 2 samples \(rollout.batchSize \* samplesPerPrompt\) are fewer than the 4"
                            r" data-parallel ranks of the actor, .* or set actor.parallelism.data to at most 2")),
        ({"batchSize": 1, "samplesPerPrompt": 3}, "3 samples .* fewer than the 4 data-parallel ranks of the actor"),
    ],
)
def test_a_step_with_fewer_samples_than_cpu_ranks_is_refused(rollout, message):
    # The spec cannot know --cpu-ranks (parse_spec checks the GPU case); a rank without a sample
    # would have nothing to train on, and the others would wait for it forever.
    with pytest.raises(PlacementError, match=message):
        compute_layout(spec(rollout=rollout, resources={"gpusPerNode": 0}), use_gpus=False, cpu_ranks=4)


def test_a_step_with_one_sample_per_data_parallel_rank_is_placed():
    layout = compute_layout(spec(rollout={"batchSize": 2, "samplesPerPrompt": 2}, resources={"gpusPerNode": 0}),
                            use_gpus=False, cpu_ranks=4)
    assert (layout.actor.data, layout.critic.data) == (4, 4)


@pytest.mark.parametrize(("count", "ranks", "sizes"), [(8, 2, [4, 4]), (7, 3, [3, 2, 2]), (2, 2, [1, 1])])
def test_engines_share_a_steps_prompts_in_contiguous_parts_with_distinct_seeds(count, ranks, sizes):
    from ppo_trainer.roles.group import PerRank, RoleGroup

    group = RoleGroup("rollout", handles=[object()] * ranks, worker_class=object)
    parts = group.split(list(range(count)))
    assert isinstance(parts, PerRank) and [len(p) for p in parts] == sizes
    assert [x for p in parts for x in p] == list(range(count))
    seeds = list(group.seeds(10))
    assert seeds[0] == 10 and len(set(seeds)) == ranks


def test_a_critic_of_its_own_layout_uses_the_first_bundles():
    layout = compute_layout(spec(actor={"backend": "Megatron"}, critic={"parallelism": {"tensor": 2}}), use_gpus=True)
    assert (layout.actor.model_parallel, layout.actor.data, layout.actor.ranks) == (1, 2, 2)
    assert (layout.critic.model_parallel, layout.critic.data, layout.critic.ranks) == (2, 1, 2)
    smaller = compute_layout(spec(critic={"parallelism": {"data": 1}}), use_gpus=True)
    assert (smaller.train_ranks, smaller.actor.ranks, smaller.critic.ranks) == (2, 2, 1)
    on_cpus = compute_layout(spec(actor={"parallelism": {"data": 1}}, critic={"parallelism": {"data": 2}}),
                             use_gpus=False, cpu_ranks=2)
    assert (on_cpus.actor.ranks, on_cpus.critic.ranks) == (1, 2)


@pytest.mark.parametrize(
    ("fields", "cpu_ranks", "message"),
    [
        ({"critic": {"parallelism": {"data": 3}}}, 2,
         (r"critic.parallelism.data \(3\) \* tensor \* pipeline \(1\) = 3 ranks do not fit the 2 training bundles"
          r" \(--cpu-ranks\): lower critic.parallelism.data")),
        ({"actor": {"parallelism": {"data": 2}}}, 1, r"actor.parallelism.data \(2\) .* do not fit the 1 training bundles"),
        ({"critic": {"parallelism": {"tensor": 2}}}, 2, "set critic.parallelism.tensor and pipeline to 1, or use critic.backend Megatron"),
    ],
)
def test_a_layout_that_does_not_fit_the_bundles_names_the_field(fields, cpu_ranks, message):
    with pytest.raises(PlacementError, match=message):
        compute_layout(spec(**fields, resources={"gpusPerNode": 0}), use_gpus=False, cpu_ranks=cpu_ranks)


def test_cuda_ipc_needs_an_actor_rank_on_every_gpu():
    with pytest.raises(PlacementError, match="leave actor.parallelism.data unset"):
        compute_layout(spec(actor={"parallelism": {"data": 1}}), use_gpus=True)
