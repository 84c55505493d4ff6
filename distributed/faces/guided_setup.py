#!/usr/bin/env python3
"""Guided set-up: find or build a hosts file, choose a profile and a strategy, write the files, train.

    python wizard.py                 # asks; uses ./distributed_hosts.json when there is one
    python wizard.py --hosts my_hosts.json --config my.ini
    python wizard.py --yes           # takes every default, asks nothing (scripts, CI)

Without a hosts file it starts with the machines found on the LAN (those running
``cli_typer.py agent``), trusting each one's host key only after its fingerprint
is confirmed. Every host is checked live (pre-flight over SSH, no training started)
as soon as it is known. For the profile's model, the training steps and the link's
bandwidth (typed, or measured with a one-second transfer to a worker) one
recommendation (``distributed.app.recommend``, what ``cli_typer.py recommend``
computes) gives a table of every candidate's bytes per step and expected speedup
and the pick, which is the default choice; its setting (DiLoCo's H, ...) is
asked with the recommended value. The hosts file and the profile are written
atomically, the profile to ``config.local.ini`` beside ``config.ini`` (the
user's own profiles, ignored by git, read after ``config.ini``), never replacing
anything without asking and always keeping a ``.bak`` of what changes. The run
then starts through ``distributed.app.run``,
exactly as ``cli_typer.py distributed-train`` starts it; with one machine it
is a local simulation.

A face only: the checks, the cost model, the file writing and the run live in
``distributed/``.
"""

from __future__ import annotations

import getpass
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..app.about import command, command_name, wizard_command
from ..app.console import fail, make_console, plural, reported_errors
from ..app.wizard_steps import WORK_ROOT

if TYPE_CHECKING:
    from rich.console import Console

    from ..app.recommend import Recommendation
    from ..app.wizard_steps import HostsConfig, PreflightReport, Profile

DEFAULT_HOSTS_FILE = "distributed_hosts.json"
DEFAULT_PROFILE = "digits-diloco"
DEFAULT_STRATEGY = "diloco"
DEFAULT_MBIT = 100.0
DISCOVERY_TIMEOUT_S = 3.0
COMPARED = ("ddp", "diloco", "sparta", "fedavg", "demo")

# Plain help, as cli_typer.py's: flags bare, option names whole within 80 columns. Typer's
# own --install-completion / --show-completion, for ./wizard.py run by its name.
app = typer.Typer(add_completion=True, pretty_exceptions_enable=False, rich_markup_mode=None)


def show_version(value: bool) -> None:
    """``--version``: print the version line and exit."""
    if value:
        from ..app.about import version_line

        print(version_line(wizard_command().split()[-1]))
        raise typer.Exit()


class Asker:
    """Asks questions with questionary; with ``assume_yes`` it answers each with its
    default instead, and prints the question and that answer so a log shows them.

    Args:
        console: where ``assume_yes`` answers are shown.
        assume_yes: take every default without asking.
    """

    def __init__(self, console: Console, assume_yes: bool) -> None:
        self.console = console
        self.assume_yes = assume_yes
        self.answered = 0  # questions a person answered, to say they are lost on Ctrl-C

    def _took(self, message: str, answer: Any) -> None:
        self.console.print(f"? {message} [bold]{answer}[/] (default)", highlight=False)

    def text(self, message: str, default: str = "",
             validate: Callable[[str], bool | str] | None = None) -> str:
        """A line of text; ``validate`` returns True or the reason it is not accepted."""
        if self.assume_yes:
            self._took(message, default or "(empty)")
            return default
        import questionary

        answer = questionary.text(message, default=default, validate=validate).unsafe_ask()
        self.answered += 1
        return answer.strip()

    def confirm(self, message: str, default: bool = True) -> bool:
        """Yes or no."""
        if self.assume_yes:
            self._took(message, "yes" if default else "no")
            return default
        import questionary

        answer = bool(questionary.confirm(message, default=default).unsafe_ask())
        self.answered += 1
        return answer

    def select(self, message: str, choices: Sequence[tuple[str, Any, str | None]],
               default: Any) -> Any:
        """One of ``choices``: (title, value, why it is disabled or None)."""
        if self.assume_yes:
            self._took(message, next(t for t, v, _ in choices if v == default))
            return default
        import questionary

        options = [questionary.Choice(title, value=value, disabled=why)
                   for title, value, why in choices]
        answer = questionary.select(message, choices=options, default=default).unsafe_ask()
        self.answered += 1
        return answer


def _is_int(low: int, high: int) -> Callable[[str], bool | str]:
    def check(text: str) -> bool | str:
        if text.strip().isdigit() and low <= int(text) <= high:
            return True
        return f"a whole number from {low} to {high}"

    return check


def _is_positive_number(text: str) -> bool | str:
    try:
        return float(text) > 0 or "a number above 0"
    except ValueError:
        return "a number above 0, e.g. 100 or 2.5"


