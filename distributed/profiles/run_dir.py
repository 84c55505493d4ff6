"""Run identities and run folders: a new run never writes over an earlier one, and
``--resume`` continues only a run with the same settings.

A run's **identity** (:class:`RunIdentity`) is its profile's name, a fingerprint of
the settings that define it and its start time. The fingerprint is the SHA-256 of
the profile's resolved settings (defaults of the run, the strategy and the task
filled in, the number of ranks that really run), leaving out the keys that may
change when a run is resumed (:data:`RESUMABLE_KEYS`: how far it trains, what it
records and how often, where and how fast it runs). The identity is written as
``run.json`` into the run's folder when it starts, into every checkpoint
(``fit(run_identity=...)``), into ``summary.json`` and into the final model's
safetensors metadata.

**Folders** (the file work is :mod:`distributed.hosts.onhost.runfolders`'s, so that
it can run on a master host too). The *base folder* is the profile's ``output_dir``
(default ``runs/NAME``):

- a new run (:func:`place_run`) takes the base folder when it holds no run, else
  the first free ``BASE-2``, ``BASE-3``, ...; ``BASE.latest`` then points to it.
  With ``overwrite`` it takes the base folder itself, removing only an earlier
  run's outputs there (``run.json``, ``model.safetensors``, ``summary.json``,
  ``checkpoints/``, ``logs/``): not when the folder is chosen but once every check
  has passed, as the new run starts (:func:`take_placement`), so a run refused for a
  bad value loses nothing.
- ``resume`` continues the newest run started from the base folder whose
  fingerprint is this run's; where runs exist but none has these settings it is
  refused, naming the keys that differ; with no checkpoint to continue it raises
  :class:`NothingToResumeError` (the faces exit 2), or starts a new run when
  ``fresh_if_none`` asks.
- a rank started with rank variables (by the launcher, torchrun, SLURM) uses the
  folder it is given (:func:`rank_identity`): the launcher's side chose it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..hosts.onhost import runfolders
from .profile import RUN_KEYS, Profile

#: Settings that may differ when a run is resumed; every other key is part of the run's
#: fingerprint. How far it trains (``max_steps``, ``num_epochs``); what it records and how
#: often (checkpoints, evaluation interval, logs, trackers); where and how fast it runs,
#: not what it computes (``device``, threads, time-outs, the memory share that sizes
#: minibatches); the launcher's settings across hosts; where its outputs go; its words.
RESUMABLE_KEYS = frozenset({
    "max_steps", "num_epochs",
    "checkpoint_interval", "keep_checkpoints", "val_interval", "log_interval",
    "correlation_interval", "logger", "wandb_project",
    "device", "num_threads", "timeout_s", "max_memory_usage",
    "min_nodes", "lost_after", "stall_after",
    "output_dir", "description",
})

#: What runs a folder action: :func:`local_folders` here, or the app's call on a master host.
FolderCall = Callable[[dict[str, Any]], dict[str, Any]]


class RunFolderError(ValueError):
    """A run cannot start in, or continue from, a folder; the message says why and what to do."""


class NothingToResumeError(RunFolderError):
    """``resume`` found no checkpoint to continue (and was not asked to start afresh)."""


#: A start time as :func:`utc_now` writes it.
STARTED = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,6})?Z")


def utc_now() -> str:
    """This moment as an identity's start time: ISO 8601, UTC, to the microsecond.

    The start tells two runs of one folder apart (:meth:`RunIdentity.same_run`): two
    runs started within one second (``recommend`` times its candidates one after the
    other in one scratch folder) must not read as one run whose hosts differ.
    """
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"


def _plain(value: Any) -> Any:
    """``value`` as JSON reads it back (tuples as lists, odd objects as their repr)."""
    return json.loads(json.dumps(value, default=repr, sort_keys=True))


def _simple_defaults(fn: Any) -> dict[str, Any]:
    """The keyword defaults of ``fn``'s own signature that are plain values."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in params
            if p.default is not inspect.Parameter.empty
            and isinstance(p.default, (int, float, str, bool, type(None)))}


