"""Script mode: the user's own script started on every host, as under ``torchrun``.

The driver (the script run by hand, no rank variables) calls
:func:`run_script_on_hosts`; every host runs the same script with the rank
variables set, where ``NetworkTrainer.fit()`` trains that host's rank. Rank 0
leaves the final model in the run folder; the driver fetches and returns it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from ..hosts.hostsfile import HostsConfig
from ..hosts.sync import PROJECT_ROOT
from ..worker.environment import FINAL_MODEL
from .launcher import Launcher
from .options import split_options
from .program import RankProgram


def script_program(script: str | None = None, args: Sequence[str] | None = None) -> RankProgram:
    """The program that starts ``script`` (default: this process's own) on every host.

    A script inside this checkout is named relative to its root, since each
    host runs it from its own checkout; one outside keeps its absolute path.
    """
    path = Path(script if script is not None else sys.argv[0]).resolve()
    try:
        name = str(path.relative_to(PROJECT_ROOT))
    except ValueError:
        name = str(path)
    return RankProgram.from_script(name, list(sys.argv[1:] if args is None else args))


def run_script_on_hosts(config: HostsConfig, program: RankProgram,
                        on_event: Callable[[dict[str, Any]], None] | None = None,
                        launcher_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Run ``program`` on every host and return the final model state rank 0 saved (with
    ``min_nodes``, the lowest rank present at the end).

    Args:
        config: the hosts.
        program: what every host runs (``script_program``).
        on_event: receives every metric event a rank emits.
        launcher_options: flat fields of ``LaunchOptions`` and ``SSHOptions``
            (``run_dir``, ``max_restarts``, ``known_hosts_path``, ``allow_agent``, ...).

    Raises:
        TypeError: for an unknown launcher option; nothing was started.
        PreflightError: a host failed pre-flight; nothing was started.
        LaunchError: the job failed or was interrupted.
    """
    options, ssh = split_options(launcher_options or {},
                                 owner="NetworkTrainer(launcher_options=...)")
    with Launcher(config, program, options=options, ssh=ssh, on_event=on_event) as job:
        result = job.run()
        result.raise_for_failure()
        local = job.run_dir / FINAL_MODEL
        # Where hosts came and went (min_nodes), the lowest rank present at the end wrote it.
        writer = job.membership[-1]["ranks"][0] if job.membership else 0
        job.fetch(writer, FINAL_MODEL, local)
    return load_file(local)