def _is_fraction(text: str) -> bool | str:
    try:
        return 0 < float(text) <= 1 or "a fraction above 0 and at most 1, e.g. 0.005"
    except ValueError:
        return "a fraction above 0 and at most 1, e.g. 0.005"


#: The questions for a strategy's settings, by key: the question, the answer's type, and
#: its check given the run's training steps.
SETTING_QUESTIONS: dict[str, tuple[str, type, Callable[[int], Callable[[str], bool | str]]]] = {
    "H": ("Local steps between two rounds of communication, H (a larger H sends less and may "
          "need more steps for the same loss)", int, lambda steps: _is_int(1, steps)),
    "p_sparta": ("Share of the weights averaged every step, p", float,
                 lambda steps: _is_fraction),
    "compression_topk": ("DCT components sent per chunk, top-k", int,
                         lambda steps: _is_int(1, 10**6)),
    "compression_chunk": ("DCT chunk size", int, lambda steps: _is_int(1, 10**6)),
}


def _default_key() -> str:
    for name in ("id_ed25519", "id_ecdsa", "id_rsa"):
        path = Path.home() / ".ssh" / name
        if path.is_file():
            return f"~/.ssh/{name}"
    return ""


def _this_address() -> str:
    """This machine's address as others see it: its name's address, else (when that is a
    loopback one, as Debian's 127.0.1.1) the address of the interface routes leave by."""
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        address = "127.0.0.1"
    if not address.startswith("127."):
        return address
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # a documentation address: no packet is sent
            return probe.getsockname()[0]
    except OSError:
        return address


