"""The hosts file: which machines run a multi-host job, and how to reach each one.

A hosts file is JSON. The short form most users write::

    {
      "master": "192.168.1.100",
      "workers": ["192.168.1.101", "192.168.1.102"],
      "ssh_user": "alice",
      "ssh_key_path": "~/.ssh/id_rsa",
      "python_env": "/home/alice/venv/bin/python",
      "project_path": "/home/alice/gym"
    }

Rank 0 runs on the master, ranks 1.. on the workers in the order listed.
A host may run several ranks (one per GPU of a multi-GPU box, say) with
``"slots": N``, as in DeepSpeed's hostfile: the world size is the sum of the
slots, and global ranks are numbered host by host (the master's slots first).
Optional ``master_port`` is the port of the training process group on the
master. Without it a run takes 29500 when that is free on the master, and
otherwise a free port the master's system picks (pre-flight says which).
Every per-host key may also be given at the top level, where it is the
default for every host. The master and any worker may be an
object instead of an address, to override those defaults for that host::

    {"host": "192.168.1.102", "ssh_port": 2222, "python_env": "/opt/py/bin/python",
     "interface": "en0", "device": "mps", "slots": 1}

A master given as a loopback address (127.x, ``localhost``) cannot serve
workers on other machines; that is refused, naming both.

``load_hosts`` validates the whole file and reports every problem at once in a
single ``HostsFileError``, each line naming the field, the value and the fix.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import os
import posixpath
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exogym.base.escapes import unprintable
from exogym.base.install_mode import hosts_file_help
from exogym.base.limits import MAX_NUM_NODES
from exogym.base.plural import plural

DEFAULT_MASTER_PORT = 29500
#: The largest hosts file read: a host takes a line or a few.
MAX_HOSTS_FILE_BYTES = 1 << 20

#: Keys a host object accepts. All but ``host`` may also be top-level defaults.
HOST_KEYS = (
    "host",
    "ssh_port",
    "ssh_user",
    "ssh_key_path",
    "python_env",
    "project_path",
    "interface",
    "device",
    "slots",
)
#: Keys the top level of a hosts file accepts.
TOP_KEYS = ("master", "workers", "master_port") + tuple(k for k in HOST_KEYS if k != "host")

_DEVICE_RE = re.compile(r"^(cpu|mps|auto|cuda(:\d+)?)$")
_INTERFACE_RE = re.compile(r"^[A-Za-z0-9_.:@-]{1,64}$")

#: Host fields beyond the strings: (key, whether a value is accepted, what it must be).
_CHECKED_FIELDS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("interface", lambda v: isinstance(v, str) and bool(_INTERFACE_RE.match(v)),
     "a network interface name such as eth0 or en0"),
    ("device", lambda v: isinstance(v, str) and bool(_DEVICE_RE.match(v)),
     "one of cpu, cuda, cuda:N, mps, auto"),
    ("slots", lambda v: isinstance(v, int) and not isinstance(v, bool)
     and 1 <= v <= MAX_NUM_NODES,
     f"the number of ranks to run on the host, an integer from 1 to {MAX_NUM_NODES} (the "
     "most ranks a run may have; e.g. its GPU count)"),
)

JsonPath = tuple  # a JSON path: keys (str) and list indices (int)

#: Folders of the system that no project or environment of ours goes into (nor below them).
SYSTEM_FOLDERS = ("/bin", "/boot", "/dev", "/etc", "/proc", "/run", "/sbin", "/sys", "/usr",
                  "/var", "/System")
#: Folders whose children are the users' home folders.
HOME_PARENTS = ("/home", "/Users")


def unsafe_folder(path: str) -> str | None:
    """Why the folder ``path`` on a host (absolute, ``~/...``, or relative to the login
    folder, the home) must not take a project or an environment; None when it may.

    Refused: the filesystem's root, the system's folders and everything in them
    (:data:`SYSTEM_FOLDERS`, ``/lib*``), a home folder itself (``~``, ``.``, ``/root``,
    ``/home/NAME``, ``/Users/NAME``) or the folder of homes, and a path that climbs out of
    the home (``~/..``): setup-hosts copies the project there and makes its environment,
    which would write over or among the system's own files.
    """
    raw = path.strip()
    home_relative = raw.startswith("~") or raw.startswith("$HOME") or not raw.startswith("/")
    if home_relative:
        rest = raw.partition("/")[2] if raw.startswith(("~", "$HOME")) else raw
        norm = posixpath.normpath(rest) if rest else "."
        if norm == ".":
            return "it is the home folder itself"
        if norm == ".." or norm.startswith("../"):
            return "it climbs out of the home folder"
        return None
    norm = "/" + posixpath.normpath(raw).lstrip("/")
    if norm == "/":
        return "it is the filesystem's root"
    parts = norm.split("/")[1:]
    top = "/" + parts[0]
    lowered = top.lower()  # a Mac's disk ignores case: /USR is /usr
    if lowered in (f.lower() for f in SYSTEM_FOLDERS) or re.fullmatch(r"/lib\w*", lowered):
        return f"it is {'the' if len(parts) == 1 else 'inside the'} system folder {top}"
    if lowered in (f.lower() for f in HOME_PARENTS) and len(parts) <= 2:
        return "it is a home folder itself" if len(parts) == 2 else \
            "it is the folder of the home folders"
    if lowered == "/root" and len(parts) == 1:
        return "it is root's home folder itself"
    return None


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches: 127.x, ::1 or ``localhost``."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_other_machine(host: str) -> bool:
    """True when ``host`` is surely not this machine's loopback: an IP address outside
    127.x/::1. A name is not resolved here (it may be an SSH alias), so it is not judged."""
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class HostsFileError(ValueError):
    """A hosts file that cannot be used, with every problem found in it.

    Args:
        problems: one self-contained message per problem, each naming the
            field, the value found and what to do.
        source: the file the problems were found in, if any.
    """

    def __init__(self, problems: list[str], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        where = f" {source}" if source else ""
        count = len(self.problems)
        header = f"invalid hosts file{where} ({plural(count, 'problem')}):"
        super().__init__("\n".join([header, *("  " + p for p in self.problems)]))


@dataclass(frozen=True)
class HostSpec:
    """One host of a job, how to reach it, and the ranks it runs.

    Args:
        rank: the host's index in the job (0 is the master): its ``NODE_RANK``,
            and the rank it runs when every host has one slot.
        host: address or ``~/.ssh/config`` alias of the host.
        ssh_port: SSH port, or ``None`` for ``~/.ssh/config``'s ``Port`` or 22.
        ssh_user: login user, or ``None`` for ``~/.ssh/config``'s ``User`` or
            the local user name.
        ssh_key_path: private key file, or ``None`` for the agent, the
            ``IdentityFile`` of ``~/.ssh/config`` and the default key files.
        python_env: the Python interpreter on that host (path or command).
        project_path: the checkout of this project on that host; ranks start there.
        interface: network interface the rank must use for training traffic
            (``GLOO_SOCKET_IFNAME``), or ``None`` to let the rank pick the one
            that routes to the master.
        device: torch device for the rank (``cpu``, ``cuda``, ``cuda:N``,
            ``mps``, ``auto``), or ``None`` for the run's default.
        slots: how many ranks run on this host (each with its own
            ``LOCAL_RANK``; on CUDA each takes ``cuda:LOCAL_RANK``).
        first_rank: the global rank of its first slot; ``None``: ``rank``.
    """

    rank: int
    host: str
    python_env: str
    project_path: str
    ssh_port: int | None = None
    ssh_user: str | None = None
    ssh_key_path: str | None = None
    interface: str | None = None
    device: str | None = None
    slots: int = 1
    first_rank: int | None = None

    def __post_init__(self) -> None:
        if self.first_rank is None:
            object.__setattr__(self, "first_rank", self.rank)

    @property
    def ranks(self) -> range:
        """The global ranks this host runs, one per slot."""
        assert self.first_rank is not None
        return range(self.first_rank, self.first_rank + self.slots)

    @property
    def label(self) -> str:
        """``host`` or ``host:port`` when a port is given: how messages name this host."""
        return self.host if self.ssh_port is None else f"{self.host}:{self.ssh_port}"

    def to_dict(self) -> dict[str, Any]:
        """The host as a hosts-file object (``rank`` left out: it is the position)."""
        out: dict[str, Any] = {"host": self.host}
        for key in HOST_KEYS[1:]:
            value = getattr(self, key)
            if value is not None and not (key == "slots" and value == 1):
                out[key] = value
        return out


@dataclass(frozen=True)
class HostsConfig:
    """A validated hosts file: every host of a job, ordered by rank.

    Args:
        hosts: the hosts in order, the master first; ``hosts[i].rank == i``.
        master_port: port of the training process group on the master; when
            ``master_port_given`` is false, only the first choice (pre-flight takes
            another free one when it is taken, see ``distributed.hosts.preflight``).
        source: the file it was read from, if any.
        master_port_given: whether the hosts file names the port, so that the run
            must use exactly that one.
    """

    hosts: tuple[HostSpec, ...]
    master_port: int = DEFAULT_MASTER_PORT
    source: str | None = None
    master_port_given: bool = True

    @property
    def master(self) -> HostSpec:
        """The host that runs rank 0."""
        return self.hosts[0]

    @property
    def workers(self) -> tuple[HostSpec, ...]:
        """The hosts that run ranks 1 and up."""
        return self.hosts[1:]

    @property
    def world_size(self) -> int:
        """Number of ranks: the sum of every host's slots."""
        return sum(h.slots for h in self.hosts)

    @property
    def rank_hosts(self) -> tuple[HostSpec, ...]:
        """The host of every rank, in rank order (a host once per slot)."""
        return tuple(h for h in self.hosts for _ in range(h.slots))

    def host_of(self, rank: int) -> HostSpec:
        """The host that runs global rank ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in 0..{self.world_size - 1} (the hosts file "
                             f"runs {plural(self.world_size, 'rank')})")
        return self.rank_hosts[rank]

    def to_dict(self) -> dict[str, Any]:
        """The config as a hosts-file object that ``load_hosts`` reads back unchanged."""
        data: dict[str, Any] = {
            "master": self.master.to_dict(),
            "workers": [w.to_dict() for w in self.workers],
        }
        if self.master_port_given:
            data["master_port"] = self.master_port
        return data


def load_hosts(source: str | os.PathLike[str] | Mapping[str, Any]) -> HostsConfig:
    """Read and validate a hosts file (a path) or an already-parsed mapping.

    Returns:
        The ``HostsConfig``, hosts in rank order.

    Raises:
        HostsFileError: listing every problem found (unreadable file, invalid
            JSON, missing or unknown keys, wrong types, bad ports, duplicates).
    """
    if isinstance(source, Mapping):
        return _Validator(dict(source), lines={}, source=None).run()
    path = Path(source).expanduser()
    try:
        size = path.stat().st_size
        if size > MAX_HOSTS_FILE_BYTES:
            raise HostsFileError([f"hosts file: {str(path)!r} is {size:,} bytes, not a hosts "
                                  f"file (at most {MAX_HOSTS_FILE_BYTES:,}); give the JSON "
                                  "file listing your hosts"], str(path))
        raw = path.read_bytes()
        if b"\0" in raw:
            raise HostsFileError([f"hosts file: {str(path)!r} holds NUL bytes: a binary file, "
                                  "not a hosts file; give the JSON file listing your hosts"],
                                 str(path))
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HostsFileError([f"hosts file: {str(path)!r} is not UTF-8 text (byte "
                              f"{exc.start}); give the JSON file listing your hosts"],
                             str(path)) from None
    except FileNotFoundError:
        message = f"hosts file: {str(path)!r} does not exist; {hosts_file_help()}"
        raise HostsFileError([message], str(path)) from None
    except OSError as exc:
        raise HostsFileError([f"hosts file: cannot read {str(path)!r}: {exc.strerror}"],
                             str(path)) from None
    duplicates: list[tuple[str, list[str]]] = []
    try:
        data = json.loads(text, object_pairs_hook=_pairs_recording(duplicates))
    except json.JSONDecodeError as exc:
        message = (f"hosts file line {exc.lineno} column {exc.colno}: invalid JSON: {exc.msg}; "
                   "check for a missing comma, quote or bracket there (or just before)")
        raise HostsFileError([message], str(path)) from None
    except RecursionError:
        raise HostsFileError([f"hosts file: {str(path)!r} nests lists or objects deeper than "
                              "Python reads: a hosts file is a few levels deep"],
                             str(path)) from None
    except ValueError as exc:  # a number of more digits than Python converts
        raise HostsFileError([f"hosts file: {str(path)!r} holds a number of more digits than "
                              f"Python reads ({exc.args[0].split(':')[0]}): no setting is that "
                              "large"], str(path)) from None
    try:
        lines = _value_lines(text)
    except RecursionError:
        lines = {}
    validator = _Validator(data, lines=lines, source=str(path))
    for where, keys in duplicates:
        for key in keys:
            validator.problem((), f'key "{key}" appears twice in {where}; keep one')
    return validator.run()


# --------------------------------------------------------------------------- parsing helpers


def _pairs_recording(duplicates: list[tuple[str, list[str]]]):
    """An ``object_pairs_hook`` that notes keys given twice in one object."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        repeated: list[str] = []
        for key, _ in pairs:
            if key in seen and key not in repeated:
                repeated.append(key)
            seen.add(key)
        if repeated:
            where = "a host object" if "host" in seen else "the top level"
            duplicates.append((where, repeated))
        return dict(pairs)

    return hook


