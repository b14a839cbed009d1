"""Start Ray (or join a cluster) and the replica actors. The only module that imports ``ray``
at call time besides the replica set.

Workers import kvserve from the same source tree as this process (``PYTHONPATH`` in the job's
runtime environment), so a source checkout and an installed copy never mix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.cluster.pd import CHANNELS
from kvserve.config import EngineConfig

SRC_ROOT = str(Path(__file__).resolve().parents[2])


@dataclass(frozen=True)
class ClusterConfig:
    """``address``: None starts a local Ray with ``num_cpus``; "auto" or "host:port" joins one."""

    replicas: int = 2
    address: str | None = None
    num_cpus: int | None = None
    object_store_bytes: int = 256 * 2**20
    cpus_per_replica: float = 1.0
    max_restarts: int = 0           # Ray restarts a dead replica this many times (-1: always)
    idle_tick_s: float = 0.2
    prefill_replicas: int = 0       # > 0: a prefill/decode split, ``replicas`` is then P + D
    transfer_timeout_s: float = 1.0
    pd_channel: str = "direct"      # how blocks go between replicas: "direct" (TCP) or "object_store"

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be at least 1, got {self.replicas}")
        if self.prefill_replicas and not 0 < self.prefill_replicas < self.replicas:
            raise ValueError("a prefill/decode split needs at least one prefill and one decode replica")
        if self.pd_channel not in CHANNELS:
            raise ValueError(f"--pd-channel must be one of {', '.join(CHANNELS)}, got {self.pd_channel!r}")

    def names(self) -> list[str]:
        """``r0 …`` (no split), or ``p0 …`` prefill then ``d0 …`` decode replicas."""
        if not self.prefill_replicas:
            return [f"r{i}" for i in range(self.replicas)]
        return [f"p{i}" for i in range(self.prefill_replicas)] + \
            [f"d{i}" for i in range(self.replicas - self.prefill_replicas)]


def init_ray(cfg: ClusterConfig) -> None:
    import ray

    if ray.is_initialized():
        return
    env = {"env_vars": {"PYTHONPATH": SRC_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}}
    if cfg.address is None:
        ray.init(num_cpus=cfg.num_cpus, object_store_memory=cfg.object_store_bytes, include_dashboard=False,
                 log_to_driver=False, runtime_env=env, configure_logging=False)
    else:
        ray.init(address=cfg.address, runtime_env=env, log_to_driver=False)


def replica_class(cfg: ClusterConfig) -> Any:
    import ray

    from kvserve.cluster.replica import Replica

    return ray.remote(num_cpus=cfg.cpus_per_replica, max_restarts=cfg.max_restarts,
                      max_concurrency=256)(Replica)


def start_replica(cfg: ClusterConfig, engine: EngineConfig, name: str) -> Any:
    return replica_class(cfg).options(name=f"kvserve-{name}-{os.getpid()}").remote(name, engine, cfg.idle_tick_s)


def launch_replica_set(engine: EngineConfig, cluster: ClusterConfig, router: Any = None) -> Any:
    """Start (or join) Ray, start ``cluster.replicas`` replicas of ``engine`` and wait until each
    has loaded; returns the :class:`~kvserve.cluster.replica_set.ReplicaSet` in front of them."""
    import ray

    from kvserve.cluster.replica_set import ReplicaSet
    from kvserve.model.loader import load_tokenizer
    from kvserve.native.choices import record

    if cluster.prefill_replicas and engine.runner != "inline":
        raise ValueError("a prefill/decode split moves KV between the replicas' runners: use the inline "
                         "runner, not --runner process")
    started_here = not ray.is_initialized()
    init_ray(cluster)
    names = cluster.names()
    handles = {n: start_replica(cluster, engine, n) for n in names}
    infos = dict(zip(names, ray.get([handles[n].info.remote() for n in names]), strict=True))
    for choice in infos[names[0]].kernel_choices:  # the replicas' kernels, for the front end's /metrics
        record(choice)
    return ReplicaSet(handles, infos, load_tokenizer(engine.model), router,
                      on_shutdown=ray.shutdown if started_here else None,
                      prefill=frozenset(n for n in names if n.startswith("p")),
                      transfer_timeout_s=cluster.transfer_timeout_s, pd_channel=cluster.pd_channel)
