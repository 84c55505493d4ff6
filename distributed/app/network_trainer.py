"""NetworkTrainer: the same training as the simulation, one rank per machine.

One class for both sides of script mode, so one script serves as the driver
on your machine and as a rank on every host:

- In a process started with the rank variables (``RANK``, ``WORLD_SIZE``,
  ``MASTER_ADDR``, ``MASTER_PORT`` — set by our SSH launcher, by ``torchrun``,
  by SLURM or any scheduler), ``fit()`` trains that one rank
  (:class:`distributed.worker.rank_trainer.RankTrainer`).
- In the driver (no rank variables), ``fit()`` checks its arguments' names
  and plain values (:class:`exogym.config.fit_args.FitArgs`), starts the same
  script on every host of the hosts file (:mod:`distributed.launch.script`)
  and returns the final model rank 0 saved. It builds no run spec here: the
  device, the memory probe and the data are each host's business, so a
  CPU-only driver can start a CUDA run.
"""

from __future__ import annotations

import copy
import time
from typing import TYPE_CHECKING, Any

import torch

from exogym.base.arg_errors import unknown_args_error
from exogym.base.plural import plural
from exogym.config.fit_args import FitArgs, refuse_simulation_only
from exogym.report.summary import summarize

from ..hosts.hostsfile import load_hosts
from ..launch.options import split_options
from ..launch.script import run_script_on_hosts, script_program
from ..worker.environment import rank_environment
from ..worker.rank_trainer import RankTrainer

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from exogym.config.fit_kwargs import FitKwargs


class NetworkTrainer:
    """Trains across the machines of a hosts file, one rank per machine.

    Args:
        hosts_config: the hosts file (path, dict, or loaded config); only the
            driver needs it — a started rank reads its rank variables instead.
        model, train_dataset, val_dataset: as for :class:`exogym.Trainer`.
        launcher_options: fields of the launcher's ``LaunchOptions`` and ``SSHOptions`` for
            the driver (``max_restarts``, ``sync``, ``run_dir``, ``accept_new_host_keys``,
            ``known_hosts_path``, ...); an unknown one is a ``TypeError`` at once.
        **trainer_kwargs: ``start_port``, ``device``, ``devices``.
    """

    def __init__(self, hosts_config: Any, model: torch.nn.Module, train_dataset: Any,
                 val_dataset: Any = None, launcher_options: dict[str, Any] | None = None,
                 **trainer_kwargs: Any):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.environment = rank_environment()
        self.hosts_config = hosts_config
        self.launcher_options = dict(launcher_options or {})
        self.model = model
        self.history: list[dict[str, Any]] = []
        self.summary: dict[str, Any] = {}
        self._rank: RankTrainer | None = None
        if self.environment is not None:
            self._rank = RankTrainer(self.environment, model, train_dataset, val_dataset,
                                     **trainer_kwargs)
        else:
            unknown = set(trainer_kwargs) - {"start_port", "device", "devices"}
            if unknown:
                raise unknown_args_error("NetworkTrainer()", unknown,
                                         ["start_port", "device", "devices"])
            if hosts_config is None:
                raise ValueError("NetworkTrainer needs a hosts file to launch from this process "
                                 "(or the rank variables RANK, WORLD_SIZE, MASTER_ADDR, "
                                 "MASTER_PORT to run as one rank)")
            self.config = load_hosts(hosts_config)
            split_options(self.launcher_options, owner="NetworkTrainer(launcher_options=...)")

    def fit(self, **kwargs: Unpack[FitKwargs]) -> torch.nn.Module:
        """Same arguments as :meth:`exogym.Trainer.fit`; ``num_nodes`` defaults to the world size.

        On a rank, trains it and returns the average of all ranks' final models.
        In the driver, runs this script on every host and returns rank 0's final model.
        """
        if self._rank is not None:
            final = self._rank.fit(**kwargs)
            self.history, self.summary = self._rank.history, self._rank.summary
            return final
        return self._drive(dict(kwargs))

    def _drive(self, kwargs: dict[str, Any]) -> torch.nn.Module:
        world = self.config.world_size
        refuse_simulation_only(kwargs, "a run across hosts")
        # Names and plain values only: the device, the model and the data are each host's.
        asked = FitArgs.from_call("fit()", (), {"num_nodes": world, **kwargs}).num_nodes
        if asked != world:
            raise ValueError(f"fit(num_nodes={asked}) but the hosts file runs "
                             f"{plural(world, 'rank')} on {plural(len(self.config.hosts), 'host')} "
                             "(one per slot); leave "
                             f"num_nodes out, set it to {world}, or change the hosts' slots")
        self.history = []

        def on_event(event: dict[str, Any]) -> None:
            if event.get("event") == "step":
                self.history.append({k: v for k, v in event.items() if k not in ("event", "host")})

        started = time.perf_counter()
        state = run_script_on_hosts(self.config, script_program(), on_event,
                                    self.launcher_options)
        self.history.sort(key=lambda r: (r["step"], r["rank"]))
        self.summary = summarize(self.history, world, time.perf_counter() - started)
        final = copy.deepcopy(self.model)
        final.load_state_dict(state)
        return final