def run_settings(profile: Profile, ranks: int | None = None) -> dict[str, Any]:
    """Every setting of a run of ``profile``, defaults filled in (the run's, the
    strategy's and the task's own), as plain JSON values.

    Args:
        profile: the resolved profile.
        ranks: how many ranks really run (a hosts file's world size replaces
            ``num_nodes``); None: the profile's ``num_nodes``.
    """
    from exogym.config.fit_args import FitArgs

    resolved = profile.resolved
    fit_fields = {f.name: f for f in FitArgs.__dataclass_fields__.values()}
    defaults = {name: fit_fields[name].default for name in RUN_KEYS if name in fit_fields}
    defaults.update(_simple_defaults(resolved.strategy_cls))
    if resolved.routing.task_args is not None:
        defaults.update({k: v for k, v in _simple_defaults(resolved.task_fn).items()
                         if k in resolved.routing.task_args})
    settings = {**defaults, **profile.values}
    for name in RUN_KEYS & settings.keys():  # as fit reads it: balance None is 'none', ...
        convert = fit_fields[name].metadata.get("convert") if name in fit_fields else None
        if convert is not None:
            try:
                settings[name] = convert(settings[name])
            except (TypeError, ValueError):
                pass
    settings["strategy"] = profile.strategy
    settings["num_nodes"] = ranks if ranks is not None else profile.num_nodes
    return _plain(settings)


def fingerprint(profile_name: str, settings: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of a profile's name and the settings that define its run."""
    fixed = {k: v for k, v in settings.items() if k not in RESUMABLE_KEYS}
    text = json.dumps({"profile": profile_name, "settings": fixed}, sort_keys=True,
                      separators=(",", ":"), default=repr)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _shown(value: Any) -> str:
    return "not set" if value is None else json.dumps(value, default=repr)


@dataclass(frozen=True)
class RunIdentity:
    """Which run this is: its profile, its settings' fingerprint and its start time.

    Args:
        profile: the profile's name.
        fingerprint: :func:`fingerprint` of the settings that define the run.
        started: when the run first started (:func:`utc_now`'s format); a resumed run
            keeps its first start.
        settings: the settings the fingerprint is made of.
        may_change: the values of :data:`RESUMABLE_KEYS` (as this start had them).
    """

    profile: str
    fingerprint: str
    started: str
    settings: dict[str, Any] = field(default_factory=dict)
    may_change: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, profile: Profile, ranks: int | None = None,
           started: str | None = None) -> RunIdentity:
        """The identity of a run of ``profile`` starting now (or at ``started``).

        Raises:
            RunFolderError: ``started`` is not a time as :func:`utc_now` writes it.
        """
        if started is not None and not STARTED.fullmatch(started):
            raise RunFolderError(f"--run-started {started!r} is not a start time: give it "
                                 "as 2024-05-01T12:00:00Z (UTC), as the launcher does")
        every = run_settings(profile, ranks)
        fixed = {k: v for k, v in every.items() if k not in RESUMABLE_KEYS}
        changeable = {k: v for k, v in every.items()
                      if k in RESUMABLE_KEYS and k != "output_dir"}  # the folder says where
        return cls(profile.name, fingerprint(profile.name, fixed), started or utc_now(),
                   fixed, changeable)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> RunIdentity | None:
        """An identity as :meth:`as_dict` wrote it (``run.json``); None for anything else."""
        if not isinstance(data, Mapping):
            return None
        try:
            return cls(str(data["profile"]), str(data["fingerprint"]), str(data["started"]),
                       dict(data.get("settings") or {}), dict(data.get("may_change") or {}))
        except (KeyError, TypeError, ValueError):
            return None

    def as_dict(self) -> dict[str, Any]:
        """The identity as ``run.json`` and ``summary.json`` hold it."""
        return {"profile": self.profile, "fingerprint": self.fingerprint,
                "started": self.started, "settings": self.settings,
                "may_change": self.may_change}

    def metadata(self) -> dict[str, str]:
        """The identity as safetensors metadata (strings only)."""
        return {"run_profile": self.profile, "run_fingerprint": self.fingerprint,
                "run_started": self.started,
                "run": json.dumps(self.as_dict(), sort_keys=True, default=repr)}

    def same_run(self, other: RunIdentity) -> bool:
        """Whether ``other`` is this very run: same profile, settings and start."""
        return (self.profile, self.fingerprint, self.started) == (
            other.profile, other.fingerprint, other.started)

    def differences(self, other: RunIdentity, *, there: str = "there",
                    here: str = "here") -> list[str]:
        """The settings that differ from ``other``'s, each as ``key (A there, B here)``;
        ``other`` is "here"."""
        found = []
        if self.profile != other.profile:
            found.append(f"profile ({self.profile} {there}, {other.profile} {here})")
        for key in sorted(self.settings.keys() | other.settings.keys()):
            mine, theirs = self.settings.get(key), other.settings.get(key)
            if mine != theirs:
                found.append(f"{key} ({_shown(mine)} {there}, {_shown(theirs)} {here})")
        return found

    def changed(self, other: RunIdentity) -> list[str]:
        """The :data:`RESUMABLE_KEYS` ``other`` gives other values, as ``key A -> B``."""
        return [f"{key} {_shown(self.may_change.get(key))} -> {_shown(other.may_change.get(key))}"
                for key in sorted(self.may_change.keys() | other.may_change.keys())
                if key != "output_dir" and self.may_change.get(key) != other.may_change.get(key)]

    def continued(self, now: RunIdentity) -> RunIdentity:
        """This run resumed by ``now``: its own start and settings, ``now``'s changeable ones."""
        return RunIdentity(self.profile, self.fingerprint, self.started, self.settings,
                           now.may_change)

    def describe(self) -> str:
        """The identity in a few words: ``profile P, started T, settings 1a2b3c4d5e6f``."""
        return (f"profile {self.profile}, started {self.started}, settings "
                f"{self.fingerprint[:12]}")


