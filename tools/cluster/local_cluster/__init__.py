"""A real local Kubernetes cluster (etcd, kube-apiserver, controller-manager, scheduler, KWOK fake GPU
nodes, KubeRay, a coscheduling gang scheduler) built from Go modules and run on 127.0.0.1."""

from .cluster import GANG_SCHEDULER_NAME, PORTS, ClusterError, LocalCluster
from .pins import default_state_dir, load_pins

__all__ = ["GANG_SCHEDULER_NAME", "PORTS", "ClusterError", "LocalCluster", "default_state_dir", "load_pins"]
