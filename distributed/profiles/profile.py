"""Profiles: named training runs in ``config.ini``, the same file on every host.

A checkout's own profiles (those the wizard writes) go to ``config.local.ini``
beside it, which git ignores and which is read after ``config.ini`` (see
:class:`ProfileSet`); a sync copies it to the hosts with the tracked files.

A profile is a section ``[distributed:NAME]``. ``base_profile = OTHER`` inherits
OTHER's keys. Keys are flat; each goes to whoever accepts it:

- ``task`` (a built-in name or ``package.module:function``) and the task's own
  arguments (e.g. ``hidden``, ``text_file``, ``n_layer``);
- ``strategy`` (a name ``exogym.strategy.registry`` knows: ``ddp``, ``diloco``, ``fedavg``,
  ``sparta``, ``demo``, ``sparta_diloco``, ``streaming_diloco``, ``sparseloco``, ``desloc``,
  ``muloco``; or ``package.module:Class``) and its arguments
  (``lr``, ``H``, ``inner_optim``, ``outer_lr``, ``p_sparta``, ...);
- the run: ``num_nodes``, ``batch_size``, ``max_steps``, ``device``,
  ``checkpoint_interval``, ``output_dir``, ``seed``, ``val_size``, ...

A key no one accepts is an error that names it and lists the accepted ones,
so a typo never silently trains with a default.

A :class:`Profile` is resolved once, when it is first validated or used, into
a :class:`ResolvedProfile`: the task function, the strategy class, the keys
routed to each (:class:`KeyRouting`) and the output folder (``output_dir``,
else ``runs/NAME``). The worker, the app and the planner read that, and
derive none of it again.
"""

from __future__ import annotations

import ast
import configparser
import difflib
import importlib
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from exogym.config.fit_args import balance_problem, fit_default, profile_keys, value_problems
from exogym.strategy import registry

from ..hosts.hostsfile import min_nodes_problem
from ..hosts.sync import BUILTIN_CONFIG, local_profiles_path
from ..tasks import BUILTIN_TASK_NAMES

SECTION_PREFIX = "distributed:"
DEFAULT_CONFIG = BUILTIN_CONFIG

#: Keys for the launcher of a run across hosts (``distributed.launch.options.LaunchOptions``).
LAUNCH_KEYS = {"min_nodes", "lost_after", "stall_after"}
PROFILE_KEYS = {"base_profile", "task", "strategy", "description", "output_dir", *LAUNCH_KEYS}
RUN_KEYS = profile_keys()  # the arguments of fit a profile may set


def builtin_strategy(name: str) -> str | None:
    """The registry's name for a profile's ``strategy`` value (``'allreduce'`` -> ``'ddp'``,
    as :func:`exogym.strategy.registry.canonical` reads it), or None when it names no
    built-in strategy class."""
    try:
        key = registry.canonical(name)
    except (TypeError, ValueError):
        return None
    return key if registry.KNOWN[key].home else None


class ProfileError(ValueError):
    """A profile or config file is wrong; the message lists every problem found."""


class ProfileWarning(UserWarning):
    """A profile will run, but not as its settings suggest (``H`` beyond ``max_steps``, a
    batch larger than a rank's data, many more ranks than cores); warned before it starts."""


#: The longest value a config file or ``--set`` may give (a path, a list of numbers).
MAX_VALUE_CHARS = 100_000
#: The largest config file read (profiles are a few lines each).
MAX_CONFIG_BYTES = 4 << 20


#: The most profiles one ``base_profile`` chain may pass through.
MAX_BASE_CHAIN = 32


def _chain(names: list[str]) -> str:
    """A long chain of profile names in a line: its first few and its last."""
    if len(names) <= 6:
        return " -> ".join(map(repr, names))
    return " -> ".join(map(repr, names[:4])) + f" -> ... ({len(names) - 5} more) -> " \
        + repr(names[-1])


def _listed(names: list[str], most: int = 40) -> str:
    """Names in a line, the first ``most`` of them and how many more."""
    shown = ", ".join(names[:most])
    return shown + (f", ... ({len(names) - most} more)" if len(names) > most else "")