def _value_lines(text: str) -> dict[JsonPath, int]:
    """Map each JSON path in ``text`` (already known to be valid JSON) to its line number."""
    decoder = json.JSONDecoder()
    lines: dict[JsonPath, int] = {}
    ws = " \t\r\n"

    def line_of(pos: int) -> int:
        return text.count("\n", 0, pos) + 1

    def skip(pos: int) -> int:
        while pos < len(text) and text[pos] in ws:
            pos += 1
        return pos

    def walk(pos: int, path: JsonPath) -> int:
        pos = skip(pos)
        lines[path] = line_of(pos)
        if text[pos] == "{":
            pos = skip(pos + 1)
            if text[pos] == "}":
                return pos + 1
            while True:
                key, pos = json.decoder.scanstring(text, skip(pos) + 1)
                pos = skip(pos) + 1  # the colon
                pos = skip(walk(pos, path + (key,)))
                if text[pos] == "}":
                    return pos + 1
                pos += 1  # the comma
        if text[pos] == "[":
            pos = skip(pos + 1)
            if text[pos] == "]":
                return pos + 1
            index = 0
            while True:
                pos = skip(walk(pos, path + (index,)))
                index += 1
                if text[pos] == "]":
                    return pos + 1
                pos += 1
        _, end = decoder.raw_decode(text, pos)
        return end

    try:
        walk(0, ())
    except (IndexError, ValueError):
        return lines  # line numbers are a courtesy; validation goes on without them
    return lines


