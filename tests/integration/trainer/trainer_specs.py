"""The trainer's integration tests' spec factory: builtin:tiny on the synthetic task, small batches."""

from __future__ import annotations

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
