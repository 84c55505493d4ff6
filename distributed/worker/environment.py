"""The rank environment: every variable a rank is started with, written and read here alone.

A rank is started with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` (and optionally ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``) in its
environment, by our SSH launcher, ``torchrun``, or any scheduler that sets
them; under ``srun`` they are read from SLURM's own variables
(:mod:`distributed.worker.slurm_variables`), explicit ones winning. Rank 0 leaves the run's final model in
``FINAL_MODEL`` for the driver.

This module owns the names. The launcher builds a rank's variables with
:meth:`RankEnvironment.variables` and the rank reads them back with
:func:`rank_environment`, so the two ends cannot drift apart: every name below
is spelled once, and ``tests/test_rank_environment.py`` fails when a second
copy appears elsewhere. The one name defined outside is the store key's pipe
(:data:`STORE_KEY_FD_VARIABLE`): the supervisor that opens that pipe runs on
the host from its own source, with the standard library only, so it keeps the
name and this module imports it.
"""

from __future__ import annotations

import functools
import os
import select
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..hosts.hostsfile import min_nodes_problem
from ..hosts.netif import interface_for
from ..hosts.onhost.bootstrap import STORE_KEY_FD_VARIABLE
from .slurm_variables import (
    NODELIST_VARIABLES,
    SLURM_TASK_VARIABLES,
    first_node,
    port_for_job,
    tasks_on_node,
)

#: This rank's number, 0..WORLD_SIZE-1.
RANK_VARIABLE = "RANK"
#: The number of ranks in the run.
WORLD_SIZE_VARIABLE = "WORLD_SIZE"
#: This rank's position among the ranks of its machine.
LOCAL_RANK_VARIABLE = "LOCAL_RANK"
#: The number of ranks on this rank's machine (its host's slots).
LOCAL_WORLD_SIZE_VARIABLE = "LOCAL_WORLD_SIZE"
#: The index of this rank's host in the hosts file (0 is the master).
NODE_RANK_VARIABLE = "NODE_RANK"
#: Where the rendezvous store listens: the master's address and port.
MASTER_ADDR_VARIABLE = "MASTER_ADDR"
MASTER_PORT_VARIABLE = "MASTER_PORT"
#: How many times the launcher has started the whole job again (0 on the first start).
RESTART_VARIABLE = "EXOGYM_RESTART"
#: Where a launched rank's run folder is named (set by the launcher).
RUN_DIR_VARIABLE = "EXOGYM_RUN_DIR"
#: A host's ``device`` from the hosts file, as the launcher passes it to the rank.
DEVICE_VARIABLE = "EXOGYM_DEVICE"
#: Set by the launcher for a run that goes on while this many ranks remain
#: (:mod:`exogym.membership.hosts`); the rendezvous store is then the launcher's.
MIN_NODES_VARIABLE = "EXOGYM_MIN_NODES"
#: With ``min_nodes``: the seconds of silence after which the launcher declares a rank lost.
LOST_AFTER_VARIABLE = "EXOGYM_LOST_AFTER"
#: Set by the launcher when faults are injected: the file (relative to the rank's project
#: folder) through which the rank is slowed down (:mod:`distributed.worker.throttle`).
THROTTLE_VARIABLE = "EXOGYM_THROTTLE_FILE"
#: The network interface gloo and NCCL use, when the host names one.
GLOO_INTERFACE_VARIABLE = "GLOO_SOCKET_IFNAME"
NCCL_INTERFACE_VARIABLE = "NCCL_SOCKET_IFNAME"
#: Set to ``1`` so a rank's lines reach the launcher as they are printed.
UNBUFFERED_VARIABLE = "PYTHONUNBUFFERED"
#: ``True`` when torchrun's agent, not rank 0, hosts the rendezvous store.
AGENT_STORE_VARIABLE = "TORCHELASTIC_USE_AGENT_STORE"

