"""Offload: what a role parks in host memory while it sleeps, how it moves there and back, and its state.

- `residency.py`: each role is awake or asleep and moves only through explicit transitions
  (`Residency`), reported as `Transition`s. Standard library only; this package's `__init__`
  re-exports it and imports nothing heavier.
- `host_mirror.py`: the one host-memory mover (`HostMirror`): a set of device tensors parked in one
  pinned host buffer of exact size (`pinned_empty`) and brought back, the host copy reused only
  while the tensors did not change. The built-in rollout engine parks its weights with it.
- `parking.py`: a training backend's offload (`Parking`): its weights and its optimizer state, each
  through a `HostMirror`; a backend only lists which tensors it parks.
- `side_stream.py`: the optimizer state's copy back on a stream of its own, beside a training pass.
- `kernel_copy.py`: which path a wake's copy takes, the GPU's cores or its copy engines.
"""

from ppo_trainer.offload.residency import CONNECTED, DISCONNECTED, Listener, OffloadError, Residency, Transition

__all__ = ["CONNECTED", "DISCONNECTED", "Listener", "OffloadError", "Residency", "Transition"]