def parse_value(text: str) -> Any:
    """A config value as Python: numbers, booleans, None, lists, else the string.

    Raises:
        ProfileError: a number that is not finite once read (``1e309``, ``nan``), one of
            more digits than Python reads, a value nested deeper than Python parses,
            or a value longer than :data:`MAX_VALUE_CHARS`.
    """
    stripped = text.strip()
    lowered = stripped.lower()
    if lowered in ("true", "yes", "on"):
        return True
    if lowered in ("false", "no", "off"):
        return False
    if lowered in ("none", "null", ""):
        return None
    if len(stripped) > MAX_VALUE_CHARS:
        raise ProfileError(f"a value of {len(stripped):,} characters (at most "
                           f"{MAX_VALUE_CHARS:,}): {stripped[:40]!r}...")
    try:
        value = ast.literal_eval(stripped)
    except (ValueError, SyntaxError, MemoryError, RecursionError) as exc:
        if "digits" in str(exc):  # Python's limit on the digits of an int it reads
            raise ProfileError(f"a number of {len(stripped):,} digits: {stripped[:20]}... is "
                               "beyond any setting (at most 2**63)") from None
        return stripped
    if _huge(value):
        raise ProfileError(f"a number of {len(stripped):,} digits: {stripped[:20]}... is "
                           "beyond any setting (at most 2**63)")
    if not _finite(value):
        raise ProfileError(f"{stripped[:40]!r} is not a finite number once read (it reads as "
                           f"{_nonfinite(value)}): give a number within the float range")
    return value


def _finite(value: Any) -> bool:
    """Whether ``value`` holds no infinite or NaN float (in lists, tuples, dicts too)."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, complex):
        return math.isfinite(value.real) and math.isfinite(value.imag)
    if isinstance(value, (list, tuple, set)):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(k) and _finite(v) for k, v in value.items())
    return True


def _huge(value: Any) -> bool:
    """Whether ``value`` holds a whole number beyond 64 bits (in lists, tuples, dicts too)."""
    if isinstance(value, int):
        return abs(value) >= 2**63
    if isinstance(value, (list, tuple, set)):
        return any(_huge(v) for v in value)
    if isinstance(value, dict):
        return any(_huge(k) or _huge(v) for k, v in value.items())
    return False


def _nonfinite(value: Any) -> str:
    if isinstance(value, (float, complex)):
        return repr(value)
    items = value.items() if isinstance(value, dict) else enumerate(value)
    return next(_nonfinite(v) for _, v in items if not _finite(v))


def strategy_class(name: str) -> type:
    """The strategy class a profile's ``strategy`` value names."""
    key = builtin_strategy(name)
    if key is not None:
        return registry.class_of(key)
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ProfileError(f"strategy {name!r} cannot be imported: {exc}") from exc
        return cls
    raise ProfileError(unknown_strategy(name))


def imported_names(values: dict[str, Any]) -> list[str]:
    """The ``package.module:name`` values a profile with these keys would import: its task
    and its strategy, unless they are built-in names."""
    profile = Profile("", values)
    found = []
    if "task" in values and profile.task not in BUILTIN_TASK_NAMES and ":" in profile.task:
        found.append(profile.task)
    if builtin_strategy(profile.strategy) is None and ":" in profile.strategy:
        found.append(profile.strategy)
    return found


def unknown_strategy(name: str) -> str:
    """Why ``name`` is not a strategy a profile can give."""
    names = sorted(key for key, known in registry.KNOWN.items() if known.home)
    return (f"unknown strategy {name!r}: use one of {', '.join(names)} "
            "or 'package.module:StrategyClass'")


def strategy_balance_problem(mode: str, strategy_cls: type,
                             strategy_kwargs: dict[str, Any]) -> str | None:
    """Why the strategy a profile builds cannot run with ``balance=mode``
    (:func:`exogym.config.fit_args.balance_problem`); None when it can, or when the strategy
    cannot be built from these keys (the run names that problem)."""
    if mode == "none":
        return None
    try:
        strategy = quietly(strategy_cls, strategy_kwargs)
    except (TypeError, ValueError):
        return None
    return balance_problem(mode, strategy)