#: The variables that make a process a rank; all of them, or none, must be set.
RANK_VARIABLES = (RANK_VARIABLE, WORLD_SIZE_VARIABLE, MASTER_ADDR_VARIABLE, MASTER_PORT_VARIABLE)
#: The variables the launcher sets for every rank; a caller may not set them.
LAUNCHER_VARIABLES = (RANK_VARIABLE, WORLD_SIZE_VARIABLE, LOCAL_RANK_VARIABLE,
                      LOCAL_WORLD_SIZE_VARIABLE, NODE_RANK_VARIABLE, MASTER_ADDR_VARIABLE,
                      MASTER_PORT_VARIABLE, RESTART_VARIABLE, RUN_DIR_VARIABLE,
                      UNBUFFERED_VARIABLE)
#: Every variable of the rank environment, each spelled once in this module.
ALL_VARIABLES = (*LAUNCHER_VARIABLES, DEVICE_VARIABLE, MIN_NODES_VARIABLE, LOST_AFTER_VARIABLE,
                 THROTTLE_VARIABLE, GLOO_INTERFACE_VARIABLE, NCCL_INTERFACE_VARIABLE,
                 AGENT_STORE_VARIABLE, STORE_KEY_FD_VARIABLE)

#: The final model a run leaves in its output folder (safetensors; run config in its metadata).
FINAL_MODEL = "model.safetensors"
#: Seconds a rank waits for the run's store key on the pipe its supervisor named.
STORE_KEY_WAIT_S = 30.0


