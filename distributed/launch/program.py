"""What every rank of a job runs (``RankProgram``), and how one rank is started (``RankPlan``).

A program is a profile (every host runs ``python -m distributed.worker
--profile NAME``, the command line written by :mod:`distributed.worker.command`)
or a script (every host runs the same script, as under torchrun). A plan is
one rank's exact command on its host: what a dry run shows and the launcher
starts.
"""

from __future__ import annotations

import hashlib
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..hosts.hostsfile import HostSpec
from ..hosts.sync import local_profiles_path
from ..worker.command import RESUME_ARGS, Overrides, set_args, worker_args

#: Where, under a host's ``project_path``, a profiles file from outside the project is sent
#: (one folder per content, so two runs with different files never meet).
SENT_PROFILES = ".exogym/profiles"


@dataclass(frozen=True)
class RankProgram:
    """What every rank runs: the arguments given to each host's ``python_env``.

    Build one with ``from_profile`` (profile mode) or ``from_script`` (script mode).

    Args:
        args: the arguments after the interpreter, e.g. ``("train.py", "--lr", "0.1")``.
        resume_args: added after ``args`` when the job is restarted after a
            failure (``max_restarts``), so ranks continue from their newest
            checkpoint instead of starting over.
        profile_mode: whether ``args`` run ``distributed.worker``; a host's
            ``device`` is then also passed as ``--set device=...``.
        sent_files: files every other host gets under its ``project_path`` before its
            ranks start (a profiles file from outside the project, and its local
            profiles file): each a relative path there and the bytes.
        config_there: the ``--config`` the ranks of other hosts are given instead: the
            sent profiles file, relative to their ``project_path``.
        sent_from: for each of ``sent_files``, its absolute path here (a host that holds
            them there, on a disk it shares with this machine, reads them in place).
    """

    args: tuple[str, ...]
    resume_args: tuple[str, ...] = ()
    profile_mode: bool = False
    sent_files: tuple[tuple[str, bytes], ...] = ()
    config_there: str | None = None
    sent_from: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_profile(cls, profile: str, *, config: str | None = None,
                     overrides: Overrides = (), resume: bool = False, quiet: bool = False,
                     resume_args: Sequence[str] | None = None, overwrite: bool = False,
                     run_started: str | None = None) -> RankProgram:
        """``python -m distributed.worker --profile NAME [--config FILE] [--set k=v ...]``.

        Args:
            profile: the profile (a ``[distributed:NAME]`` section) to run.
            config: the profiles file, relative to each host's ``project_path``; an
                absolute path (a file outside the project) is read here and sent to every
                other host (:attr:`sent_files`), whose ranks read it there.
            overrides: profile keys to override, as a mapping or ``"key=value"`` strings.
            resume: every rank continues from its newest complete checkpoint,
                from the first start on.
            quiet: ranks print no progress of their own (a dashboard shows their events).
            resume_args: added on a restart (default ``--resume``, unless
                ``resume`` already gives it).
            overwrite: rank 0 replaces another run in ``output_dir`` (``--overwrite``;
                dropped on a restart, which continues this run).
            run_started: the run's start time, recorded by whoever chose its folder.
        """
        if resume_args is None:
            resume_args = () if resume else RESUME_ARGS
        args = worker_args(profile, config=config, overrides=overrides, resume=resume,
                           quiet=quiet, overwrite=overwrite, run_started=run_started)
        sent, there, origins = profiles_to_send(config)
        return cls(tuple(args), tuple(resume_args), profile_mode=True, sent_files=sent,
                   config_there=there, sent_from=origins)

    @classmethod
    def from_script(cls, script: str, args: Sequence[str] = (), *,
                    resume_args: Sequence[str] = ()) -> RankProgram:
        """``python SCRIPT ARGS...``: the same script on every host (as under torchrun).

        Args:
            script: the script, relative to each host's ``project_path`` or absolute.
            args: its arguments.
            resume_args: added on a restart (e.g. ``("--resume",)``).
        """
        if not isinstance(script, str) or not script.strip():
            raise ValueError(f"script must be a path to a Python file, got {script!r}")
        return cls((script, *map(str, args)), tuple(resume_args))

    def argv(self, host: HostSpec, restart: int = 0, local: bool = True) -> list[str]:
        """The arguments for ``host``'s rank on run ``restart`` (0 for the first);
        ``local``: the host is this machine (it reads a profiles file where it lies)."""
        argv = list(self.args)
        if not local and self.config_there is not None and "--config" in argv:
            argv[argv.index("--config") + 1] = self.config_there
        if self.profile_mode and host.device:
            argv += set_args({"device": host.device})
        if restart > 0:
            if "--resume" in self.resume_args:  # a restart continues this run, replaces none
                argv = [arg for arg in argv if arg != "--overwrite"]
            argv += list(self.resume_args)
        return argv


def profiles_to_send(config: str | None) -> tuple[tuple[tuple[str, bytes], ...], str | None,
                                                  tuple[tuple[str, str], ...]]:
    """For a profiles file outside the project (an absolute ``config``): the files to send
    to the other hosts (it, and its local profiles file when there is one), under
    :data:`SENT_PROFILES` in a folder named by their content; the path the ranks there
    read it at; and where each file lies here. Nothing for a file inside the project,
    which every host's copy holds.

    Raises:
        OSError: when the file cannot be read.
    """
    if config is None or not Path(config).is_absolute():
        return (), None, ()
    path = Path(config)
    files = [(path, path.read_bytes())]
    local = local_profiles_path(path)
    if local.is_file():
        files.append((local, local.read_bytes()))
    digest = hashlib.sha256()
    for source, data in files:
        digest.update(source.name.encode() + b"\0" + len(data).to_bytes(8, "big") + data)
    folder = posixpath.join(SENT_PROFILES, digest.hexdigest()[:16])
    sent = tuple((posixpath.join(folder, source.name), data) for source, data in files)
    origins = tuple((posixpath.join(folder, source.name), str(source)) for source, _ in files)
    return sent, posixpath.join(folder, path.name), origins


@dataclass(frozen=True)
class RankPlan:
    """How one rank is started: everything ``dry_run`` shows, nothing secret.

    Args:
        rank: the rank.
        host: its host.
        local: True when it runs on this machine without SSH.
        login: ``local`` or the SSH login ``user@host[:port]``.
        command: the exact shell command run on the host (it starts the rank's supervisor,
            which reads its code from the launcher on stdin).
        by_hand: the command a person runs on this machine to start the rank by hand:
            the rank's own command, through ``ssh`` for a rank on another host.
        env_names: names of the variables set on the command line.
        secret_names: names of the variables sent over stdin.
        interface: the interface forced by the hosts file, or ``None`` (the
            rank picks the one that routes to the master).
        master_addr: where the rank finds the master.
        master_port: the master's port.
        local_rank: its position among its host's ranks (``LOCAL_RANK``).
    """

    rank: int
    host: HostSpec
    local: bool
    login: str
    command: str
    env_names: tuple[str, ...]
    secret_names: tuple[str, ...]
    interface: str | None
    master_addr: str
    master_port: int
    local_rank: int = 0
    by_hand: str = ""

