"""Real Ray on CPU for the trainer's integration tests: one light local instance for the session.

Token authentication is configured (a private token) before Ray is imported, as the CLI does.
The spec factory, `tiny_spec`, is in trainer_specs.py.
"""

from __future__ import annotations

import tempfile

import pytest

from ppo_trainer.cli import configure_ray_auth

configure_ray_auth(joining=False)

import ray
from trainer_specs import tiny_spec

from ppo_trainer.roles.build import build_roles, compute_layout
from ppo_trainer.train import restore_roles, save_roles


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
