"""How new actor weights reach the rollout engines: one path per module, chosen once from the layout.

Each path module holds both ends and the driver's part (`base.py`: `Sender`, `Receiver`,
`WeightSyncPath`):

| path | layout | how |
| --- | --- | --- |
| `cuda_ipc` | Colocate, Torch engines on GPUs | every actor rank shares its device tensors with the engine on its GPU, which copies them device to device |
| `object_store` | Colocate otherwise (CPUs; SGLang engines, whose servers take CUDA IPC from their worker) | actor rank 0 exports CPU tensors; one ObjectRef reaches every engine |
| `broadcast` | Disaggregated | actor rank 0 broadcasts over one process group with the engines, connected while it is awake |

`compute_layout` (`roles/build.py`) names the path with `choose_path`; the actor and every rollout
worker are built with that name and take their ends from `PATHS`, and `Roles.sync_weights` runs
its `sync`. A new path (e.g. through disk) is a module with a `WeightSyncPath`, its entry in
`PATHS` and its case in `choose_path`; the roles do not change.
"""

from __future__ import annotations

from ppo_trainer.weight_sync.base import Receiver, Sender, WeightSyncPath
from ppo_trainer.weight_sync.broadcast import Broadcast
from ppo_trainer.weight_sync.cuda_ipc import CudaIpc
from ppo_trainer.weight_sync.object_store import ObjectStore
from ppojob_api.vocabulary import RolloutEngine

PATHS: dict[str, WeightSyncPath] = {path.name: path for path in (CudaIpc(), ObjectStore(), Broadcast())}

CUDA_IPC, OBJECT_STORE, BROADCAST = CudaIpc.name, ObjectStore.name, Broadcast.name


def choose_path(*, colocate: bool, use_gpus: bool, engine: RolloutEngine) -> str:
    """The path a layout allows (the table above)."""
    if not colocate:
        return BROADCAST
    return CUDA_IPC if use_gpus and engine == RolloutEngine.TORCH else OBJECT_STORE


def weight_sync_path(name: str) -> WeightSyncPath:
    """The registered path `name`."""
    path = PATHS.get(name)
    if path is None:
        raise ValueError(f"no weight-sync path {name!r}; the paths are {sorted(PATHS)}")
    return path


__all__ = ["BROADCAST", "CUDA_IPC", "OBJECT_STORE", "PATHS", "Receiver", "Sender", "WeightSyncPath", "choose_path",
           "weight_sync_path"]