class Wizard:
    """One guided set-up and run.

    Args:
        console: where everything is shown.
        ask: how questions are answered.
        hosts_path: the hosts file to use or write.
        config_path: the profiles file to read and write.
        profile, strategy: preselected answers (None: ask).
        overrides: profile keys set on the command line.
        bandwidth_mbit: the link bandwidth (None: ask or measure).
        start: start the run once the files are written.
        run_dir: where the launcher writes the ranks' logs (None: its default).
        ssh: ``known_hosts``, ``ssh_config`` and ``accept_new_host_keys`` for the launcher.
    """

    def __init__(self, console: Console, ask: Asker, hosts_path: Path, config_path: Path,
                 profile: str | None, strategy: str | None, overrides: dict[str, Any],
                 bandwidth_mbit: float | None, start: bool, run_dir: Path | None,
                 ssh: dict[str, Any]) -> None:
        self.console = console
        self.ask = ask
        self.hosts_path = hosts_path
        self.config_path = config_path
        self.profile_name = profile
        self.strategy = strategy
        self.overrides = overrides
        self.bandwidth_mbit = bandwidth_mbit
        self.start = start
        self.run_dir = run_dir
        self.ssh = dict(ssh)
        self.written: list[Path] = []  # files written so far, to say so if cancelled
        self.started = False  # whether training (ranks) started
        self.hosts_ready = True  # whether every host checked so far passed pre-flight

    def cancelled_message(self) -> str:
        """What a Ctrl-C before the run leaves behind, in one line: the files written, and
        that the answers not yet written are not kept."""
        answers = self.ask.answered
        lost = (f" The {plural(answers, 'answer')} given {'is' if answers == 1 else 'are'} not "
                "kept: the wizard asks again from the start next time.") if answers else ""
        if not self.written:
            return "Cancelled; nothing was written." + lost
        return (f"Cancelled; {', '.join(str(p) for p in self.written)} "
                f"{'was' if len(self.written) == 1 else 'were'} written and kept; no training "
                "was started; answers not in them are not kept.")

    # ------------------------------------------------------------------ hosts

    def request(self, hosts: Any, profile: str, **fields: Any) -> Any:
        from ..app.run import TrainRequest

        return TrainRequest(profile=profile, hosts=hosts,
                            known_hosts=self.ssh.get("known_hosts"),
                            ssh_config=self.ssh.get("ssh_config"),
                            accept_new_host_keys=self.ssh.get("accept_new_host_keys", False),
                            **fields)

    def check(self, config: HostsConfig) -> PreflightReport:
        """Pre-flight ``config``'s hosts, offering to trust host keys not yet known."""
        from ..app.hosts_check import check_hosts

        def trust(unknown: Sequence[Any]) -> bool:
            for error in unknown:
                self.console.print(f"[yellow]{error.target.label} is not in known_hosts yet; its "
                                   f"host key is {error.fingerprint}[/]")
            if not self.ask.confirm("Trust these host keys and record them in known_hosts? "
                                    "(compare the fingerprints with the hosts' own)",
                                    default=False):
                return False
            self.ssh["accept_new_host_keys"] = True
            return True

        report = check_hosts(config, self.console, known_hosts=self.ssh.get("known_hosts"),
                             ssh_config=self.ssh.get("ssh_config"),
                             accept_new_host_keys=self.ssh.get("accept_new_host_keys", False),
                             show=False, trust_new_keys=trust)
        self.hosts_ready = self.hosts_ready and report.ok
        return report

    def set_up_hosts(self, hosts_file: Path) -> bool:
        """The last step before training: offer ``setup-hosts`` (the project copied to every
        host, its Python environment made with the locked versions, pre-flight); True when
        it ran and every host is ready. Offered first when a host failed pre-flight."""
        from ..app.setup_hosts import SetupRequest, setup_hosts

        if not self.ask.confirm("Set up the hosts now: copy this project to each one and make "
                                "its Python environment with the locked versions "
                                f"(`{command_name()} setup-hosts {hosts_file}`)?",
                                default=not self.hosts_ready):
            return False
        try:
            setup_hosts(SetupRequest(
                hosts_file, known_hosts=self.ssh.get("known_hosts"),
                ssh_config=self.ssh.get("ssh_config"),
                accept_new_host_keys=self.ssh.get("accept_new_host_keys", False)), self.console)
        except ValueError as exc:  # the hosts' problems, each named
            self.console.print(f"[red]setting up the hosts failed:[/] {exc}", highlight=False)
            return False
        self.hosts_ready = True
        return True

    def show_host_check(self, report: PreflightReport, host: str) -> bool:
        """One line about ``host`` from ``report``; True when it is ready."""
        check = next(c for c in report.checks if c.host == host)
        if check.ok:
            self.console.print(f"  [green]ok[/] {host}: ssh {check.ssh}, Python {check.python}, "
                               f"{check.versions}, code {check.code}, port {check.port}",
                               highlight=False)
            return True
        for problem in check.problems:
            self.console.print(f"  [red]problem[/] {host}: {problem}", highlight=False)
        return False

    def existing_hosts(self) -> HostsConfig | None:
        """The hosts file found, shown and checked; None to build one or simulate instead."""
        from rich.table import Table

        from ..app.wizard_steps import HostsFileError, load_hosts

        try:
            config = load_hosts(self.hosts_path)
        except HostsFileError as exc:
            self.console.print(f"[red]{exc}[/]", highlight=False)
            if self.ask.assume_yes:
                fail(f"{self.hosts_path} is not a valid hosts file (see above); fix it, or run "
                     "the wizard without --yes to build a new one", 2, False)
            return None
        table = Table(title=f"Hosts in {self.hosts_path}", title_justify="left")
        for name in ("ranks", "host", "ssh user", "python", "project"):
            table.add_column(name)
        for h in config.hosts:
            ranks = str(h.ranks[0]) if h.slots == 1 else f"{h.ranks[0]}-{h.ranks[-1]}"
            table.add_row(ranks, h.label, h.ssh_user or "-", h.python_env, h.project_path)
        self.console.print(table)
        these = ("this host" if len(config.hosts) == 1
                 else f"these {plural(len(config.hosts), 'host')}")
        if not self.ask.confirm(f"Use {these} ({plural(config.world_size, 'rank')})?",
                                default=True):
            return None
        self.console.print("Checking every host (pre-flight)...")
        report = self.check(config)
        report.render(self.console)
        if not report.ok:
            if self.ask.assume_yes:
                failed = sum(not c.ok for c in report.checks)
                fail(f"{failed} of {plural(len(config.hosts), 'host')} "
                     f"{'is' if failed == 1 else 'are'} not ready (each problem above names the "
                     "host and the fix); fix them and run again, or use "
                     f"{command('distributed-train', '--local')} to simulate",
                     2, False)
            if not self.ask.confirm("Continue anyway? (the run's own pre-flight will stop it "
                                    "if the problems remain)", default=False):
                return None
        return config

    def build_hosts(self) -> HostsConfig | None:
        """Ask for the hosts, checking each as it is added; None for one machine."""
        from ..app.wizard_steps import (
            HostsFileError,
            is_loopback,
            is_other_machine,
            load_hosts,
            with_paths,
        )

        where = self.ask.select("Where should it train?", [
            ("On this machine only: simulate the nodes here", "local", None),
            ("On several machines, over SSH", "hosts", None)], default="local")
        if where == "local":
            return None
        self.console.print("Settings every host shares (a host can differ later in the file):")
        # Each answer is checked as a hosts file would be, at its own question: a problem
        # is shown there and the question asked again, never after every other question.
        mapping: dict[str, Any] = {"master": "127.0.0.1", "workers": []}

        def answer(key: str, question: str, default: str,
                   check: Callable[[str], bool | str] | None = None) -> None:
            def valid(text: str) -> bool | str:
                said = check(text) if check is not None else True
                if said is not True:
                    return said
                value: Any = int(text) if key.endswith("port") else text.strip()
                trial = {**mapping, key: value} if value != "" else \
                    {k: v for k, v in mapping.items() if k != key}
                try:
                    load_hosts(with_paths(trial)[0])
                except HostsFileError as exc:
                    return " ".join(str(exc).split())
                return True

            text = self.ask.text(question, default, valid)
            if text != "":
                mapping[key] = int(text) if key.endswith("port") else text
            else:
                mapping.pop(key, None)

        answer("ssh_user", "SSH user on the workers:", getpass.getuser())
        answer("ssh_key_path", "SSH private key (empty: the SSH agent and ~/.ssh defaults):",
               _default_key())
        answer("ssh_port", "SSH port of the workers:", "22", _is_int(1, 65535))
        answer("python_env", "Python on every host (path to the interpreter; empty: this "
               "machine's own here, and setup-hosts makes one on each other host):",
               sys.executable)
        answer("project_path", "This project's checkout on every host (empty: this one here, "
               "and setup-hosts copies it to ~/exogym on each other host):", str(WORK_ROOT))
        answer("master", "Address of the master, which runs rank 0 (the workers must reach "
               "it):", _this_address())
        answer("master_port", "Training port on the master:", "29500", _is_int(1, 65535))
        master = mapping["master"]
        config = load_hosts(with_paths(mapping)[0])
        self.console.print(f"Checking the master {master}...")
        self.show_host_check(self.check(config), master)
        while True:
            number = len(mapping["workers"]) + 1
            address = self.ask.text(f"Address of worker {number} (empty when done):", "")
            if not address:
                break
            if is_loopback(mapping["master"]) and is_other_machine(address):
                self.console.print(
                    f"[red]The master {mapping['master']} is a loopback address, which only the "
                    f"master itself can reach; worker {address} is another machine and could "
                    "never connect to it.[/] Give the master's address on the workers' network.",
                    highlight=False)
                mapping["master"] = self.ask.text(
                    "Address of the master, which runs rank 0 (the workers must reach it):",
                    _this_address(), lambda t: not is_loopback(t.strip()) or
                    f"{t.strip()} is a loopback address: the workers cannot reach it")
                self.console.print(f"Checking the master {mapping['master']}...")
                self.show_host_check(self.check(load_hosts(with_paths(
                    {**mapping, "workers": []})[0])), mapping["master"])
            trial = {**mapping, "workers": [*mapping["workers"], address]}
            try:
                load_hosts(with_paths(trial)[0])
            except HostsFileError as exc:
                self.console.print(f"[red]{exc}[/]", highlight=False)
                continue
            self.console.print(f"Checking {address}...")
            pair, filled = with_paths({**mapping, "workers": [address]})
            to_set_up = address in filled
            if to_set_up:
                self.console.print(f"  {address} gets this project and its Python from "
                                   "setup-hosts, offered before training: until then "
                                   "pre-flight finds neither there.", highlight=False)
            if self.show_host_check(self.check(load_hosts(pair)), address) or self.ask.confirm(
                    f"Keep {address} anyway?", default=to_set_up):
                mapping = trial
        if not mapping["workers"]:
            self.console.print("No workers: the run will be a simulation on this machine.")
            return None
        return load_hosts(with_paths(mapping)[0])

    def hosts(self) -> HostsConfig | None:
        """The hosts to train on, or None for a local simulation."""
        if self.hosts_path.is_file():
            found = self.existing_hosts()
            if found is not None:
                return found
        else:
            self.console.print(f"No hosts file at {self.hosts_path}.")
        found = self.discovered_hosts()
        if found is not None:
            return found
        return self.build_hosts()

    def discovered_hosts(self) -> HostsConfig | None:
        """The machines found on the LAN, if the person wants them, each host key confirmed
        and every host checked live; None to go on as without discovery."""
        from ..app.discovery import (
            DiscoveryError,
            find_machines,
            hosts_mapping,
            other_machines,
        )
        from ..app.wizard_steps import HostsFileError, load_hosts

        self.console.print(f"Looking for machines on the LAN ({DISCOVERY_TIMEOUT_S:g} s)...")
        try:
            machines = other_machines(find_machines(DISCOVERY_TIMEOUT_S))
        except DiscoveryError as exc:
            self.console.print(f"[yellow]No LAN discovery: {exc}[/]", highlight=False)
            return None
        if not machines:
            self.console.print(f"No other machines found (run `{command('agent')}` on a "
                               "machine to make it findable).")
            return None
        many = len(machines) > 1
        if not self.ask.confirm(
                f"I found {plural(len(machines), 'other machine')}: "
                f"{', '.join(m.summary for m in machines)}. Use {'them' if many else 'it'}?",
                default=True):
            return None
        trusted = [m for m in machines if self.trust_host_key(m)]
        if not trusted:
            self.console.print("No machine's host key was trusted; set the hosts up by hand.")
            return None
        master = self.ask.text("Address of this machine, the master, which runs rank 0 (the "
                               "workers must reach it):", _this_address())
        port = int(self.ask.text("Training port on the master:", "29500", _is_int(1, 65535)))
        key = self.ask.text("SSH private key for the workers (empty: the SSH agent and "
                            "~/.ssh defaults):", _default_key())
        mapping = hosts_mapping(master, trusted, master_port=port, ssh_user=getpass.getuser(),
                                python_env=sys.executable, project_path=str(WORK_ROOT),
                                **({"ssh_key_path": key} if key else {}))
        try:
            config = load_hosts(mapping)
        except HostsFileError as exc:  # said here, and the hosts then asked for one by one
            self.console.print(f"[red]{exc}[/]", highlight=False)
            return None
        self.console.print("Checking every host (pre-flight)...")
        report = self.check(config)
        for host in config.hosts:
            self.show_host_check(report, host.host)
        if not report.ok and not self.ask.confirm(
                "Continue anyway? (the run's own pre-flight will stop it if the problems "
                "remain)", default=False):
            return None
        return config

    def trust_host_key(self, machine: Any) -> bool:
        """Show ``machine``'s SSH host key fingerprint and record it in known_hosts when the
        person says yes (or with --accept-new-host-keys); False to skip the machine."""
        from ..app.discovery import fetch_host_key, is_known, ssh_options, trust_host_key

        options = ssh_options(self.ssh.get("known_hosts"))
        address = machine.addresses[0]
        try:
            key = fetch_host_key(address, machine.ssh_port)
        except OSError as exc:
            self.console.print(f"[red]Skipping {machine.name}: {exc}[/]", highlight=False)
            return False
        if is_known(options, key):
            return True
        self.console.print(f"The authenticity of host '{key.name}' ({machine.name}) can't be "
                           f"established.\n{key.algorithm} key fingerprint is {key.fingerprint}.",
                           highlight=False, markup=False)
        if self.ssh.get("accept_new_host_keys") or self.ask.confirm(
                f"Trust {machine.name}'s host key and record it in {options.known_hosts}? "
                "(compare it with `ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` there)",
                default=False):
            trust_host_key(options, key)
            return True
        self.console.print(f"Skipping {machine.name}: its host key was not trusted.")
        return False

    # ------------------------------------------------------------------ profile and strategy

    def choose_profile(self, across_hosts: bool = False) -> Profile:
        """The profile to train: asked, or the one given, refused at once when it cannot
        run. A profile whose task needs an extra this machine lacks cannot be simulated
        here; across hosts it is marked (the hosts may have the extra)."""
        from ..app.wizard_steps import list_profiles, load_profile

        path, entries = list_profiles(self.config_path)

        def why_not(entry: Any) -> str | None:
            if entry.why_not is None and entry.needs and not across_hosts:
                return f"needs {entry.needs}"
            return entry.why_not

        def title(entry: Any) -> str:
            said = f"{entry.name}: {entry.row['description'] or entry.row['task']}"
            return f"{said} (the hosts need {entry.needs})" if entry.needs and across_hosts \
                else said

        choices = [(title(e), e.name, why_not(e)) for e in entries]
        usable = [v for _, v, why in choices if why is None]
        if not usable:
            fail(f"no profile in {path} can run here (see `{command('profiles')}`)",
                 2, False)
        chosen = {v: why for _, v, why in choices}
        if self.profile_name and chosen.get(self.profile_name):
            # Said now, before any question: not after them all and "Start training now?".
            fail(f"profile {self.profile_name} cannot run here: {chosen[self.profile_name]}",
                 2, False)
        default = self.profile_name or (DEFAULT_PROFILE if DEFAULT_PROFILE in usable
                                        else usable[0])
        name = default if self.profile_name else self.ask.select(
            "Which profile (task and settings) should train?", choices, default=default)
        return load_profile(name, path)  # names the close ones when there is no such profile

    def bandwidth(self, hosts: HostsConfig | None) -> float:
        """The link's bandwidth in Mbit/s: given, measured, or typed."""
        if self.bandwidth_mbit is not None:
            return self.bandwidth_mbit
        if hosts is not None and hosts.workers:
            worker = hosts.workers[0]
            how = self.ask.select("The link between the machines: how fast is it?", [
                (f"Measure it: one second of TCP from here to {worker.host}", "measure", None),
                ("Type it (Mbit/s)", "type", None)], default="measure")
        else:
            how = "type"
            self.console.print("The estimates need the speed of the link between the machines; "
                               "with no worker to measure the link to (the nodes are simulated "
                               "here), type the speed to assume.", highlight=False)
        if how == "measure":
            from ..app.wizard_steps import LinkError, measure_link_to

            try:
                measured = measure_link_to(hosts, self.ssh.get("known_hosts"),
                                           self.ssh.get("ssh_config"))
            except LinkError as exc:
                self.console.print(f"[yellow]could not measure the link: {exc}[/]")
            else:
                self.console.print(f"Measured {measured.mbit_per_s:,.0f} Mbit/s to "
                                   f"{measured.host} ({measured.bytes / 1e6:,.0f} MB in "
                                   f"{measured.seconds:.2f} s).")
                return measured.mbit_per_s
        return float(self.ask.text("Bandwidth between the machines, in Mbit/s (Wi-Fi: ~100, "
                                   "gigabit Ethernet: 1000):", f"{DEFAULT_MBIT:g}",
                                   _is_positive_number))

    def estimates(self, profile: Profile, nodes: int, steps: int, mbit: float,
                  hosts: HostsConfig | None) -> Recommendation | None:
        """Time this machine's steps once, then show every candidate strategy's predicted step,
        traffic and speedup and the one picked, all from that one recommendation (what
        ``python cli_typer.py recommend`` computes); None when it cannot be made here."""
        from rich.table import Table

        from ..app.console import stage_progress
        from ..app.recommend import recommend, table_rows, what_it_sends

        self.console.print(f"Timing a step of {profile.name}'s model, and each strategy's own "
                           "work, on this machine...", highlight=False)
        request = self.request(hosts, profile.name, config=str(self.config_path),
                               overrides={**self.overrides, "num_nodes": nodes,
                                          "max_steps": steps})
        try:
            with stage_progress(self.console, "Timing") as progress:
                rec = recommend(request, self.console, link_mbit=mbit, time_hosts=False,
                                new_profile=True, progress=progress)
        except Exception as exc:  # noqa: BLE001 - the estimates are a help, not a requirement
            self.console.print(f"[yellow]no estimates ({exc}); the strategies are offered "
                               "without them[/]", highlight=False)
            return None
        m = rec.measurements
        where = "machines" if hosts is not None else "simulated nodes"
        self.console.print(
            f"{m.num_params:,} parameters; an AdamW step takes {m.compute_s['ddp'] * 1000:.1f} "
            f"ms here. Estimates for {nodes} machines at {mbit:g} Mbit/s (this machine's step "
            f"standing in for each of the {nodes} {where}):", highlight=False)
        table = Table(title_justify="left")
        for column in ("strategy", "what it sends", "step", "comm", "sent per step",
                       "speedup (vs 1 machine)", ""):
            table.add_column(column, justify="left" if column in ("strategy", "what it sends", "")
                             else "right")
        previous = None
        for candidate, cells in zip(rec.candidates, table_rows(rec)):
            label, step, comm, speedup, sent, note = cells
            said = "" if candidate.name == previous else what_it_sends(candidate.name)
            previous = candidate.name
            table.add_row(label, said, step, comm, sent, speedup, note)
        self.console.print(table)
        self.console.print(f"Recommended: {rec.reason}", markup=False, highlight=False,
                           soft_wrap=True)
        if rec.noise:
            self.console.print(f"Note: {rec.noise}", markup=False, highlight=False,
                               soft_wrap=True)
        return rec

    def choose_strategy(self, base: Profile, rec: Recommendation | None
                        ) -> tuple[str, dict[str, Any]]:
        """The strategy to write and its settings: a candidate of ``rec`` (the pick unless
        another is chosen, or ``--strategy``'s best), else one the profile can run."""
        from ..app.recommend import figures, pick
        from ..app.wizard_steps import same_strategy, usable_strategies

        if rec is None:
            usable = usable_strategies(base, COMPARED)
            if self.strategy:
                return self.strategy, {}
            default = DEFAULT_STRATEGY if DEFAULT_STRATEGY in usable else usable[0]
            return self.ask.select("Which strategy?", [
                (s, s, None if s in usable else "not available for this task")
                for s in COMPARED], default=default), {}
        if self.strategy:
            mine = [c for c in rec.candidates if same_strategy(c.name, self.strategy)]
            if not any(c.applies for c in mine):
                return self.strategy, {}  # not among the candidates: its profile's settings
            chosen = pick(mine)
            self.console.print(f"Strategy {self.strategy} (--strategy): {chosen.label}, "
                               f"{chosen.speedup:.2f}x predicted.", highlight=False)
        else:
            label = self.ask.select("Which strategy?", [
                (f"{c.label}: {figures(c)}" + (" (recommended)" if c is rec.pick else ""),
                 c.label,
                 None if c.applies else "not available for this task")
                for c in rec.candidates], default=rec.pick.label)
            chosen = next(c for c in rec.candidates if c.label == label)
        return chosen.name, dict(chosen.settings)

    def strategy_settings(self, strategy: str, settings: dict[str, Any], steps: int,
                          rec: Recommendation | None) -> dict[str, Any]:
        """Ask for each of the strategy's settings the estimates chose (DiLoCo's H, ...),
        offering the recommended value (or ``--set``'s); a changed one is predicted again."""
        from ..app.recommend import figures, predict_with

        answered = {}
        for key, recommended in settings.items():
            question = SETTING_QUESTIONS.get(key)
            if question is None:
                answered[key] = self.overrides.get(key, recommended)
                continue
            text, kind, check = question
            default = self.overrides.get(key, recommended)
            answer = self.ask.text(f"{text}:", f"{default:g}" if kind is float else str(default),
                                   check(steps))
            answered[key] = kind(answer)
        if rec is not None and answered != settings:
            changed = predict_with(rec, strategy, answered)
            self.console.print(f"{changed.label}: communication is {changed.comm_fraction:.0%} "
                               f"of the step; {figures(changed)} (recommended: "
                               f"{rec.pick.label}, {figures(rec.pick)}).", highlight=False)
        return answered

    # ------------------------------------------------------------------ files and run

    def write_hosts(self, config: HostsConfig) -> Path:
        from ..app.wizard_steps import same_hosts, write_hosts_file

        path = self.hosts_path
        if path.exists() and same_hosts(path, config):
            self.console.print(f"Using {path} as it is.")
            return path
        while path.exists() and not same_hosts(path, config):
            if self.ask.confirm(f"{path} exists with other hosts. Replace it (the old one is kept "
                                f"as {path.name}.bak)?", default=self.ask.assume_yes):
                break
            path = Path(self.ask.text("Write the hosts file where instead?",
                                      str(path.with_name("distributed_hosts.new.json"))))
        backup = write_hosts_file(path, config)
        self.written.append(path)
        self.console.print(f"Wrote {path}" + (f" (previous one in {backup})" if backup else ""))
        return path

    @property
    def local_profiles(self) -> Path:
        """Where profiles are written: the local profiles file beside the config file."""
        from ..app.wizard_steps import local_profiles_file

        return local_profiles_file(self.config_path)

    def write_profile(self, name: str, values: dict[str, Any], suggested: str) -> str:
        """Write profile ``name`` to the local profiles file (``config.local.ini``), asking
        before replacing another; ``suggested``: the name that says what it runs, offered
        (made free) when ``name`` is taken."""
        from ..app import wizard_steps

        local = self.local_profiles
        while True:
            current = wizard_steps.existing_profile(self.config_path, name)
            if current is None:
                break
            where = wizard_steps.profile_file(self.config_path, name)
            if current == values:
                self.console.print(f"Profile {name} in {where} already has these settings.")
                return name
            if where == local:
                question = (f"Profile {name} already exists in {local}. Replace it (the file is "
                            f"kept as {local.name}.bak)?")
            else:
                question = (f"Profile {name} already exists in {where}. Put yours in {local} "
                            f"in its place ({where.name if where else ''} stays as it is)?")
            if self.ask.confirm(question, default=self.ask.assume_yes):
                break
            name = self.ask.text("Name of the new profile instead:",
                                 wizard_steps.free_profile_name(self.config_path, suggested, values),
                                 lambda t: bool(t.strip()) or "a name, e.g. my-run")
        path, backup = wizard_steps.write_profile(self.config_path, name, values)
        self.written.append(path)
        self.console.print(f"Wrote profile [bold]{name}[/] to {path}"
                           + (f" (previous file in {backup})" if backup else "")
                           + f": your own profiles, read after {self.config_path.name} and "
                           "ignored by git", highlight=False)
        return name

    def run(self) -> int:
        from ..app import run
        from ..app.compare import profile_for_strategy
        from ..app.recommend import spec_for
        from ..app.wizard_steps import free_profile_name, load_profile, profile_name_for

        self.console.rule("exogym set-up")
        hosts = self.hosts()
        base = self.choose_profile(across_hosts=hosts is not None)
        if hosts is not None:
            nodes = hosts.world_size
        else:
            nodes = int(self.ask.text("How many nodes to simulate?",
                                      str(self.overrides.get("num_nodes",
                                                             base.values.get("num_nodes", 2))),
                                      _is_int(1, 64)))
        # Before the estimates: DiLoCo's H is chosen below the run's length.
        steps = int(self.ask.text("Training steps:", str(self.overrides.get(
            "max_steps", base.values.get("max_steps", 100))), _is_int(1, 10**9)))
        mbit = self.bandwidth(hosts)
        rec = self.estimates(base, nodes, steps, mbit, hosts)
        strategy, settings = self.choose_strategy(base, rec)
        settings = self.strategy_settings(strategy, settings, steps, rec)
        overrides = {**self.overrides, "max_steps": steps, "num_nodes": nodes, **settings}
        values = profile_for_strategy(base, strategy, overrides).values
        label = spec_for(strategy, settings).label if settings else strategy
        values["description"] = (f"{base.name} with {label} on {nodes} "
                                 f"{'hosts' if hosts is not None else 'simulated nodes'} "
                                 f"(written by {wizard_command()})")
        suggested = profile_name_for(base, strategy, nodes, hosts is not None)
        name = self.ask.text("Name of the profile to write:",
                             free_profile_name(self.config_path, suggested, values),
                             lambda t: bool(t.strip()) or "a name, e.g. my-run")
        name = self.write_profile(name, values, suggested)
        load_profile(name, self.config_path)  # what was written reads back as a valid profile

        sync = False
        hosts_file: Path | None = None
        if hosts is not None:
            hosts_file = self.write_hosts(hosts)
            if not self.set_up_hosts(hosts_file):
                inside = self.config_path.resolve().is_relative_to(WORK_ROOT)
                sync = self.ask.confirm(f"Copy this project's files and your profiles "
                                        f"({self.local_profiles.name}) to the workers first?",
                                        default=inside)
        request = self.request(hosts_file, name, config=str(self.config_path), sync=sync,
                               run_dir=str(self.run_dir) if self.run_dir else None)
        self.console.print("The same run from the command line: [bold]"
                           + run.train_command(request) + "[/]", highlight=False, soft_wrap=True)
        if not self.start or not self.ask.confirm("Start training now?", default=True):
            self.console.print("Not started; run the command above when ready.")
            return 0
        self.started = True
        outcome = run.train(request, self.console)
        self.console.print(outcome.message, highlight=False)
        return 0


