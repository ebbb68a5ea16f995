"""Multi-host start-up: jax.distributed.initialize() from config.mesh or the environment.

One process per host (TPU VM worker or GPU node), all running the same command. Must run
before anything touches a device. config.mesh.distributed:
  auto  initialise when a coordinator address is given (config or JAX_COORDINATOR_ADDRESS)
        or on a multi-host TPU slice (TPU_WORKER_HOSTNAMES lists several workers);
  on    always (TPU pod slices and SLURM/Open MPI GPU jobs discover their peers);
  off   never (one process).
GPU nodes without a scheduler: coordinator "host:port" of process 0, the process count and
this process's id, from config.mesh.{coordinator_address,num_processes,process_id} or the
env vars JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID. On CPU the
collectives go through gloo (jax_cpu_collectives_implementation).
"""

from __future__ import annotations

import os

import jax

MODES = ("auto", "on", "off")


def _setting(section, name: str, env: str, default):
    value = section.get(name, default) if section is not None else default
    if value in ("", None, 0, -1) and os.environ.get(env):
        value = type(default)(os.environ[env])
    return value


def _tpu_multihost() -> bool:
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return len([h for h in hosts.split(",") if h.strip()]) > 1


def initialize(config) -> bool:
    """Calls jax.distributed.initialize if the config or environment asks for it.
    Returns whether it did. Safe to call twice."""
    section = config.get("mesh", None)
    mode = section.get("distributed", "auto") if section is not None else "auto"
    if mode not in MODES:
        raise ValueError(f"config.mesh.distributed must be one of {MODES}, got {mode!r}")
    address = _setting(section, "coordinator_address", "JAX_COORDINATOR_ADDRESS", "")
    num = int(_setting(section, "num_processes", "JAX_NUM_PROCESSES", 0))
    pid = int(_setting(section, "process_id", "JAX_PROCESS_ID", -1))
    if mode == "off" or (mode == "auto" and not address and not _tpu_multihost()):
        return False
    if jax.distributed.is_initialized():
        return True
    kw = {}
    if address:
        kw["coordinator_address"] = address
    if num > 0:
        kw["num_processes"] = num
    if pid >= 0:
        kw["process_id"] = pid
    platforms = os.environ.get("JAX_PLATFORMS", "") or str(jax.config.jax_platforms or "")
    if platforms.split(",")[0] == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kw)
    print(
        f"[dist] process {jax.process_index()} of {jax.process_count()}: "
        f"{jax.local_device_count()} local / {jax.device_count()} global devices",
        flush=True,
    )
    return True
