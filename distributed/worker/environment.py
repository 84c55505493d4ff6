"""The wire facts a rank shares with whoever started it: its rank variables and output names.

A rank is started with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` (and optionally ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``) in its
environment, by our SSH launcher, ``torchrun``, or any scheduler that sets
them; under ``srun`` they are read from SLURM's own variables
(:mod:`distributed.worker.slurm_variables`), explicit ones winning. Rank 0 leaves the run's final model in
``FINAL_MODEL`` for the driver.
"""

from __future__ import annotations

import functools
import os
import select
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..hosts.netif import interface_for
from ..hosts.onhost.bootstrap import STORE_KEY_FD_VARIABLE
from .slurm_variables import slurm_rank_variables

RANK_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: The final model a run leaves in its output folder (safetensors; run config in its metadata).
FINAL_MODEL = "model.safetensors"
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
#: Seconds a rank waits for the run's store key on the pipe its supervisor named.
STORE_KEY_WAIT_S = 30.0


@dataclass(frozen=True)
class RankEnvironment:
    """The rank variables of this process.

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


def rank_environment(env: dict[str, str] | None = None) -> RankEnvironment | None:
    """Read the rank variables (or SLURM's); None when none is set, a clear error when some are missing."""
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
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        port = int(env["MASTER_PORT"])
        local_rank = int(env.get("LOCAL_RANK", "0"))
        local_world = int(env.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError as exc:
        raise ValueError(f"rank variables must be integers: {exc}") from None
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} must be in 0..WORLD_SIZE-1 (WORLD_SIZE={world})")
    if not 0 < port < 65536:
        raise ValueError(f"MASTER_PORT={port} is not a port number")
    min_nodes = _optional(env, MIN_NODES_VARIABLE, int, "an integer")
    if min_nodes is not None:
        if not 1 <= min_nodes <= world:
            raise ValueError(f"{MIN_NODES_VARIABLE}={min_nodes} must be in 1..WORLD_SIZE "
                             f"(WORLD_SIZE={world})")
    lost_after = _optional(env, LOST_AFTER_VARIABLE, float, "a number of seconds")
    key_fd = env.get(STORE_KEY_FD_VARIABLE)
    return RankEnvironment(rank, world, env["MASTER_ADDR"], port, local_rank, local_world,
                           agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                           min_nodes=min_nodes,
                           lost_after=10.0 if lost_after is None else lost_after,
                           store_key=read_store_key(key_fd) if key_fd else None)


def _optional(env: dict[str, str], name: str, parse: Callable[[str], Any], what: str) -> Any:
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
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return os.environ["GLOO_SOCKET_IFNAME"]
    iface = interface_for(master_addr)
    if iface:
        os.environ["GLOO_SOCKET_IFNAME"] = iface
    return iface