@app.command()
def main(
    ctx: typer.Context,
    hosts: Annotated[Path | None, typer.Option(
        "--hosts", "-H", dir_okay=False,
        help=f"Hosts file to use, or to write (default ./{DEFAULT_HOSTS_FILE}).")] = None,
    config: Annotated[Path | None, typer.Option(
        "--config", "-c", dir_okay=False,
        help="Profiles file to read (default: the project's config.ini); the profile is "
             "written to the local profiles file beside it (config.local.ini).")] = None,
    profile: Annotated[str | None, typer.Option(
        "--profile", "-p", help="Profile to start from (default: ask; digits-diloco).")] = None,
    strategy: Annotated[str | None, typer.Option(
        "--strategy", help="Strategy to use, with its recommended settings (default: ask; "
                           "the recommended one).")] = None,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", "-s", metavar="KEY=VALUE", help="Override a profile key (repeatable).")
    ] = None,
    bandwidth_mbit: Annotated[float | None, typer.Option(
        "--bandwidth-mbit", min=0.001,
        help="Link bandwidth for the estimates, in Mbit/s (default: ask or measure).")] = None,
    yes: Annotated[bool, typer.Option(
        "--yes", "-y", help="Take every default and ask nothing (scripts, CI).")] = False,
    start: Annotated[bool, typer.Option(
        "--run/--no-run", help="Start training once the files are written.")] = True,
    run_dir: Annotated[Path | None, typer.Option(
        "--run-dir", file_okay=False, help="Where the ranks' logs go (hosts only).")] = None,
    known_hosts: Annotated[str | None, typer.Option(
        "--known-hosts", envvar="EXOGYM_KNOWN_HOSTS",
        help="known_hosts file for host keys (default ~/.ssh/known_hosts).")] = None,
    ssh_config: Annotated[str | None, typer.Option(
        "--ssh-config", envvar="EXOGYM_SSH_CONFIG",
        help="OpenSSH client config to honour (default ~/.ssh/config).")] = None,
    accept_new_host_keys: Annotated[bool, typer.Option(
        "--accept-new-host-keys", help="Trust hosts not yet in known_hosts without asking.")
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show the full traceback of an error."
                                        )] = False,
    version: Annotated[bool, typer.Option(
        "--version", callback=show_version, is_eager=True, expose_value=False,
        help="Show the version (exogym's, the checkout's commit, Python's) and exit.")
    ] = False,
) -> None:
    """Set up and start a training run, step by step."""
    ctx.obj = {"debug": debug}
    console = make_console()
    if not yes and not (sys.stdin.isatty() and sys.stdout.isatty()):
        fail("the wizard asks questions and needs a terminal; run it in one, or pass --yes to "
             "take every default without asking (for scripts and CI)", 2, debug)
    with reported_errors(ctx, debug):
        from ..app.wizard_steps import DEFAULT_CONFIG, parse_overrides

        wizard = Wizard(
            console, Asker(console, yes),
            hosts_path=hosts or Path(DEFAULT_HOSTS_FILE), config_path=config or DEFAULT_CONFIG,
            profile=profile, strategy=strategy, overrides=parse_overrides(set_),
            bandwidth_mbit=bandwidth_mbit, start=start, run_dir=run_dir,
            ssh={"known_hosts": known_hosts, "ssh_config": ssh_config,
                 "accept_new_host_keys": accept_new_host_keys})
        try:
            code = wizard.run()
        except KeyboardInterrupt as exc:
            if wizard.started:
                raise  # the run's own handling: ranks stopped, as the CLI says
            fail(wizard.cancelled_message(), 130, debug, exc)
        raise typer.Exit(code)


if __name__ == "__main__":
    app()
