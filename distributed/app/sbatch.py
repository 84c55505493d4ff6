"""An sbatch script that runs a profile on a SLURM cluster, one rank per node or per GPU.

``python cli_typer.py slurm PROFILE --nodes N`` writes it; ``sbatch`` submits
it. Every task runs ``srun PYTHON -m distributed.worker --profile NAME``,
which reads its rank from SLURM's variables (:mod:`distributed.worker.slurm_variables`):
no torchrun, no ``scontrol``. The script fixes ``MASTER_PORT`` (from the job
id unless you chose one), so every task agrees on the port.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from exogym.base.install_mode import command
from exogym.base.io import atomic_write_text
from exogym.base.plural import plural

from ..hosts.sync import WORK_ROOT
from ..profiles.profile import load_profile, parse_overrides
from ..worker.command import worker_args
from ..worker.slurm_variables import PORT_BASE, PORT_SPAN
from .run import config_for_hosts

# SLURM's --time forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
_TIME = re.compile(r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}")
_NAME = re.compile(r"[A-Za-z0-9_.,+-]+")


@dataclass
class SlurmJob:
    """What the sbatch script asks SLURM for and runs.

    Args:
        profile: the profile every rank runs.
        nodes: how many nodes to allocate.
        gpus_per_node: GPUs per node; one rank per GPU. None: one rank per node.
        time: wall-clock limit in SLURM's form (``30``, ``1:00:00``, ``1-12``), or None.
        partition: the partition to submit to, or None for the cluster's default.
        project_path: the project's checkout as the nodes see it (default: this one).
        python: the interpreter on the nodes (default: this one).
        config: the profiles file (default: the project's ``config.ini``).
        overrides: ``key=value`` profile overrides passed to every rank.
        master_port: a fixed port; None derives it from the job id.
        job_name: the job's name in ``squeue`` (default ``exogym-PROFILE``).
    """

    profile: str
    nodes: int
    gpus_per_node: int | None = None
    time: str | None = None
    partition: str | None = None
    project_path: str = str(WORK_ROOT)
    python: str = sys.executable
    config: str | None = None
    overrides: list[str] = field(default_factory=list)
    master_port: int | None = None
    job_name: str | None = None

    def check(self) -> None:
        """Raise ValueError naming each bad value, and the profile's own errors, before writing."""
        if not isinstance(self.nodes, int) or self.nodes < 1:
            raise ValueError(f"--nodes must be an integer >= 1, got {self.nodes!r}")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be >= 1, got {self.gpus_per_node}; leave "
                             "it out for one rank per node on CPUs")
        if self.time is not None and not _TIME.fullmatch(self.time):
            raise ValueError(f"--time {self.time!r} is not in SLURM's form; use minutes (30), "
                             "H:MM:SS (1:30:00) or D-HH (1-12)")
        for option, value in (("--partition", self.partition), ("--job-name", self.job_name)):
            if value is not None and not _NAME.fullmatch(value):
                raise ValueError(f"{option} {value!r} may hold only letters, digits and "
                                 "_.,+-")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"--master-port {self.master_port} is not a port number")
        profile = load_profile(self.profile, self.config, parse_overrides(self.overrides))
        _ = profile.resolved  # an unknown key or task fails here, not on the cluster

    @property
    def ranks(self) -> int:
        """The world size: one rank per node, or per GPU."""
        return self.nodes * (self.gpus_per_node or 1)

    def srun_line(self) -> str:
        """The line that starts every rank."""
        args = worker_args(self.profile, config=config_for_hosts(self.config),
                           overrides=self.overrides)
        return shlex.join(["srun", self.python, *args])

    def script(self) -> str:
        """The sbatch script's text."""
        tasks = self.gpus_per_node or 1
        directives = [f"--job-name={self.job_name or 'exogym-' + self.profile}",
                      f"--nodes={self.nodes}", f"--ntasks-per-node={tasks}"]
        if self.gpus_per_node:
            directives.append(f"--gpus-per-node={self.gpus_per_node}")
        if self.time:
            directives.append(f"--time={self.time}")
        if self.partition:
            directives.append(f"--partition={self.partition}")
        port = (str(self.master_port) if self.master_port is not None
                else f"$(( {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN} ))")
        lines = ["#!/bin/bash",
                 f"# Profile {self.profile} on {plural(self.ranks, 'rank')}; written by "
                 f"`{command('slurm')}`.",
                 *(f"#SBATCH {d}" for d in directives),
                 "set -euo pipefail",
                 f"cd {shlex.quote(self.project_path)}",
                 "# Every rank reads its rank, world size and master from SLURM's variables.",
                 f"export MASTER_PORT=${{MASTER_PORT:-{port}}}",
                 self.srun_line(), ""]
        return "\n".join(lines)


def write_sbatch_script(job: SlurmJob, out: str | Path | None = None) -> Path:
    """Check ``job`` and write its sbatch script (atomically) to ``out``; returns the path.

    ``out`` defaults to ``PROFILE.sbatch`` in the current folder.
    """
    job.check()
    path = Path(out) if out is not None else Path(f"{job.profile}.sbatch")
    return atomic_write_text(path, job.script())


def submit_hint(path: Path) -> str:
    """How to submit the written script and follow it."""
    return (f"sbatch script written to {path}\nsubmit it with:  sbatch {shlex.quote(str(path))}"
            "\nfollow it with:  squeue --me   (output in slurm-JOBID.out)")