@dataclass(frozen=True)
class RunPlacement:
    """Where a run writes, as who, and whether it continues a checkpoint.

    Args:
        folder: the run's folder (relative to the working directory of the machine
            that keeps the outputs, like ``output_dir``).
        identity: the run's identity (a resumed run's is the one it continues).
        resume: continue from the folder's newest complete checkpoint.
        steps: each rank's newest checkpoint step in ``folder`` when resuming (the
            ranks the folder's machine holds).
        note: one line for the person: which folder, what was replaced or changed.
        replacing: the folder still holds the earlier run that this one replaces
            (``--overwrite``); :func:`take_placement` removes it as the run starts.
        claimed: this placement made the folder's ``run.json`` (a new run), so a run
            refused before it wrote anything gives the folder back
            (:func:`release_placement`).
        previous_latest: the folder ``BASE.latest`` named before the claim.
        base: the base folder it was claimed in (``output_dir`` as the profile gave it).
    """

    folder: Path
    identity: RunIdentity
    resume: bool = False
    steps: dict[int, int] = field(default_factory=dict)
    note: str = ""
    replacing: bool = False
    claimed: bool = False
    previous_latest: str | None = None
    base: str | None = None

    def profile(self, profile: Profile) -> Profile:
        """``profile`` writing into this placement's folder."""
        if profile.resolved.output_dir == self.folder:
            return profile
        return profile.with_overrides({"output_dir": str(self.folder)})


def local_folders(message: dict[str, Any]) -> dict[str, Any]:
    """Do a folder action here, in this process."""
    return runfolders.handle(message)


def _do(call: FolderCall, message: dict[str, Any], where: str) -> dict[str, Any]:
    answer = call(message)
    if "error" in answer:
        raise RunFolderError(f"{message['action']} of the run folder "
                             f"{message.get('base') or message.get('folder')}{where}: "
                             f"{answer['error']}")
    return answer