@dataclass(frozen=True)
class RankEnvironment:
    """The rank variables of one rank: what the launcher writes and what the rank reads.

    Args:
        rank, world_size: this rank and the number of ranks.
        master_addr, master_port: where rank 0's rendezvous store listens.
        local_rank, local_world_size: position among the ranks on this machine.
        agent_store: the store is hosted by torchrun's agent, not by rank 0.
        min_nodes: ranks come and go while at least this many remain; the store is
            the launcher's (None: every rank is needed, rank 0 hosts the store).
        lost_after: with ``min_nodes``, the launcher's deadline for a silent rank.
        store_key: the run's store key, read from the pipe ``EXOGYM_STORE_KEY_FD``
            names (a rank the launcher started); None under torchrun or SLURM alone.
        node_rank: the index of this rank's host in the hosts file (None: not
            started by our launcher).
        restart: how many times the launcher has started the job again.
        run_dir: the run's log folder as the rank names it (None: not launched).
        device: the host's ``device`` from the hosts file (None: the rank picks).
        interface: the network interface gloo and NCCL use (None: the rank picks
            the one that routes to the master, :func:`choose_interface`).
        throttle_file: with injected faults, the file through which the rank is slowed.
    """

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    local_rank: int = 0
    local_world_size: int = 1
    agent_store: bool = False
    min_nodes: int | None = None
    lost_after: float = 10.0
    store_key: bytes | None = field(default=None, repr=False, compare=False)
    node_rank: int | None = None
    restart: int = 0
    run_dir: str | None = None
    device: str | None = None
    interface: str | None = None
    throttle_file: str | None = None

    def variables(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The variables that start this rank, in the order its command line sets them.

        What :func:`rank_environment` reads back as this same environment. The store
        key is not among them (it travels through a pipe the supervisor opens), nor is
        ``agent_store`` (torchrun's agent sets it).

        Args:
            extra: the caller's own variables, added after the rank variables and
                before the host's settings (interface, device), which win over them.
        """
        env = {
            RANK_VARIABLE: str(self.rank), WORLD_SIZE_VARIABLE: str(self.world_size),
            LOCAL_RANK_VARIABLE: str(self.local_rank),
            LOCAL_WORLD_SIZE_VARIABLE: str(self.local_world_size),
        }
        if self.node_rank is not None:
            env[NODE_RANK_VARIABLE] = str(self.node_rank)
        env[MASTER_ADDR_VARIABLE] = self.master_addr
        env[MASTER_PORT_VARIABLE] = str(self.master_port)
        env[RESTART_VARIABLE] = str(self.restart)
        if self.run_dir is not None:
            env[RUN_DIR_VARIABLE] = self.run_dir
        env[UNBUFFERED_VARIABLE] = "1"
        env.update(extra or {})
        if self.interface:
            env[GLOO_INTERFACE_VARIABLE] = self.interface
            env[NCCL_INTERFACE_VARIABLE] = self.interface
        if self.device:
            env[DEVICE_VARIABLE] = self.device
        if self.throttle_file is not None:
            env[THROTTLE_VARIABLE] = self.throttle_file
        if self.min_nodes is not None:
            env[MIN_NODES_VARIABLE] = str(self.min_nodes)
            env[LOST_AFTER_VARIABLE] = f"{self.lost_after:g}"
        return env


@functools.cache
def read_store_key(fd_text: str) -> bytes:
    """The run's store key from the pipe descriptor ``fd_text`` (read once, then closed).

    Raises:
        ValueError: naming ``EXOGYM_STORE_KEY_FD``, when the descriptor is not a number,
            nothing arrives within :data:`STORE_KEY_WAIT_S` or what arrives is not a key.
    """
    try:
        fd = int(fd_text)
    except ValueError:
        raise ValueError(f"{STORE_KEY_FD_VARIABLE}={fd_text!r} must be a file descriptor") from None
    data = b""
    try:
        while not data.endswith(b"\n") and len(data) < 1024:
            ready, _, _ = select.select([fd], [], [], STORE_KEY_WAIT_S)
            if not ready:
                raise ValueError(f"no store key arrived on {STORE_KEY_FD_VARIABLE}={fd} within "
                                 f"{STORE_KEY_WAIT_S:g} s")
            chunk = os.read(fd, 1024)
            if not chunk:
                break
            data += chunk
    except OSError as exc:
        raise ValueError(f"cannot read the store key from {STORE_KEY_FD_VARIABLE}={fd}: "
                         f"{exc.strerror or exc}") from None
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    try:
        key = bytes.fromhex(data.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        key = b""
    if len(key) < 16:
        raise ValueError(f"what arrived on {STORE_KEY_FD_VARIABLE}={fd} is not a store key")
    return key


def rank_environment(env: Mapping[str, str] | None = None) -> RankEnvironment | None:
    """Read the rank variables (or SLURM's); None when none is set, a clear error when some are missing.

    Args:
        env: the variables to read; default this process's environment.
    """
    env = dict(os.environ if env is None else env)
    env.update(slurm_rank_variables(env))
    present = [k for k in RANK_VARIABLES if env.get(k)]
    if not present:
        return None
    missing = [k for k in RANK_VARIABLES if not env.get(k)]
    if missing:
        raise ValueError(f"rank variables incomplete: {', '.join(present)} set but "
                         f"{', '.join(missing)} missing; set all of {', '.join(RANK_VARIABLES)}")
    try:
        rank, world = int(env[RANK_VARIABLE]), int(env[WORLD_SIZE_VARIABLE])
        port = int(env[MASTER_PORT_VARIABLE])
        local_rank = int(env.get(LOCAL_RANK_VARIABLE, "0"))
        local_world = int(env.get(LOCAL_WORLD_SIZE_VARIABLE, "1"))
    except ValueError as exc:
        raise ValueError(f"rank variables must be integers: {exc}") from None
    if not 0 <= rank < world:
        raise ValueError(f"{RANK_VARIABLE}={rank} must be in 0..{WORLD_SIZE_VARIABLE}-1 "
                         f"({WORLD_SIZE_VARIABLE}={world})")
    if not 0 < port < 65536:
        raise ValueError(f"{MASTER_PORT_VARIABLE}={port} is not a port number")
    min_nodes = _optional(env, MIN_NODES_VARIABLE, int, "an integer")
    problem = min_nodes_problem(min_nodes, world)
    if problem is not None:
        raise ValueError(f"{MIN_NODES_VARIABLE}={min_nodes} must be in 1..{WORLD_SIZE_VARIABLE} "
                         f"({WORLD_SIZE_VARIABLE}={world}): {problem}")
    lost_after = _optional(env, LOST_AFTER_VARIABLE, float, "a number of seconds")
    restart = _optional(env, RESTART_VARIABLE, int, "an integer")
    key_fd = env.get(STORE_KEY_FD_VARIABLE)
    return RankEnvironment(rank, world, env[MASTER_ADDR_VARIABLE], port, local_rank, local_world,
                           agent_store=env.get(AGENT_STORE_VARIABLE) == "True",
                           min_nodes=min_nodes,
                           lost_after=10.0 if lost_after is None else lost_after,
                           store_key=read_store_key(key_fd) if key_fd else None,
                           node_rank=_optional(env, NODE_RANK_VARIABLE, int, "an integer"),
                           restart=0 if restart is None else restart,
                           run_dir=env.get(RUN_DIR_VARIABLE) or None,
                           device=env.get(DEVICE_VARIABLE) or None,
                           interface=env.get(GLOO_INTERFACE_VARIABLE) or None,
                           throttle_file=env.get(THROTTLE_VARIABLE) or None)


def _optional(env: Mapping[str, str], name: str, parse: Callable[[str], Any], what: str) -> Any:
    """``env[name]`` parsed, None when it is not set; a clear error when it does not parse."""
    value = env.get(name)
    if not value:
        return None
    try:
        return parse(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} must be {what}") from None


def choose_interface(master_addr: str) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` to the interface routing to the master, unless already set."""
    if os.environ.get(GLOO_INTERFACE_VARIABLE):
        return os.environ[GLOO_INTERFACE_VARIABLE]
    iface = interface_for(master_addr)
    if iface:
        os.environ[GLOO_INTERFACE_VARIABLE] = iface
    return iface


def slurm_rank_variables(env: Mapping[str, str]) -> dict[str, str]:
    """The rank variables a SLURM task implies, for those not already set; {} outside SLURM.

    Explicit ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
    ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` win (torchrun under SLURM sets them).

    Raises:
        ValueError: for a malformed node list, job id or tasks-per-node value,
            or a SLURM task with neither a node list nor ``MASTER_ADDR``.
    """
    if not all(env.get(k) for k in SLURM_TASK_VARIABLES):
        return {}
    implied: dict[str, str] = {RANK_VARIABLE: env["SLURM_PROCID"],
                               WORLD_SIZE_VARIABLE: env["SLURM_NTASKS"]}
    if env.get("SLURM_LOCALID"):
        implied[LOCAL_RANK_VARIABLE] = env["SLURM_LOCALID"]
    if env.get("SLURM_TASKS_PER_NODE") and env.get("SLURM_NODEID", "").isdigit():
        implied[LOCAL_WORLD_SIZE_VARIABLE] = str(tasks_on_node(env["SLURM_TASKS_PER_NODE"],
                                                              int(env["SLURM_NODEID"])))
    if not env.get(MASTER_ADDR_VARIABLE):
        nodelist = next((env[k] for k in NODELIST_VARIABLES if env.get(k)), None)
        if nodelist is None:
            raise ValueError("SLURM_PROCID and SLURM_NTASKS are set but no node list is "
                             f"({', '.join(NODELIST_VARIABLES)}); run under srun, or set "
                             "MASTER_ADDR to the first node's address")
        implied[MASTER_ADDR_VARIABLE] = first_node(nodelist)
    if not env.get(MASTER_PORT_VARIABLE) and env.get("SLURM_JOB_ID"):
        implied[MASTER_PORT_VARIABLE] = str(port_for_job(env["SLURM_JOB_ID"]))
    return {key: value for key, value in implied.items() if not env.get(key)}