def quietly(strategy_cls: type, strategy_kwargs: dict[str, Any]) -> Any:
    """The strategy built only to check or plan it, its warnings held back: they are for
    whoever runs it (the run builds it again), not for every profile resolved or candidate
    weighed on the way (``recommend`` and the wizard try strategies nobody chose)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return strategy_cls(**strategy_kwargs)


def override_problems(profile: str, overrides: dict[str, Any]) -> list[str]:
    """Each ``--set`` value of the wrong type for its key, as ``--set key=value: why
    (profile NAME)``; checked without the task or the strategy, so before any work."""
    found = value_problems({k: v for k, v in overrides.items() if k in RUN_KEYS})
    return [f"--set {key}={overrides[key]}: {why} (profile {profile})"
            for key, why in found.items()]


@dataclass(frozen=True)
class KeyRouting:
    """Which of a profile's keys go to the task, the strategy and the run.

    A key goes to every taker that names it (``seed`` to the task and to the
    run); a task that takes ``**kwargs`` also gets every key that neither the
    strategy nor the run takes.

    Args:
        task_args: the task function's keyword arguments; None when it takes ``**kwargs``.
        strategy_args: the strategy class's keyword arguments.
    """

    task_args: frozenset[str] | None
    strategy_args: frozenset[str]

    @classmethod
    def of(cls, task_fn: Callable[..., Any], strategy_cls: type) -> KeyRouting:
        """The routing of a task function and a strategy class."""
        # Here, not at the top: the tasks bring torch, and reading profiles stays light.
        from exogym.base.arg_errors import init_arg_names

        from ..tasks.builtin import task_arg_names

        task_args = task_arg_names(task_fn)
        return cls(None if task_args is None else frozenset(task_args),
                   frozenset(init_arg_names(strategy_cls)))

    @property
    def named(self) -> set[str]:
        """Every key some taker accepts by name."""
        return PROFILE_KEYS | RUN_KEYS | self.strategy_args | (self.task_args or set())

    def split(self, values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any],
                                                      dict[str, Any]]:
        """``values`` as (task kwargs, strategy kwargs, run kwargs)."""
        task, strategy, run = {}, {}, {}
        for key, value in values.items():
            if key in PROFILE_KEYS:
                continue
            if key in RUN_KEYS:
                run[key] = value
            if key in self.strategy_args:
                strategy[key] = value
            taken = key in RUN_KEYS or key in self.strategy_args
            if (self.task_args is None and not taken) or (
                    self.task_args is not None and key in self.task_args):
                task[key] = value
        return task, strategy, run


@dataclass(frozen=True)
class ResolvedProfile:
    """A valid profile resolved once: what it builds, where each key goes, where it writes.

    The worker, the app's run and compare, and the planner read this instead of
    deriving any of it again from the profile's values.

    Args:
        task_fn: the function the ``task`` key names; ``task_fn(**task_kwargs)``
            returns ``(model, train_dataset, val_dataset)``.
        strategy_cls: the class the ``strategy`` key names.
        routing: which keys the task and the strategy accept.
        task_kwargs: the keys for ``task_fn``.
        strategy_kwargs: the keys for ``strategy_cls``.
        run_kwargs: the keys for the run (``fit``).
        output_dir: where the run writes its final model, summary, checkpoints and
            logs: the ``output_dir`` key, else ``runs/NAME``.
    """

    task_fn: Callable[..., Any]
    strategy_cls: type
    routing: KeyRouting
    task_kwargs: dict[str, Any]
    strategy_kwargs: dict[str, Any]
    run_kwargs: dict[str, Any]
    output_dir: Path


#: The columns of :meth:`Profile.summary`, as the ``profiles`` command shows them.
SUMMARY_COLUMNS = ("task", "strategy", "nodes", "key settings", "description")
#: The keys its "key settings" column shows, where a profile sets them.
SUMMARY_KEYS = ("batch_size", "max_steps", "lr", "H", "p_sparta", "island_size",
                "sparta_interval", "compression_topk", "balance")


@dataclass(frozen=True)
class Profile:
    """A profile: its name and every key, inheritance applied.

    It is resolved (task, strategy, keys routed, output folder) once, on first
    use of :meth:`problems` or :attr:`resolved`; for other values make another
    profile (:meth:`with_overrides`) rather than changing ``values``.

    Args:
        name: the profile's name (the part after ``distributed:``).
        values: all keys with parsed values (``base_profile`` resolved away).
        source: the config file it came from.
    """

    name: str
    values: dict[str, Any]
    source: str = ""

    @property
    def task(self) -> str:
        return str(self.values["task"])

    @property
    def strategy(self) -> str:
        return str(self.values.get("strategy", "diloco"))

    @property
    def num_nodes(self) -> int:
        """The ranks a simulation of this profile runs: its ``num_nodes``, else ``fit``'s
        default (a run across hosts runs the hosts file's ranks instead)."""
        value = self.values.get("num_nodes")
        return int(value) if value is not None else int(fit_default("num_nodes"))

    @property
    def resolved(self) -> ResolvedProfile:
        """The profile resolved: task function, strategy class, routed keys, output folder.

        Raises:
            ProfileError: naming every problem, when the profile is not valid.
        """
        resolved, problems = self._resolution
        if resolved is None:
            raise ProfileError(f"profile {self.name!r}:\n  " + "\n  ".join(problems))
        return resolved

    def problems(self) -> list[str]:
        """Every problem with this profile's keys (empty when it is valid)."""
        return list(self._resolution[1])

    def quick_problems(self) -> list[str]:
        """The problems found without importing the task or the strategy (so without
        torch): no task, an unknown task or strategy name, a run key's value of the wrong
        type. An unknown key is found only by :meth:`problems`."""
        task = self.values.get("task")
        if task is None:
            return [f"no 'task' key: set task = {' | '.join(BUILTIN_TASK_NAMES)} | "
                    "module:function"]
        found = []
        if str(task) not in BUILTIN_TASK_NAMES and ":" not in str(task):
            found.append(f"unknown task {task!r}: use one of {', '.join(BUILTIN_TASK_NAMES)} "
                         "or 'package.module:function'")
        if builtin_strategy(self.strategy) is None and ":" not in self.strategy:
            found.append(unknown_strategy(self.strategy))
        found += value_problems({k: v for k, v in self.values.items() if k in RUN_KEYS}).values()
        found += launch_key_problems(self.values)
        return found

    @cached_property
    def _resolution(self) -> tuple[ResolvedProfile | None, tuple[str, ...]]:
        from ..tasks.builtin import resolve_task

        quick = self.quick_problems()
        if quick:
            return None, tuple(quick)
        try:
            # a task module beside the config file that names it, or in the current folder
            near = [Path(self.source).resolve().parent] if self.source and \
                Path(self.source).is_file() else []
            task_fn = resolve_task(self.task, near=[*near, Path.cwd()])
            strategy_cls = strategy_class(self.strategy)
            routing = KeyRouting.of(task_fn, strategy_cls)
        except (ValueError, ImportError) as exc:
            return None, (str(exc),)
        accepted = routing.named
        unknown = []
        for key in self.values:
            if routing.task_args is not None and key not in accepted:
                close = difflib.get_close_matches(key, accepted, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                unknown.append(f"unknown key {key!r}{hint}; accepted for task {self.task!r} and "
                               f"strategy {self.strategy!r}: {', '.join(sorted(accepted))}")
        if unknown:
            return None, tuple(unknown)
        task, strategy, run = routing.split(self.values)
        try:  # a strategy's own checks (lr=abc) fail here, before any run is placed
            quietly(strategy_cls, strategy)
        except (TypeError, ValueError) as exc:
            return None, (f"strategy {self.strategy!r}: {exc}",)
        # `balance = none` in a profile reads as None
        mismatch = strategy_balance_problem(run.get("balance") or "none", strategy_cls, strategy)
        if mismatch is not None:
            return None, (mismatch,)
        output_dir = Path(str(self.values.get("output_dir") or Path("runs") / self.name))
        return ResolvedProfile(task_fn, strategy_cls, routing, task, strategy, run, output_dir), ()

    def with_overrides(self, overrides: dict[str, Any]) -> Profile:
        """A copy with some keys replaced (``--set key=value``), re-validated."""
        wrong = override_problems(self.name, overrides)
        if wrong:
            raise ProfileError("\n".join(wrong))
        profile = Profile(self.name, {**self.values, **overrides}, self.source)
        problems = profile.problems()
        if problems:
            raise ProfileError(f"profile {self.name!r}:\n  " + "\n  ".join(problems))
        return profile

    def summary(self) -> dict[str, str]:
        """The profile's row in a table of profiles, by :data:`SUMMARY_COLUMNS`; works for a
        profile that is not valid too (its problems are :meth:`problems`)."""
        settings = " ".join(f"{k}={self.values[k]}" for k in SUMMARY_KEYS if k in self.values)
        return {"task": str(self.values.get("task", "-")), "strategy": self.strategy,
                "nodes": str(self.num_nodes), "key settings": settings,
                "description": str(self.values.get("description") or "")}


class ProfileSet:
    """All profiles of a config file, and of this checkout's own profiles file beside it.

    ``config.ini`` is shared (tracked by git); ``config.local.ini`` beside it
    (:func:`~distributed.hosts.sync.local_profiles_path`, git-ignored) holds the
    profiles this checkout adds, as the wizard writes them. It is read after the
    shared file: a profile in it replaces the shared one of the same name as a
    whole, and may name a shared one as its ``base_profile``.

    Args:
        path: the ``config.ini`` to read (default: the project's own).
        local: also read the local profiles file beside it.
    """

    def __init__(self, path: str | Path | None = None, *, local: bool = True):
        self.path = Path(path) if path is not None else DEFAULT_CONFIG
        if not self.path.is_file():
            raise ProfileError(f"config file {str(self.path)!r} does not exist")
        self.local_path = local_profiles_path(self.path)
        self.raw: dict[str, dict[str, str]] = {}
        #: The file each profile was read from.
        self.sources: dict[str, Path] = {}
        #: The files read, the shared one first.
        self.read: list[Path] = [self.path]
        self._parsed: dict[str, dict[str, Any]] = {}
        if local and self.local_path.is_file():
            self.read.append(self.local_path)
        for file in self.read:
            for name, keys in _read_sections(file).items():
                self.raw[name] = keys  # a local profile replaces the shared one whole
                self.sources[name] = file

    @property
    def files(self) -> str:
        """The files read, in words: ``config.ini`` or ``config.ini and config.local.ini``."""
        return " and ".join(str(file) for file in self.read)

    def imported_names(self) -> set[str]:
        """Every ``package.module:name`` this person's own profiles import (as task or
        strategy): code they chose to run, which a run folder may name too."""
        found: set[str] = set()
        for name in self.raw:
            try:
                found.update(imported_names(self._resolve(name)))
            except ProfileError:
                continue
        return found

    def names(self) -> list[str]:
        """Profile names in file order: the shared file's, then those only the local file has."""
        return list(self.raw)

    def source(self, name: str) -> Path:
        """The file profile ``name`` is read from (the config file for an unknown name)."""
        return self.sources.get(name, self.path)

    def _own(self, name: str) -> dict[str, Any]:
        """Profile ``name``'s own keys, parsed (once: every profile built on it reads them)."""
        cache = self._parsed
        if name not in cache:
            own = {}
            for key, text in self.raw[name].items():
                try:
                    own[key] = parse_value(text)
                except ProfileError as exc:
                    raise ProfileError(f"{self.source(name)}: profile {name!r}, key "
                                       f"{key!r}: {exc}") from None
            cache[name] = own
        return cache[name]

    def _resolve(self, name: str) -> dict[str, Any]:
        """Profile ``name``'s keys, each ``base_profile`` followed (at most
        :data:`MAX_BASE_CHAIN` deep), a profile's own keys over its base's."""
        chain: list[str] = []
        layers: list[dict[str, Any]] = []
        current: str | None = name
        while current:
            if current not in self.raw:
                close = difflib.get_close_matches(current, self.raw, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                where = f" (base_profile of {chain[-1]!r})" if chain else ""
                raise ProfileError(
                    f"no profile {current!r}{where} in {self.files}{hint}; sections are named "
                    f"[{SECTION_PREFIX}NAME] and the profiles are: "
                    f"{_listed(list(self.raw)) or 'none'}")
            if current in chain:
                raise ProfileError(f"base_profile cycle: {' -> '.join([*chain, current])}")
            if len(chain) == MAX_BASE_CHAIN:
                raise ProfileError(
                    f"{self.source(name)}: profile {name!r} inherits through more than "
                    f"{MAX_BASE_CHAIN} base_profile links ({_chain(chain)} -> ...): a profile "
                    "builds on a few others at most; name a base nearer the start")
            chain.append(current)
            own = dict(self._own(current))
            base = own.pop("base_profile", None)
            layers.append(own)
            current = str(base) if base else None
        values: dict[str, Any] = {}
        for own in reversed(layers):
            values.update(own)
        return values

    def values(self, name: str) -> dict[str, Any]:
        """The keys of profile ``name`` with ``base_profile`` resolved, not validated
        (to show a profile that cannot run, say why, and still list its settings)."""
        return self._resolve(name)

    def get(self, name: str, overrides: dict[str, Any] | None = None) -> Profile:
        """The profile ``name`` with inheritance and ``overrides`` applied, validated.

        ``overrides`` of the wrong type fail first, before the task and the strategy are
        imported (which takes seconds: torch).
        """
        wrong = override_problems(name, overrides or {})
        if wrong:
            raise ProfileError("\n".join(wrong))
        profile = Profile(name, self._resolve(name), str(self.source(name)))
        problems = profile.problems()
        if problems:
            raise ProfileError(f"profile {name!r} in {self.source(name)}:\n  "
                               + "\n  ".join(problems))
        return profile.with_overrides(overrides) if overrides else profile


def _read_sections(path: Path) -> dict[str, dict[str, str]]:
    """The ``[distributed:NAME]`` sections of the INI file ``path``, by name, keys as written."""
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str  # keep key case: H is not h
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ProfileError(f"{path} is {size:,} bytes, not a profiles file (at most "
                               f"{MAX_CONFIG_BYTES:,} bytes): give the config.ini of profiles")
        raw = path.read_bytes()
        if b"\0" in raw:
            raise ProfileError(f"{path} holds NUL bytes: a binary file, not a profiles file; "
                               "give the config.ini of profiles")
        parser.read_string(raw.decode("utf-8"), source=str(path))
    except UnicodeDecodeError as exc:
        raise ProfileError(f"{path} is not UTF-8 text (byte {exc.start}): not a profiles "
                           "file; give the config.ini of profiles") from None
    except OSError as exc:
        raise ProfileError(f"cannot read {path}: {exc.strerror or exc}") from None
    except configparser.Error as exc:
        raise ProfileError(f"{path}: {exc}") from exc
    return {section[len(SECTION_PREFIX):].strip(): dict(parser[section])
            for section in parser.sections() if section.startswith(SECTION_PREFIX)}


def parse_overrides(pairs: list[str] | None) -> dict[str, Any]:
    """``['lr=0.01', 'H=50']`` -> ``{'lr': 0.01, 'H': 50}``; a clear error otherwise."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ProfileError(f"--set expects key=value, got {pair!r}")
        if not value.strip():
            raise ProfileError(f"--set {key.strip()}= gives no value: write the value after "
                               f"the '=', or --set {key.strip()}=none to unset the key")
        try:
            out[key.strip()] = parse_value(value)
        except ProfileError as exc:
            raise ProfileError(f"--set {pair[:60]}: {exc}") from None
    return out


def load_profile(name: str, config: str | Path | None = None,
                 overrides: dict[str, Any] | None = None) -> Profile:
    """Read ``config`` and return profile ``name`` (with ``overrides``)."""
    return ProfileSet(config).get(name, overrides)


def launch_key_problems(values: dict[str, Any]) -> list[str]:
    """What is wrong with the launcher's keys of a profile (``min_nodes``, ``lost_after``,
    ``stall_after``)."""
    found = []
    nodes = values.get("min_nodes")
    problem = min_nodes_problem(nodes)
    if problem is not None:
        found.append(problem)
    if nodes is not None and str(values.get("balance") or "none").lower() != "none":
        found.append(f"min_nodes={nodes} and balance={values['balance']} do not go together: "
                     "shares are agreed among every rank, so hosts cannot come and go; drop "
                     "one of them")
    after = values.get("lost_after")
    if after is not None and (isinstance(after, bool) or not isinstance(after, (int, float))
                              or after <= 0):
        found.append(f"lost_after must be a number of seconds > 0 (how long a host may be "
                     f"silent before it is dropped), got {after!r}")
    stall = values.get("stall_after")
    if stall is not None and (isinstance(stall, bool) or not isinstance(stall, (int, float))
                              or stall <= 0):
        found.append(f"stall_after must be a number of seconds > 0 (how long a run across "
                     f"hosts may make no progress before it is stopped), got {stall!r}")
    return found
