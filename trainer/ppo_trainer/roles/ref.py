"""The reference policy's rank: frozen initial weights, used only for the log-probs of the KL term.

It takes turns on the device like the other training roles (awake for its forward pass, asleep
otherwise when train-side offload is on). Must not depend on Ray.
"""

from __future__ import annotations

from ppo_trainer.roles.base import RoleWorker


class RefWorker(RoleWorker):
    role = "ref"