def place_run(profile: Profile, *, ranks: int | None = None, resume: bool = False,
              overwrite: bool = False, fresh_if_none: bool = False,
              started: str | None = None, call: FolderCall = local_folders,
              where: str = "") -> RunPlacement:
    """Choose (and for a new run, claim) the folder of a run of ``profile``.

    Args:
        profile: the resolved profile; its ``output_dir`` is the base folder.
        ranks: how many ranks run (None: the profile's ``num_nodes``).
        resume: continue the newest run of the base folder with these settings.
        overwrite: a new run in the base folder itself, replacing the run there once
            every check has passed (the placement is ``replacing``: :func:`take_placement`).
        fresh_if_none: with ``resume``, start a new run when there is nothing to resume.
        started: the start time to record (default: now).
        call: what does the file work (default: here; the app passes one that runs on
            the master host of a run across hosts).
        where: words naming that machine in messages (``" on HOST"``).

    Raises:
        RunFolderError: ``resume`` with ``overwrite``; runs whose settings differ;
            outputs from before run identities.
        NothingToResumeError: ``resume`` found no checkpoint (without ``fresh_if_none``).
    """
    if resume and overwrite:
        raise RunFolderError("--resume continues a run and --overwrite starts a new one over "
                             "an earlier one: give one of them")
    if fresh_if_none and not resume:
        raise RunFolderError("--fresh-if-none goes with --resume (start afresh when there is "
                             "nothing to resume); a run without --resume always starts afresh")
    identity = RunIdentity.of(profile, ranks, started)
    base = str(profile.resolved.output_dir)
    if not resume:
        return _place_new(base, identity, overwrite, call, where)
    state = _do(call, {"action": "scan", "base": base, "run_name": profile.name}, where)
    try:
        return _place_resume(profile, base, identity, state, where)
    except NothingToResumeError as exc:
        if not fresh_if_none:
            raise
        fresh = _place_new(base, identity, False, call, where)
        why = str(exc).removeprefix("--resume: nothing to resume: ").split(". ")[0]
        return RunPlacement(fresh.folder, fresh.identity,
                            note=f"nothing to resume ({why}); {fresh.note}")


def _place_new(base: str, identity: RunIdentity, overwrite: bool, call: FolderCall,
               where: str) -> RunPlacement:
    if overwrite:
        answer = _do(call, {"action": "look", "base": base}, where)
        if answer.get("outputs"):
            earlier = RunIdentity.from_dict(answer.get("identity"))
            note = (f"this run's folder: {base}{where} (--overwrite: the earlier run there"
                    + (f", {earlier.describe()}," if earlier else "")
                    + " is removed as this run starts, once every check has passed: "
                    + ", ".join(answer["outputs"]) + ")")
            return RunPlacement(Path(base), identity, note=note, replacing=True)
    answer = _do(call, {"action": "claim", "base": base, "identity": identity.as_dict(),
                        "overwrite": overwrite}, where)
    folder = Path(answer["folder"])
    note = f"this run's folder: {folder}{where}"
    if answer.get("replaced"):
        earlier = RunIdentity.from_dict(answer.get("replaced_identity"))
        note += (" (--overwrite: removed the earlier run's " + ", ".join(answer["replaced"])
                 + (f"; it was {earlier.describe()})" if earlier else ")"))
    elif Path(answer["folder"]) != Path(base):
        note += (f" ({base} holds an earlier run, kept as it is; "
                 f"{runfolders.latest_path(base)} points to the newest run)")
    return RunPlacement(folder, identity, note=note, claimed=True,
                        previous_latest=answer.get("previous_latest"), base=base)


