"""Read and check a recorded run's folder before anything is replayed.

A run folder is only files, which whoever can write there chooses: it is read as
JSON (``trace.jsonl``, ``run.json``, ``summary.json``; nothing is unpickled), and
every problem is a :class:`~.recording.ReplayError` that says what to do. Refused
(:func:`load_recording`): a folder without a trace, a trace of an older format or
that ended before its first step, a trace whose run is not the folder's, settings
that make no valid profile here, and code to import (``module:name``) that none of
the person's own profiles names (:func:`untrusted_code`). A run resumed from a
checkpoint is read as one run (:func:`one_timeline`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from exogym.base.install_mode import command
from exogym.base.untrusted import MAX_RUN_FILE_BYTES, read_json
from exogym.report.trace import FORMAT_VERSION, TRACE_FILE, read_trace

from ...profiles.profile import Profile, ProfileError, ProfileSet, imported_names
from ...profiles.run_dir import RunIdentity
from .recording import Recording, ReplayError

__all__ = ["NEEDED_VERSION", "load_recording", "one_timeline", "rebuild_profile",
           "round_steps_of", "untrusted_code"]

#: The trace format a replay needs: its header carries the hosts' pre-flight links.
NEEDED_VERSION = 2


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = read_json(path, MAX_RUN_FILE_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ReplayError(f"{path} cannot be read: {exc}") from None
    return data if isinstance(data, dict) else None


def rebuild_profile(identity: RunIdentity, header: Mapping[str, Any]) -> Profile:
    """The run's profile from its identity's settings (as it ran, every default filled in);
    a simulation's network from the trace's header (the identity holds only its text)."""
    values = {**identity.settings, **identity.may_change}
    values.pop("network", None)
    net = (header.get("config") or {}).get("network") if header.get("source") == "simulation" \
        else None
    if net:
        values["network"] = {"bandwidth": net["bandwidth_bits_per_s"],
                             "latency_s": net["latency_s"]}
        if net.get("rank_bandwidth_bits_per_s"):
            values["network"]["rank_bandwidth"] = list(net["rank_bandwidth_bits_per_s"])
    elif identity.settings.get("network") is not None:
        values["network"] = identity.settings["network"]
    return Profile(identity.profile, values, "the run's own settings")


def untrusted_code(identity: RunIdentity, where: Path, config: str | Path | None = None,
                   trust_code: bool = False) -> None:
    """Refuse a recorded run whose task or strategy is code to import (``module:name``)
    that none of this person's own profiles (``config``: default the project's) names.

    A run folder is only files: whoever can write there (or hands one over) chooses what
    it names, and the settings' fingerprint is a plain hash anyone can compute again.

    Raises:
        ReplayError: naming the code and the two ways to accept it.
    """
    named = imported_names({**identity.settings, **identity.may_change})
    if not named or trust_code:
        return
    try:
        own = ProfileSet(config)
        mine, files = own.imported_names(), own.files
    except ProfileError:
        mine, files = set(), str(config or "config.ini")
    foreign = [name for name in named if name not in mine]
    if foreign:
        raise ReplayError(
            f"{where} names code to import ({', '.join(map(repr, foreign))}) that none of your "
            f"profiles in {files} names: it is not imported, since a run folder can name any "
            "code and importing it runs that code. If you trust it, name it as the task or "
            "strategy of one of your profiles, or add --trust-code")


def load_recording(folder: str | Path, config: str | Path | None = None,
                   trust_code: bool = False) -> Recording:
    """Read and check a run's folder; every problem is a :class:`ReplayError`.

    Refused: a folder without a trace, a trace of an older format or that ended
    before its first step, a trace whose run is not the folder's (profile,
    settings or ranks differ), settings that make no valid profile here, a task or
    strategy to import that the person's own profiles (``config``) do not name,
    unless ``trust_code`` (:func:`untrusted_code`).
    """
    folder = Path(folder)
    path = _trace_path(folder)
    try:
        lines = read_trace(path)
    except (OSError, ValueError) as exc:
        raise ReplayError(f"{path} cannot be read: {exc}") from None
    header = _header(lines, path)
    recorded = RunIdentity.from_dict(header.get("run"))
    if recorded is None:
        raise ReplayError(f"{path} names no run (its header's 'run' is empty): a run of "
                          "distributed-train records its identity")
    untrusted_code(recorded, path, config, trust_code)
    _check_folder_run(folder, path, recorded)
    num_nodes = _checked_ranks(lines, header, recorded, path)
    profile = _rebuilt_profile(recorded, header, num_nodes, folder, path)
    return Recording(folder, one_timeline(lines), header, recorded, profile, num_nodes,
                     round_steps_of(profile))


def _trace_path(folder: Path) -> Path:
    """The trace of the run folder ``folder``, which must hold one."""
    if not folder.is_dir():
        raise ReplayError(f"{folder} is not a folder: give a run's folder (runs/NAME, as "
                          "distributed-train printed it)")
    path = folder / TRACE_FILE
    if not path.exists():
        if not (folder / "run.json").exists():
            raise ReplayError(_not_a_run_folder(folder))
        raise ReplayError(f"{folder} holds no {TRACE_FILE}: only a run of this version records "
                          "one (distributed-train, a local simulation or across hosts); run it "
                          "again to replay it")
    return path


#: How many replayable run folders a message names.
_NAMED_FOLDERS = 5


def _not_a_run_folder(folder: Path) -> str:
    """Why ``folder`` (no run's own: a tree of runs such as ``runs``, or another folder)
    cannot be replayed, naming the run folders under it that can."""
    from ..run_list import list_runs

    try:
        rows = list_runs(folder)
    except OSError:
        rows = []
    replayable = [row.folder for row in reversed(rows)  # newest first
                  if row.status != "running" and (row.folder / TRACE_FILE).is_file()]
    if not replayable:
        return (f"{folder} is not a run's folder and holds none with a {TRACE_FILE}: give "
                f"the folder of a run (as distributed-train printed it), e.g. "
                f"{command('replay', 'runs/digits-diloco')}; `{command('runs')}` lists them")
    named = ", ".join(str(p) for p in replayable[:_NAMED_FOLDERS])
    more = len(replayable) - _NAMED_FOLDERS
    return (f"{folder} is a folder of runs, not a run's folder: give one of them, e.g. "
            f"{command('replay', str(replayable[0]))}. Those that can be replayed, newest "
            f"first: {named}" + (f" and {more} more" if more > 0 else "")
            + f" (`{command('runs', str(folder))}` lists every run)")


def _header(lines: list[dict[str, Any]], path: Path) -> dict[str, Any]:
    """The trace's first ``run`` line, of the format a replay needs and of every rank."""
    headers = [line for line in lines if line.get("kind") == "run"]
    if not headers:
        raise ReplayError(f"{path} has no run line: not a trace")
    header = headers[0]
    version = header.get("version")
    if version != NEEDED_VERSION:
        raise ReplayError(f"{path} is a trace of format version {version} (an older version "
                          f"recorded it); a replay needs version {NEEDED_VERSION} (written "
                          f"since the hosts' links are probed before a run; this code writes "
                          f"{FORMAT_VERSION}): run it again to replay it")
    if header.get("source") not in ("simulation", "hosts"):
        raise ReplayError(f"{path} is one rank's own trace (source {header.get('source')!r}: "
                          "NetworkTrainer's script mode); a replay needs every rank's, as "
                          "distributed-train records it")
    return header


def _check_folder_run(folder: Path, path: Path, recorded: RunIdentity) -> None:
    """Refuse a trace whose run is not the one the folder's ``run.json`` (else
    ``summary.json``) names."""
    on_file = RunIdentity.from_dict(_read_json(folder / "run.json")) or \
        RunIdentity.from_dict((_read_json(folder / "summary.json") or {}).get("run"))
    if on_file is not None and (on_file.profile, on_file.fingerprint) != (
            recorded.profile, recorded.fingerprint):
        differ = recorded.differences(on_file, there="in the trace", here="in the folder")
        raise ReplayError(f"{path} does not match the run in {folder}: the trace is of profile "
                          f"{recorded.profile} ({recorded.fingerprint[:12]}), the folder's "
                          f"run.json of {on_file.profile} ({on_file.fingerprint[:12]})"
                          + (f"; they differ in {', '.join(differ[:6])}" if differ else ""))


def _checked_ranks(lines: Sequence[Mapping[str, Any]], header: Mapping[str, Any],
                   recorded: RunIdentity, path: Path) -> int:
    """The run's ranks, as its header, its settings and its steps all say."""
    num_nodes = int(header.get("num_nodes") or 0)
    if recorded.settings.get("num_nodes") not in (None, num_nodes):
        raise ReplayError(f"{path} records {num_nodes} ranks but its run's settings say "
                          f"num_nodes={recorded.settings['num_nodes']}: the trace does not "
                          "match the profile")
    ranks = {line["rank"] for line in lines if line.get("kind") in ("step", "steps")}
    if not ranks:
        raise ReplayError(f"{path} records no step: the run ended before its first step")
    if max(ranks) >= num_nodes:
        raise ReplayError(f"{path} has steps of rank {max(ranks)} in a run of {num_nodes} "
                          "ranks: the trace does not match the profile")
    return num_nodes


def _rebuilt_profile(recorded: RunIdentity, header: Mapping[str, Any], num_nodes: int,
                     folder: Path, path: Path) -> Profile:
    """The run's profile rebuilt here (:func:`rebuild_profile`), valid and with the
    recorded settings' fingerprint."""
    profile = rebuild_profile(recorded, header)
    problems = profile.problems()
    if problems:
        raise ReplayError(f"the settings of the run in {folder} make no valid profile here "
                          f"(the code here differs from the one that ran it):\n  "
                          + "\n  ".join(problems))
    again = RunIdentity.of(profile, num_nodes)
    if again.fingerprint != recorded.fingerprint:
        differ = recorded.differences(again, there="recorded", here="rebuilt here")
        raise ReplayError(f"the profile rebuilt from {path} is not the run it records (its "
                          f"settings fingerprint differs: "
                          f"{', '.join(differ[:6]) or 'the same keys, other defaults'}); "
                          "the defaults here differ from the ones the run had")
    return profile


#: Trace lines that belong to a step: a resumed run's later lines replace them.
_STEPPED = ("step", "steps", "eval", "hand_over", "membership", "fault")


def one_timeline(lines: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The trace of a run resumed from a checkpoint (one part per ``run`` line), as one run.

    Each later part continues from the step before its first: the earlier part's lines
    after that step (work the interruption lost, done again) are left out, and the later
    part's clocks are moved to go on from where the kept part ends, per rank (its
    ``wall_s`` and ``sim_time_s``) and for the run (``t``). Only the last part's ``end``
    and ``link`` lines stay. A trace of one part comes back as it is.
    """
    parts: list[list[dict[str, Any]]] = []
    for line in lines:
        if line.get("kind") == "run" or not parts:
            parts.append([])
        parts[-1].append(dict(line))
    if len(parts) <= 1:
        return [dict(line) for line in lines]
    out = parts[0]
    for part in parts[1:]:
        firsts = [int(line["step"]) for line in part if line.get("kind") == "step"]
        if not firsts:
            continue  # resumed at its last step: it trained nothing
        resumed_at = min(firsts) - 1
        out = [line for line in out if line.get("kind") not in ("end", "link")
               and not (line.get("kind") in _STEPPED and line.get("step") is not None
                        and int(line["step"]) > resumed_at)]
        wall: dict[int, float] = {}
        sim: dict[int, float] = {}
        t_end = 0.0
        for line in out:
            rank = line.get("rank")
            if line.get("kind") in ("step", "steps") and isinstance(rank, int):
                if isinstance(line.get("wall_s"), (int, float)):
                    wall[rank] = max(wall.get(rank, 0.0), float(line["wall_s"]))
                if isinstance(line.get("sim_time_s"), (int, float)):
                    sim[rank] = max(sim.get(rank, 0.0), float(line["sim_time_s"]))
            if isinstance(line.get("t"), (int, float)):
                t_end = max(t_end, float(line["t"]))
        t_offset = max([t_end, *wall.values()])
        for line in part[1:]:  # its own run line: the first part's stands for the run
            rank = line.get("rank")
            if isinstance(line.get("wall_s"), (int, float)) and rank in wall:
                line["wall_s"] = round(line["wall_s"] + wall[rank], 4)
            if isinstance(line.get("sim_time_s"), (int, float)) and rank in sim:
                line["sim_time_s"] = round(line["sim_time_s"] + sim[rank], 6)
            if isinstance(line.get("t"), (int, float)):
                line["t"] = round(line["t"] + t_offset, 3)
            out.append(line)
    return out


def round_steps_of(profile: Profile) -> int:
    """Steps per round of the profile's strategy (``Strategy.round_steps``: ``H``, or 1)."""
    resolved = profile.resolved
    strategy = resolved.strategy_cls(**resolved.strategy_kwargs)
    return max(1, int(getattr(strategy, "round_steps", 1) or 1))

