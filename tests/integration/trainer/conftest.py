"""Real Ray on CPU for the trainer's integration tests: one light local instance for the session.

Token authentication is configured (a private token) before Ray is imported, as the CLI does.
`tiny_spec(**overrides)` is the spec factory: builtin:tiny on the synthetic task, small batches.
"""

from __future__ import annotations

import tempfile

import pytest

from ppo_trainer.cli import configure_ray_auth

configure_ray_auth(joining=False)

import ray

from ppo_trainer.roles.build import build_roles, compute_layout
from ppo_trainer.train import restore_roles, save_roles
from ppojob_api.spec import PPOJobSpec, parse_spec


def _merge(base: dict, overrides: dict) -> dict:
    for key, value in overrides.items():
        base[key] = _merge(dict(base.get(key) or {}), value) if isinstance(value, dict) else value
    return base


def tiny_spec(**overrides) -> PPOJobSpec:
    """A tiny CPU job; keyword overrides are camelCase spec sections, merged (e.g. ppo={"numRollouts": 3})."""
    raw = {
        "image": "local",
        "seed": 1,
        "model": {"path": "builtin:tiny"},
        "actor": {"learningRate": 1e-2, "microBatchSize": 32},
        "rollout": {"batchSize": 32, "maxNewTokens": 16},
        "ppo": {"numRollouts": 2, "numCriticOnlySteps": 0, "klCoef": 0.001, "epochs": 2},
        "checkpoint": {"interval": 0},
    }
    return parse_spec(_merge(raw, overrides))


@pytest.fixture(scope="session")
def ray_session():
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        _temp_dir=tempfile.mkdtemp(prefix="ppo-test-ray-"),
        object_store_memory=200 * 2**20,
        logging_level="WARNING",
        log_to_driver=False,
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def shared_roles(ray_session, tmp_path_factory):
    """One colocated set of roles (1 rank) for the tests that only vary loop settings, and a
    checkpoint of its initial state."""
    spec = tiny_spec()
    roles = build_roles(spec, compute_layout(spec, use_gpus=False), timeout=120)
    initial = tmp_path_factory.mktemp("initial-roles")
    save_roles(roles, initial)
    yield roles, initial
    roles.shutdown()


@pytest.fixture
def roles(shared_roles):
    """The shared roles, reset to their initial weights, optimizers and RNG, engines included."""
    roles, initial = shared_roles
    restore_roles(roles, initial)
    roles.sync_weights(version=0)
    roles.rollout.call(roles.rollout.worker_class.wake)
    roles.poll()  # forget the transitions of the reset
    return roles
