"""Check hosts without running anything on them: ``check-hosts`` and the wizard's checks.

A host session alone (``distributed.hosts.session``) connects to every host
and pre-flights it; no profile, program or launcher is involved. SSH files
come from the options given, else from ``$EXOGYM_KNOWN_HOSTS`` and
``$EXOGYM_SSH_CONFIG``, else from ``~/.ssh``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console

from ..hosts.hostsfile import HostsConfig, load_hosts
from ..hosts.preflight import PreflightReport
from ..hosts.session import HostSession
from ..hosts.ssh import SSHConnectError, SSHOptions

#: Environment variables that supply SSH file locations when no option gives them.
KNOWN_HOSTS_ENV = "EXOGYM_KNOWN_HOSTS"
SSH_CONFIG_ENV = "EXOGYM_SSH_CONFIG"


def ssh_files(known_hosts: str | None = None, ssh_config: str | None = None,
              timeout: float | None = None) -> dict[str, Any]:
    """``known_hosts_path``, ``ssh_config_path`` and ``connect_timeout`` (``SSHOptions``
    fields) where one is given or its environment variable is set; absent keys keep
    ``SSHOptions``' defaults."""
    files: dict[str, Any] = {}
    if timeout is not None:
        files["connect_timeout"] = float(timeout)
    known_hosts = known_hosts or os.environ.get(KNOWN_HOSTS_ENV)
    ssh_config = ssh_config or os.environ.get(SSH_CONFIG_ENV)
    if known_hosts:
        files["known_hosts_path"] = known_hosts
    if ssh_config:
        files["ssh_config_path"] = ssh_config
    return files


def check_hosts(
    hosts: str | os.PathLike[str] | HostsConfig,
    console: Console,
    *,
    known_hosts: str | None = None,
    ssh_config: str | None = None,
    accept_new_host_keys: bool = False,
    ssh_timeout: float | None = None,
    show: bool = True,
    trust_new_keys: Callable[[Sequence[SSHConnectError]], bool] | None = None,
) -> PreflightReport:
    """Pre-flight every host of ``hosts`` (``PreflightReport``); raise nothing for a host's failure.

    Args:
        hosts: a hosts file or a loaded ``HostsConfig``.
        console: where the table and messages go.
        known_hosts: the known_hosts file (default ``$EXOGYM_KNOWN_HOSTS`` or ``~/.ssh/known_hosts``).
        ssh_config: the SSH client config (default ``$EXOGYM_SSH_CONFIG`` or ``~/.ssh/config``).
        accept_new_host_keys: trust hosts not yet in known_hosts (recorded once).
        ssh_timeout: seconds to wait for each host's TCP connection, SSH greeting and
            login (default ``SSHOptions.connect_timeout``).
        show: print the report as a table.
        trust_new_keys: asked with the hosts whose keys are not in known_hosts
            yet (unless ``accept_new_host_keys``); when it answers True their
            keys are trusted, recorded, and the check goes on with them.

    Raises:
        HostsFileError: the hosts file is missing or invalid.
    """
    config = hosts if isinstance(hosts, HostsConfig) else load_hosts(hosts)
    options = SSHOptions(**ssh_files(known_hosts, ssh_config, ssh_timeout),
                         accept_new_host_keys=accept_new_host_keys)
    while True:
        with HostSession(config, ssh=options, console=console) as session:
            errors = session.connect()
            unknown = [e for e in errors.values() if e.kind == "unknown-host-key"]
            if not unknown or options.accept_new_host_keys or trust_new_keys is None \
                    or not trust_new_keys(unknown):
                return session.preflight(raise_on_failure=False, show=show)
        options = dataclasses.replace(options, accept_new_host_keys=True)