def _show(value: Any) -> str:
    """A value as it appears in JSON, for messages."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _field(path: JsonPath) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return f'"{out}"'


class _Validator:
    """Collects every problem of one hosts document, then builds the config."""

    def __init__(self, data: Any, lines: dict[JsonPath, int], source: str | None) -> None:
        self.data = data
        self.lines = lines
        self.source = source
        self.problems: list[str] = []

    def problem(self, path: JsonPath, text: str) -> None:
        line = self.lines.get(path) if path else None  # line 1 of the top level says nothing
        where = f" line {line}" if line is not None else ""
        self.problems.append(f"hosts file{where}: {text}")

    def run(self) -> HostsConfig:
        config = self._check()
        if self.problems:
            raise HostsFileError(self.problems, self.source)
        assert config is not None
        return config

    def _check(self) -> HostsConfig | None:
        data = self.data
        if not isinstance(data, dict):
            kind = type(data).__name__
            self.problem((), 'must be a JSON object like {"master": "10.0.0.1", "workers": '
                         f'["10.0.0.2"], ...}}, got a {kind}: {_show(data)}')
            return None
        self._unknown_keys(data, (), TOP_KEYS, "the top level")
        defaults = self._host_fields(data, ())

        entries: list[tuple[JsonPath, Any]] = []
        if "master" not in data:
            self.problem((), 'missing "master": add "master": "<address of the host that runs '
                         'rank 0>"')
        else:
            entries.append((("master",), data["master"]))
        if "workers" not in data:
            self.problem((), 'missing "workers": add "workers": ["<address>", ...] '
                         "(an empty list runs a single rank on the master)")
        elif not isinstance(data["workers"], list):
            self.problem(("workers",), '"workers" must be a list of addresses, got '
                         f"{_show(data['workers'])}")
        elif len(data["workers"]) >= MAX_NUM_NODES:
            self.problem(("workers",), f'"workers" lists {len(data["workers"]):,} hosts: a run '
                         f"has at most {MAX_NUM_NODES} ranks, the master's included")
        else:
            entries.extend((("workers", i), w) for i, w in enumerate(data["workers"]))

        master_port = DEFAULT_MASTER_PORT
        if "master_port" in data:
            port = self._port(data, ("master_port",))
            master_port = port if port is not None else master_port

        hosts: list[dict[str, Any]] = []
        for path, entry in entries:
            fields = self._host_entry(entry, path)
            if fields is not None:
                hosts.append({**defaults, **fields, "_path": path})

        for key in ("python_env", "project_path"):
            if key in data:
                continue  # an invalid top-level value is reported already
            lacking = [_field(h["_path"]) for h in hosts if key not in h]
            if lacking:
                example = "/path/to/venv/bin/python" if key == "python_env" else "/path/to/checkout"
                self.problem((), f'missing "{key}" for {", ".join(lacking)}: add "{key}": '
                             f'"{example}" at the top level or on each of those hosts, or '
                             "run setup-hosts on this file: it sets the hosts up (the "
                             "project and its Python) and writes the paths in")

        seen: dict[tuple[str, int], JsonPath] = {}
        for h in hosts:
            key = (h["host"].lower(), h.get("ssh_port") or 22)
            if key in seen:
                self.problem(h["_path"], f"{_field(h['_path'])} repeats host {_show(h['host'])} "
                             f"(ssh port {key[1]}) already listed as {_field(seen[key])}: list "
                             "each machine once and give it \"slots\" to run several ranks on it")
            else:
                seen[key] = h["_path"]

        master = next((h for h in hosts if h["_path"] == ("master",)), None)
        if master is not None and is_loopback(master["host"]):
            remote = [h for h in hosts if h is not master and is_other_machine(h["host"])]
            if remote:
                named = ", ".join(f"{_field(self._address_path(h['_path']))} ({_show(h['host'])})"
                                  for h in remote)
                verb = "is another machine" if len(remote) == 1 else "are other machines"
                self.problem(self._address_path(("master",)),
                             f"{_field(self._address_path(('master',)))} is "
                             f"{_show(master['host'])}, a loopback address only the master "
                             f"itself can reach, but {named} {verb} whose ranks must connect "
                             "to it: set it to the master's LAN address (the one the workers "
                             "reach it at)")

        world = sum(h.get("slots", 1) for h in hosts)
        if world > MAX_NUM_NODES:
            self.problem((), f"the hosts' slots add up to {world:,} ranks: a run has at most "
                         f"{MAX_NUM_NODES}; lower \"slots\" or list fewer hosts")
        if self.problems:
            return None
        specs = []
        first_rank = 0
        for index, h in enumerate(hosts):
            spec = HostSpec(rank=index, first_rank=first_rank,
                            **{k: v for k, v in h.items() if k != "_path"})
            specs.append(spec)
            first_rank += spec.slots
        return HostsConfig(hosts=tuple(specs), master_port=master_port, source=self.source,
                           master_port_given="master_port" in data)

    def _address_path(self, path: JsonPath) -> JsonPath:
        """Where a host's address sits: the entry itself, or its "host" key in an object."""
        entry: Any = self.data
        for key in path:
            entry = entry[key]
        return path + ("host",) if isinstance(entry, dict) else path

    def _unknown_keys(self, obj: dict[str, Any], path: JsonPath, accepted: tuple[str, ...],
                      where: str) -> None:
        for key in obj:
            if key in accepted:
                continue
            close = difflib.get_close_matches(key, accepted, n=1)
            hint = f' (did you mean "{close[0]}"?)' if close else ""
            self.problem(path + (key,), f'unknown key "{key}" in {where}{hint}; accepted keys: '
                         f"{', '.join(accepted)}")

    def _host_entry(self, entry: Any, path: JsonPath) -> dict[str, Any] | None:
        name = _field(path)
        if isinstance(entry, str):
            host = self._address(entry, path, name)
            return None if host is None else {"host": host}
        if isinstance(entry, dict):
            self._unknown_keys(entry, path, HOST_KEYS, f"host object {name}")
            fields = self._host_fields(entry, path)
            if "host" not in entry:
                self.problem(path, f'{name} has no "host": add "host": "<address>" to it')
                return None
            host = self._address(entry["host"], path + ("host",), _field(path + ("host",)))
            if host is None:
                return None
            return {**fields, "host": host}
        self.problem(path, f"{name} must be an address or an object with \"host\", got "
                     f"{_show(entry)}")
        return None

    def _address(self, value: Any, path: JsonPath, name: str) -> str | None:
        if not isinstance(value, str) or not value.strip():
            self.problem(path, f"{name} must be a host address (IP or name), got {_show(value)}")
            return None
        value = value.strip()
        if self._unprintable(value, path, name):
            return None
        if "@" in value:
            user, _, host = value.rpartition("@")
            self.problem(path, f"{name} is {_show(value)}: write the address alone and the user "
                         f'separately: {{"host": "{host}", "ssh_user": "{user}"}}')
            return None
        if value.count(":") == 1:
            host, _, port = value.partition(":")
            self.problem(path, f"{name} is {_show(value)}: write the address alone and the SSH "
                         f'port separately: {{"host": "{host}", "ssh_port": {port or 22}}}')
            return None
        if any(c.isspace() for c in value):
            self.problem(path, f"{name} must be one host address without spaces, got "
                         f"{_show(value)}")
            return None
        return value

    def _host_fields(self, obj: dict[str, Any], path: JsonPath) -> dict[str, Any]:
        """Check the optional per-host keys present in ``obj``; return the valid ones."""
        out: dict[str, Any] = {}
        if "ssh_port" in obj:
            port = self._port(obj, path + ("ssh_port",))
            if port is not None:
                out["ssh_port"] = port
        for key, what in (("ssh_user", "a user name"), ("ssh_key_path", "a key file path"),
                          ("python_env", "the path of a Python interpreter"),
                          ("project_path", "the path of the project checkout")):
            if key in obj:
                value = obj[key]
                if isinstance(value, str) and value.strip():
                    if self._unprintable(value, path + (key,), _field(path + (key,))):
                        continue
                    why = unsafe_folder(value) if key == "project_path" else None
                    if why is not None:
                        self.problem(path + (key,), f"{_field(path + (key,))} is "
                                     f"{_show(value)}: {why}, and setup-hosts copies the "
                                     "project there; give a folder of its own, such as "
                                     '"~/exogym"')
                        continue
                    out[key] = value.strip()
                else:
                    self.problem(path + (key,), f"{_field(path + (key,))} must be {what} "
                                 f"(a non-empty string), got {_show(value)}")
        for key, accept, what in _CHECKED_FIELDS:
            if key not in obj:
                continue
            if accept(obj[key]):
                out[key] = obj[key]
            else:
                self.problem(path + (key,), f"{_field(path + (key,))} must be {what}, "
                             f"got {_show(obj[key])}")
        return out

    def _unprintable(self, value: str, path: JsonPath, name: str) -> bool:
        """Note a value holding control or format characters (NUL, escape, newline, a
        bidirectional override that shows one name while another is used)."""
        found = unprintable(value)
        if found:
            self.problem(path, f"{name} holds characters that are not printable "
                         f"({', '.join(dict.fromkeys(found))}): {_show(value)}; write it "
                         "without them")
        return bool(found)

    def _port(self, obj: dict[str, Any], path: JsonPath) -> int | None:
        value = obj[path[-1]]
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
            self.problem(path, f"{_field(path)} must be a port number 1..65535, got "
                         f"{_show(value)}")
            return None
        return value


def min_nodes_problem(value: Any, world: int | None = None) -> str | None:
    """What is wrong with a ``min_nodes`` value, None when nothing: the one check of it,
    made by the profile, the launcher's options, the launcher and each rank.

    Args:
        value: the value given (None: every rank is needed, which is fine).
        world: the ranks of the run, when known: ``min_nodes`` may not exceed them.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return (f"min_nodes must be a whole number >= 1 (the fewest hosts a run across hosts "
                f"goes on with; None: every rank is needed), got {value!r}")
    if world is not None and value > world:
        return f"min_nodes={value} is more than the run's {world} rank{'s' if world != 1 else ''}"
    return None
