"""Worker entry: ``python -m distributed.worker --profile NAME``.

Runs one rank of a profile when the rank variables are set (by our launcher,
torchrun, SLURM, ...), or the whole profile as a local simulation when they
are not. Rank 0 (or the simulation) writes the final model and a summary
into the run's folder; a simulation writes its trace there too (``trace.jsonl``,
:mod:`exogym.report.trace`).

Run alone (no rank variables), the worker chooses that folder as the CLI does
(:mod:`distributed.profiles.run_dir`): the profile's ``output_dir`` (default
``runs/NAME``) when it holds no run, else the next free ``runs/NAME-2``, ...;
``--overwrite`` replaces the run in ``output_dir``; ``--resume`` continues the
newest run there with the same settings and stops (exit 2) when there is none.
A rank started with rank variables uses ``output_dir`` as it is given.

    python -m distributed.worker --profile digits-diloco
    python -m distributed.worker --profile digits-diloco --set num_nodes=2 --set H=20
    torchrun --nnodes 1 --nproc-per-node 2 -m distributed.worker --profile digits-diloco
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import signal
import sys
import warnings
from typing import TYPE_CHECKING, Any

from exogym.base.io import atomic_save_safetensors, atomic_write_json
from exogym.comm.store import describe_ignored
from exogym.run.run_rank import LostRankError
from exogym.run.spec import DataWarning, check_data
from exogym.run.trainer import LocalTrainer, RankFailedError

from ..profiles.profile import (
    Profile,
    ProfileError,
    ProfileWarning,
    load_profile,
    parse_overrides,
)
from ..profiles.run_dir import (
    RunIdentity,
    place_run,
    rank_identity,
    record_resume,
    release_placement,
    replace_rank_folder,
    take_placement,
)
from .environment import FINAL_MODEL, RankEnvironment, rank_environment
from .rank_trainer import RankTrainer

if TYPE_CHECKING:
    from exogym.report.summary import ProgressSink

    from ..profiles.run_dir import RunPlacement


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m distributed.worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", required=True, help="profile name in the config file")
    parser.add_argument("--config", default=None, help="config file (default: the project's config.ini)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a profile key (repeatable)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the newest run of this profile with the same settings "
                             "from its newest complete checkpoint (exit 2 when there is none)")
    parser.add_argument("--fresh-if-none", action="store_true",
                        help="with --resume: start a new run when there is nothing to resume")
    parser.add_argument("--overwrite", action="store_true",
                        help="a new run in output_dir itself, replacing the run there (by "
                             "default a new run gets a folder of its own)")
    parser.add_argument("--run-started", metavar="TIME", default=None,
                        help="the run's start time as its launcher recorded it (all ranks of "
                             "a run share it)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or summary table")
    return parser


def run_profile(name: str | Profile, config: str | None = None,
                overrides: dict[str, Any] | None = None, resume: bool = False,
                progress: bool | ProgressSink = True, local: bool | None = None, *,
                placement: RunPlacement | None = None, overwrite: bool = False,
                fresh_if_none: bool = False, started: str | None = None,
                check_only: bool = False):
    """Train a profile: this rank (rank variables set) or a local simulation; returns the trainer.

    Args:
        name: the profile's name in ``config``, or an already resolved ``Profile``.
        config: the config file (default: the project's ``config.ini``).
        overrides: keys to replace (``--set``).
        resume: continue the newest run with these settings from its newest complete
            checkpoint (:func:`distributed.profiles.run_dir.place_run`).
        progress: show the progress bar (True/False), or an object that shows the
            run's events its own way (``exogym.report.summary.ProgressSink``, e.g. a dashboard).
        local: force a local simulation even when rank variables are set.
        placement: the run's folder and identity, already chosen (the app's); None: a
            simulation chooses it here, a rank uses ``output_dir`` as given.
        overwrite: a new run in ``output_dir`` itself, replacing the run there.
        fresh_if_none: with ``resume``, start a new run when there is nothing to resume.
        started: the run's start time as its launcher recorded it.
        check_only: build the task and the strategy and make every check a run makes,
            with its warnings, then return: no folder is claimed, nothing is written or
            started (a dry run).

    Raises:
        RunFolderError: the folder cannot take this run (``NothingToResumeError``: nothing
            to resume); raised before the task is built.
    """
    if isinstance(name, Profile):
        profile = name.with_overrides(overrides) if overrides else name
    else:
        profile = load_profile(name, config, overrides)
    env = None if local else rank_environment()
    if check_only:
        identity = RunIdentity.of(profile, profile.num_nodes, started)
        return _train(profile, None, identity, resume, None, False, overwrite, check_only=True)
    if env is not None:
        identity = rank_identity(profile, env.rank, env.world_size, resume=resume,
                                 overwrite=overwrite, started=started)
    else:
        if placement is None:
            placement = place_run(profile, ranks=profile.num_nodes,
                                  resume=resume, overwrite=overwrite,
                                  fresh_if_none=fresh_if_none, started=started)
            if placement.resume:
                record_resume(placement)
            if progress is True:
                print(placement.note, flush=True)
        profile = placement.profile(profile)
        identity, resume = placement.identity, placement.resume
    try:
        return _train(profile, env, identity, resume, placement, progress, overwrite)
    except BaseException:
        # Refused before it wrote anything (a value a check found, no GPU, Ctrl-C while
        # the task loads): the new folder goes, and BASE.latest names what it named before.
        release_placement(placement)
        raise


def _train(profile: Profile, env: RankEnvironment | None, identity: RunIdentity,
           resume: bool, placement: RunPlacement | None, progress: bool | ProgressSink,
           overwrite: bool, check_only: bool = False) -> Any:
    """The rest of :func:`run_profile`, once the run's folder and identity are known."""
    resolved = profile.resolved
    output_dir = resolved.output_dir
    model, train_dataset, val_dataset = resolved.task_fn(**resolved.task_kwargs)
    ranks = env.world_size if env is not None else profile.num_nodes
    if env is not None and env.rank == 0:  # a simulation's fit says it itself
        run = resolved.run_kwargs
        check_data(train_dataset, ranks, run.get("batch_size"),
                   bool(run.get("shared_samples")), run.get("partition") or "iid")
    strategy = resolved.strategy_cls(**resolved.strategy_kwargs)
    fit_kwargs = dict(
        resolved.run_kwargs, strategy=strategy, run_name=profile.name,
        save_dir=str(output_dir / "checkpoints"), log_dir=str(output_dir / "logs"),
        resume_from="auto" if resume else None, progress=progress,
        run_identity=identity.as_dict(),
    )
    if check_only:
        trainer = LocalTrainer(model, train_dataset, val_dataset)
        trainer.check(**fit_kwargs)
        return trainer
    if env is None:
        fit_kwargs["trace"] = str(output_dir)  # trace.jsonl beside summary.json
        trainer = LocalTrainer(model, train_dataset, val_dataset)
        if placement.replacing:  # the earlier run goes once fit has checked everything
            trainer.before_start = lambda: _replaced(take_placement(placement), progress)
    else:  # across hosts the launcher, which sees every rank's events, writes the trace
        fit_kwargs.pop("num_nodes", None)  # the world size is the number of started ranks
        trainer = RankTrainer(env, model, train_dataset, val_dataset)
        if overwrite and env.rank == 0:
            trainer.before_start = lambda: replace_rank_folder(profile, identity)
    final = trainer.fit(**fit_kwargs)
    if resume and not trainer.summary.get("steps") and (output_dir / "summary.json").is_file():
        # resumed at its last step: nothing trained, so the finished run's results stand
        if env is None or env.rank == 0:
            print(f"{output_dir} had already finished; nothing to resume. Its results are in "
                  f"{output_dir / 'summary.json'}", flush=True)
        return trainer
    if env is None or trainer.writes_outputs:
        metadata = {"profile": profile.name,
                    "profile_values": json.dumps(profile.values, default=repr),
                    "config": json.dumps(trainer.run_config, default=repr),
                    **identity.metadata()}
        atomic_save_safetensors(final.state_dict(), output_dir / FINAL_MODEL, metadata)
        atomic_write_json(output_dir / "summary.json",
                          {"profile": profile.name, "run": identity.as_dict(),
                           **trainer.summary})
    return trainer


def _replaced(placement: RunPlacement, progress: bool | ProgressSink) -> None:
    if progress is not False:
        print(placement.note, flush=True)


def _plain_profile_warnings(message: Warning | str, category: type[Warning], filename: str,
                            lineno: int, line: str | None = None) -> str:
    """A ``ProfileWarning`` or ``DataWarning`` as one plain line; any other warning as
    Python shows it."""
    if issubclass(category, (ProfileWarning, DataWarning)):
        return f"warning: {message}\n"
    return _format_warning(message, category, filename, lineno, line)


_format_warning = warnings.formatwarning


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.formatwarning = _plain_profile_warnings
    if hasattr(signal, "SIGUSR1"):
        # `kill -USR1 PID` prints where each of the rank's threads is (a rank that hangs).
        faulthandler.register(signal.SIGUSR1, all_threads=True)

    try:
        run_profile(args.profile, args.config, parse_overrides(args.overrides), args.resume,
                    progress=not args.quiet, overwrite=args.overwrite,
                    fresh_if_none=args.fresh_if_none, started=args.run_started)
    except (ProfileError, ValueError, TypeError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (LostRankError, RankFailedError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        ignored = describe_ignored()
        if ignored:
            print(f"exogym: this rank {ignored}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