def _place_resume(profile: Profile, base: str, identity: RunIdentity,
                  state: dict[str, Any], where: str) -> RunPlacement:
    runs = state.get("runs") or []
    known = [(run, RunIdentity.from_dict(run.get("identity"))) for run in runs]
    with_identity = [(run, ident) for run, ident in known if ident is not None]
    matching = [(run, ident) for run, ident in with_identity
                if ident.fingerprint == identity.fingerprint]
    siblings = f"{base} (or {base}-2, {base}-3, ...)"
    if matching:
        run, theirs = max(matching, key=lambda pair: pair[1].started)
        steps = {int(rank): int(step) for rank, step in (run.get("steps") or {}).items()}
        folder = run["folder"]
        if 0 not in steps:
            unset = "" if profile.values.get("checkpoint_interval") else (
                "; checkpoint_interval is not set, so none are written")
            raise NothingToResumeError(
                f"--resume: nothing to resume: the run in {folder}{where} ({theirs.describe()}) "
                f"has no checkpoint{unset}. Leave out --resume to start a new run (in a "
                "folder of its own), or add --fresh-if-none to start one whenever there is "
                "nothing to resume")
        changes = theirs.changed(identity)
        note = (f"continuing the run in {folder}{where} ({theirs.describe()}) from its "
                f"checkpoint at step {min(steps.values())}")
        if changes:
            note += "; changed since: " + ", ".join(changes)
        return RunPlacement(Path(folder), theirs.continued(identity), resume=True,
                            steps=steps, note=note)
    if with_identity:
        latest = runfolders.latest(base)
        pointed = [pair for pair in with_identity if latest is not None
                   and Path(pair[0]["folder"]) == Path(latest)]
        run, newest = (pointed or [max(with_identity, key=lambda pair: pair[1].started)])[0]
        differ = newest.differences(identity)
        others = len(with_identity) - 1
        raise RunFolderError(
            f"--resume: no run in {siblings}{where} has this run's settings, so none is "
            f"continued: the latest, {run['folder']} ({newest.describe()}), differs in "
            f"{'; '.join(differ)}"
            + ("" if not others else " (and the other run there differs too)" if others == 1
               else f" (and the {others} other runs there differ too)")
            + ". To continue it, give its settings; to start a new run with these, leave out "
            "--resume (it gets a folder of its own). Keys that may change on resume: "
            + ", ".join(sorted(RESUMABLE_KEYS)))
    held = [run["folder"] for run in runs if run.get("holds_run")]
    if held:
        raise RunFolderError(
            f"--resume: {', '.join(held)}{where} hold{'s' if len(held) == 1 else ''} outputs "
            "from before runs had an identity (no run.json): their settings cannot be "
            "checked, so they are not continued. Leave out --resume to start a new run (in a "
            "folder of its own)")
    raise NothingToResumeError(
        f"--resume: nothing to resume: no run of profile {profile.name} in {siblings}{where}. "
        "Leave out --resume to start one, or add --fresh-if-none to start one whenever there "
        "is nothing to resume")


def take_placement(placement: RunPlacement, call: FolderCall = local_folders,
                   where: str = "") -> RunPlacement:
    """Claim a placement's folder for good, just before the run starts: for one that
    replaces an earlier run (``replacing``), remove that run's outputs and write this
    run's ``run.json``; any other placement is already claimed and comes back as it is."""
    if not placement.replacing:
        return placement
    answer = _do(call, {"action": "claim", "base": str(placement.folder),
                        "identity": placement.identity.as_dict(), "overwrite": True}, where)
    earlier = RunIdentity.from_dict(answer.get("replaced_identity"))
    note = ("--overwrite: removed the earlier run's " + ", ".join(answer.get("replaced") or [])
            + (f"; it was {earlier.describe()}" if earlier else ""))
    return dataclasses.replace(placement, replacing=False, note=note)


def release_placement(placement: RunPlacement | None, call: FolderCall = local_folders
                      ) -> bool:
    """Give back the folder of a new run refused before it wrote anything: the folder goes
    when it holds only this run's ``run.json``, and ``BASE.latest`` names what it named
    before. Anything else (a resumed run, a folder the run wrote to) is left as it is.

    Returns:
        Whether the folder was removed.
    """
    if placement is None or not placement.claimed or placement.base is None:
        return False
    answer = call({"action": "release", "base": placement.base,
                   "folder": str(placement.folder), "identity": placement.identity.as_dict(),
                   "previous_latest": placement.previous_latest})
    return bool(answer.get("released"))


