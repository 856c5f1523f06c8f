"""The PPO roles as Ray actors: rollout engines, actor, critic and reference, one rank per bundle.

`build.py` places and builds them (`build_roles`, `Roles`), `group.py` calls a role's ranks
together (`RoleGroup`, `PerRank`), and each role's rank is a plain class in its own module.
"""
