"""The worker's command line, written once: ``-m distributed.worker --profile NAME ...``.

The launcher starts it on every host, ``dry_run`` shows it for a local
simulation, and the CLI's own command line (``--set key=value``) shares its
override format: a mapping of profile keys, or ``"key=value"`` strings, with
booleans written ``true``/``false`` as ``config.ini`` reads them. The parser on
the other side is :func:`distributed.worker.run_profile.build_parser`; this module
imports nothing heavy, so the launcher stays light.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..hosts.sync import PACKAGE_FOLDER

#: The module every rank runs in profile mode (``distributed.worker`` from a checkout).
WORKER_MODULE = f"{PACKAGE_FOLDER}.worker"
#: What a worker is given to continue from its newest complete checkpoint.
RESUME_ARGS = ("--resume",)

Overrides = Mapping[str, object] | Sequence[str]


def override_value(value: object) -> str:
    """A value as an override writes it: booleans as ``true``/``false``, None as ``none``,
    the rest as ``str``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    return str(value)


def override_items(overrides: Overrides) -> list[str]:
    """``{"lr": 0.1, "compile": False}`` -> ``["lr=0.1", "compile=false"]``; strings are checked.

    Raises:
        TypeError: for a single string instead of a list of them.
        ValueError: for an item that does not look like ``key=value``.
    """
    if isinstance(overrides, Mapping):
        items = [f"{key}={override_value(value)}" for key, value in overrides.items()]
    elif isinstance(overrides, str):
        raise TypeError(f'overrides must be a mapping or a list of "key=value" strings, got '
                        f"the string {overrides!r}; wrap it in a list")
    else:
        items = list(overrides)
    for item in items:
        if not isinstance(item, str) or "=" not in item or item.startswith("="):
            raise ValueError(f'each override must look like "key=value", got {item!r}')
    return items


def set_args(overrides: Overrides) -> list[str]:
    """``--set key=value`` for every override, as both the worker and the CLI take them."""
    return [arg for item in override_items(overrides) for arg in ("--set", item)]


def worker_args(profile: str, *, config: str | None = None, overrides: Overrides = (),
                resume: bool = False, quiet: bool = False, overwrite: bool = False,
                fresh_if_none: bool = False, run_started: str | None = None) -> list[str]:
    """The arguments after the interpreter that run ``profile``'s worker.

    Args:
        profile: the profile (a ``[distributed:NAME]`` section) to run.
        config: the profiles file, as the worker's working directory sees it.
        overrides: profile keys to override, as a mapping or ``"key=value"`` strings.
        resume: continue from the newest complete checkpoint.
        quiet: no progress bar or summary table of the worker's own.
        overwrite: a new run replaces the run in ``output_dir`` (``--overwrite``).
        fresh_if_none: with ``resume``, start afresh when there is nothing to resume.
        run_started: the run's start time, the same for every rank (``--run-started``).

    Raises:
        ValueError: for an empty profile name or a malformed override.
    """
    if not isinstance(profile, str) or not profile.strip():
        raise ValueError(f"profile must be a profile name, got {profile!r}")
    args = ["-m", WORKER_MODULE, "--profile", profile]
    if config is not None:
        args += ["--config", str(config)]
    args += set_args(overrides)
    if run_started is not None:
        args += ["--run-started", run_started]
    if overwrite:
        args.append("--overwrite")
    if fresh_if_none:
        args.append("--fresh-if-none")
    if resume:
        args += RESUME_ARGS
    if quiet:
        args.append("--quiet")
    return args