def replace_rank_folder(profile: Profile, identity: RunIdentity) -> None:
    """Rank 0 started with rank variables and ``--overwrite``: replace the run in its folder
    with this one, unless the folder was already claimed for it (by the launcher)."""
    folder = str(profile.resolved.output_dir)
    theirs = RunIdentity.from_dict(runfolders.read_identity(folder))
    if theirs is not None and theirs.same_run(identity):
        return
    if os.path.isdir(folder):
        runfolders.clear_outputs(folder)
    runfolders.write_identity(folder, identity.as_dict())


def record_resume(placement: RunPlacement, call: FolderCall = local_folders,
                  where: str = "") -> None:
    """Note in the folder's ``run.json`` that the run was resumed now, and from which step."""
    _do(call, {"action": "resumed", "folder": str(placement.folder), "when": utc_now(),
               "step": min(placement.steps.values(), default=None)}, where)


def rank_identity(profile: Profile, rank: int, ranks: int, *, resume: bool = False,
                  overwrite: bool = False, started: str | None = None) -> RunIdentity:
    """The identity a rank started with rank variables runs under, in the folder it is
    given (``output_dir`` as it is: the launcher's side chose and claimed it).

    Rank 0 checks that folder on its own machine: a new run there must be the one
    claimed for it (same identity), or the folder must hold no run (rank 0 claims it);
    ``overwrite`` replaces another run there; a resumed run must have the same
    fingerprint. Other ranks check nothing here: their checkpoints carry the identity,
    and resuming refuses another run's.

    Args:
        profile: the resolved profile.
        rank, ranks: this rank and the world size.
        resume: the rank resumes (``--resume``; also every restart).
        overwrite: a new run may replace another run in the folder (the caller replaces
            it with :func:`replace_rank_folder` once every check has passed).
        started: the run's start time as the launcher's side recorded it (``--run-started``).

    Raises:
        RunFolderError: the folder holds another run (and no ``overwrite``); the settings
            differ from those of the run claimed or resumed there.
    """
    if resume and overwrite:
        raise RunFolderError("--resume continues a run and --overwrite starts a new one over "
                             "an earlier one: give one of them")
    identity = RunIdentity.of(profile, ranks, started)
    if rank != 0:
        return identity
    folder = str(profile.resolved.output_dir)
    theirs = RunIdentity.from_dict(runfolders.read_identity(folder))
    if resume:
        if theirs is None:
            if runfolders.holds_run(folder):
                raise RunFolderError(
                    f"--resume: {folder} holds outputs from before runs had an identity (no "
                    "run.json): their settings cannot be checked, so they are not continued")
            runfolders.write_identity(folder, identity.as_dict())
            return identity  # nothing to resume: the ranks start at step 0
        if theirs.fingerprint != identity.fingerprint:
            raise RunFolderError(
                f"--resume: the run in {folder} ({theirs.describe()}) has other settings, so "
                f"it is not continued: {'; '.join(theirs.differences(identity))}. Keys that "
                f"may change on resume: {', '.join(sorted(RESUMABLE_KEYS))}")
        runfolders.record_resume(folder, utc_now())
        return theirs.continued(identity)
    if theirs is not None and theirs.same_run(identity):
        return identity  # claimed for this run before the ranks started
    if theirs is not None and theirs.started == identity.started:
        raise RunFolderError(
            f"the settings on this host differ from those the run was started with (in "
            f"{folder}/run.json): {'; '.join(theirs.differences(identity, here='on this host'))}"
            ". Every host must read the same profile: copy this project to the hosts "
            "(--sync)")
    if overwrite:  # replaced once every check has passed (replace_rank_folder)
        return identity
    if runfolders.holds_run(folder) or not runfolders.write_identity(
            folder, identity.as_dict(), exclusive=True):
        earlier = theirs.describe() if theirs else "from before runs had an identity"
        raise RunFolderError(
            f"{folder} holds an earlier run ({earlier}); a new run does not write over it: "
            "add --overwrite to replace it, or give another folder (--set output_dir=...)")
    return identity
