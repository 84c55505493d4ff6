"""NetworkTrainer: the same training as the simulation, one rank per machine.

In a process started with the rank variables (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` — set by our SSH launcher, by ``torchrun``, by
SLURM or any scheduler), ``fit()`` trains that one rank through
:func:`exogym.rank.run_rank`, the per-rank code path the simulation runs:
``init_process_group`` over ``tcp://MASTER_ADDR:MASTER_PORT`` (gloo on CPU and
MPS, nccl on CUDA), ``GLOO_SOCKET_IFNAME`` set to the interface that routes to
the master, rank 0's initial weights broadcast before the first step. Every
rank returns the average of all ranks' final models.

In the driver process (no rank variables), ``fit()`` hands the run to the SSH
launcher in script mode: the same script is started on every host of the hosts
file, and the driver returns the final model that rank 0 saved.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from exogym.io import atomic_torch_save
from exogym.metrics import encode_event
from exogym.rank import Rendezvous, run_rank
from exogym.spec import RunSpec
from exogym.trainer import Trainer

RANK_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
FINAL_MODEL = "final_model.pt"


@dataclass(frozen=True)
class RankEnvironment:
    """The rank variables of this process.

    Args:
        rank, world_size: this rank and the number of ranks.
        master_addr, master_port: where rank 0's rendezvous store listens.
        local_rank, local_world_size: position among the ranks on this machine.
        agent_store: the store is hosted by torchrun's agent, not by rank 0.
    """

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    local_rank: int = 0
    local_world_size: int = 1
    agent_store: bool = False


def rank_environment(env: dict[str, str] | None = None) -> RankEnvironment | None:
    """Read the rank variables; None when none is set, a clear error when some are missing."""
    env = dict(os.environ if env is None else env)
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
    return RankEnvironment(rank, world, env["MASTER_ADDR"], port, local_rank, local_world,
                           agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def choose_interface(master_addr: str) -> str | None:
    """Set ``GLOO_SOCKET_IFNAME`` to the interface routing to the master, unless already set."""
    from distributed.netif import interface_for

    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return os.environ["GLOO_SOCKET_IFNAME"]
    iface = interface_for(master_addr)
    if iface:
        os.environ["GLOO_SOCKET_IFNAME"] = iface
    return iface


class NetworkTrainer(Trainer):
    """Trains across the machines of a hosts file, one rank per machine.

    Args:
        hosts_config: the hosts file (path, dict, or loaded config); only the
            driver needs it — a started rank reads its rank variables instead.
        model, train_dataset, val_dataset: as for :class:`exogym.Trainer`.
        launcher_options: keyword arguments for :class:`distributed.launcher.Launcher`
            in the driver (``accept_new_host_keys``, ``max_restarts``, ``sync``, ...).
        **trainer_kwargs: ``start_port``, ``device``, ``devices``.
    """

    def __init__(self, hosts_config: Any, model: torch.nn.Module, train_dataset: Any,
                 val_dataset: Any = None, launcher_options: dict[str, Any] | None = None,
                 **trainer_kwargs: Any):
        self.environment = rank_environment()
        if self.environment is not None and trainer_kwargs.get("device") is None:
            # A host's "device" in the hosts file reaches its rank as EXOGYM_DEVICE.
            trainer_kwargs["device"] = os.environ.get("EXOGYM_DEVICE") or None
        super().__init__(model, train_dataset, val_dataset, **trainer_kwargs)
        self.hosts_config = hosts_config
        self.launcher_options = dict(launcher_options or {})

    def fit(self, *args: Any, **kwargs: Any) -> torch.nn.Module:
        """Same arguments as :meth:`exogym.Trainer.fit`; ``num_nodes`` defaults to the world size."""
        env = self.environment
        if env is not None:
            asked = kwargs.setdefault("num_nodes", env.world_size)
            if asked != env.world_size:
                raise ValueError(f"fit(num_nodes={asked}) but WORLD_SIZE={env.world_size}: a "
                                 "network run has one rank per started process")
            if env.rank != 0:
                kwargs["logger"] = None  # rank 0 writes the run's logs
        elif self.hosts_config is not None:
            from distributed.hosts import load_hosts

            kwargs.setdefault("num_nodes", load_hosts(self.hosts_config).world_size)
        return super().fit(*args, **kwargs)

    def _prepare_spec(self, spec: RunSpec) -> None:
        env = self.environment
        spec.ranks_per_machine = env.local_world_size if env else 1
        spec.broadcast_init = True
        if spec.device_type == "cuda":
            spec.backend = "nccl"  # one GPU per rank on its own machine

    def _execute(self, spec: RunSpec,
                 on_event: Callable[[dict[str, Any]], None]) -> list[dict[str, torch.Tensor]]:
        env = self.environment
        if env is None:
            return self._launch(spec, on_event)
        iface = choose_interface(env.master_addr)
        print(f"rank {env.rank}/{env.world_size}: master {env.master_addr}:{env.master_port}, "
              f"interface {iface or 'chosen by gloo'}", file=sys.stderr, flush=True)
        if spec.device_type == "cuda" and spec.devices is not None:
            # Ranks on one machine take its GPUs by local rank, not by global rank.
            spec.devices = [spec.devices[env.local_rank % len(spec.devices)]]

        def emit(event: dict[str, Any]) -> None:
            print(encode_event(event), flush=True)
            on_event(event)

        rendezvous = Rendezvous(env.master_addr, env.master_port,
                                store_on_rank0=not env.agent_store, watch_peers=True)
        state = run_rank(spec, env.rank, rendezvous, emit, average_final=True)
        run_dir = os.environ.get("EXOGYM_RUN_DIR")
        if env.rank == 0 and run_dir:
            atomic_torch_save(state, Path(run_dir) / FINAL_MODEL)
        return [state]

    def _launch(self, spec: RunSpec,
                on_event: Callable[[dict[str, Any]], None]) -> list[dict[str, torch.Tensor]]:
        """Driver: start this script on every host and return rank 0's final model."""
        if self.hosts_config is None:
            raise ValueError("NetworkTrainer needs a hosts file to launch from this process "
                             "(or the rank variables RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT "
                             "to run as one rank)")
        from distributed.hosts import load_hosts
        from distributed.launcher import Launcher, RankProgram

        config = load_hosts(self.hosts_config)
        if spec.num_nodes not in (1, config.world_size):
            raise ValueError(f"fit(num_nodes={spec.num_nodes}) but the hosts file lists "
                             f"{config.world_size} hosts; one rank runs per host")
        project_root = Path(__file__).resolve().parents[1]
        script = Path(sys.argv[0]).resolve()
        try:
            script_arg = str(script.relative_to(project_root))
        except ValueError:
            script_arg = str(script)  # outside the checkout: the same path on every host
        program = RankProgram.from_script(script_arg, sys.argv[1:])
        options = {"on_event": on_event, **self.launcher_options}
        with Launcher(config, program, **options) as job:
            result = job.run()
            result.raise_for_failure()
            local = job.run_dir / FINAL_MODEL
            job.fetch(0, FINAL_MODEL, local)
        return [torch.load(local, map_location="cpu", weights_only=True)]
