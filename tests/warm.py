"""The project's commands started warm in tests: forked from a server that imported torch once.

A fresh interpreter spends about 3 s of CPU importing torch and ``torch._dynamo`` (every
optimizer's first step imports the latter) before a command does anything of its own; the
suite starts such commands well over a hundred times. :func:`python` gives the command
line a test runs instead of ``[sys.executable]``: a small client that starts in a few
milliseconds (``python -S``), hands its arguments, working folder, environment, umask and
standard streams to this test process's server, and waits for the command there. The
server, which imported torch once, forks a process for it; the client then ends as that
process ended (its exit status, or the signal that killed it) and passes the signals it
gets (Ctrl-C, SIGTERM, SIGHUP) on to the command's process group. A client killed outright
(a test's timeout) takes the command with it.

What each command still gets fresh: the project's own modules (imported by the command,
after its environment is set), ``sys.path`` (from its script or ``-m``, its PYTHONPATH and
the site packages, as an interpreter builds it), ``sys.argv``, its streams, its own
session and process group, reseeded random generators. What it does not: torch's reading
of the environment at import (threads, devices). So a command whose environment differs
from the server's in a variable torch or its libraries read at import runs fresh: the
client then becomes that interpreter itself (``exec``). It does the same when no server
answers.

Tests of how a command starts (what it imports, the installed wheel, the quick start,
journeys typed in a terminal), and tests that signal or inspect a command's process tree
(freezing a process group, finding its children), start their commands fresh: they use
``sys.executable`` as before.

Run as a script: ``warm.py serve SOCKET PARENT_PID`` is the server; ``warm.py ARGS...``
(what :func:`python` gives) is the client, where ARGS are what ``python ARGS...`` takes:
``SCRIPT ...``, ``-m MODULE ...`` or ``-c CODE ...``, after ``-u`` if unbuffered.
"""

from __future__ import annotations

import array
import atexit
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

#: What the server imports once: the heavy third-party modules every command needs.
PRELOAD = ("torch", "torch._dynamo", "numpy", "safetensors.torch")
#: Variables read when torch and its libraries are imported: a command whose value differs
#: from the server's runs fresh.
IMPORT_TIME_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "TORCH_", "PYTORCH_", "CUDA_",
                        "LD_", "MALLOC_", "PYTHONHASHSEED", "PYTHONMALLOC", "PYTHONWARNINGS")
#: Signals the client passes on to the command's process group.
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)
#: Seconds a client waits for its server to answer before starting the command fresh.
CONNECT_S = 120.0
#: Seconds between a client's looks for a signal while it waits for its command's end.
_SIGNAL_LOOK_S = 0.1

_server: subprocess.Popen | None = None
_socket_path: str | None = None
#: The test process's environment before any test ran (conftest imports this module): the
#: server's. Started with the environment of whichever test first ran a command (one that
#: set CUDA_VISIBLE_DEVICES for itself, say), the server would turn away every later
#: command as one whose import-time environment differs.
_START_ENV = dict(os.environ)
_HERE = os.path.abspath(__file__)


def _send(sock: socket.socket, obj: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    message = struct.pack("!I", len(data)) + data
    if fds:
        sock.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(message)


def _receive(sock: socket.socket, with_fds: int = 0) -> tuple[dict | None, list[int]]:
    """One message (None at the end of the connection) and the descriptors it carried."""
    fds: list[int] = []
    head = b""
    while len(head) < 4:
        if with_fds and not fds:
            chunk, ancillary, _, _ = sock.recvmsg(4 - len(head),
                                                  socket.CMSG_LEN(with_fds * 4))
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(array.array("i", payload[:len(payload) - len(payload) % 4]))
        else:
            chunk = sock.recv(4 - len(head))
        if not chunk:
            return None, fds
        head += chunk
    (size,) = struct.unpack("!I", head)
    body = b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            return None, fds
        body += chunk
    return json.loads(body), fds


# -- the test process's side -----------------------------------------------------------------


def python() -> list[str]:
    """What a test runs instead of ``[sys.executable]`` to start a command warm: this test
    process's server is started on first use and stopped when the process ends."""
    global _server, _socket_path
    if _server is None or _server.poll() is not None:
        _socket_path = os.path.join(tempfile.mkdtemp(prefix="exogym-warm-"), "server")
        with open(os.path.join(os.path.dirname(_socket_path), "server.log"), "ab") as log:
            _server = subprocess.Popen([sys.executable, _HERE, "serve", _socket_path,
                                        str(os.getpid())], start_new_session=True,
                                       stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                       env=_START_ENV, cwd="/")
        atexit.register(_stop_server, _server, _socket_path, os.getpid())
    return [sys.executable, "-S", _HERE, f"--socket={_socket_path}"]


def pid_of(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    """The process that runs ``proc``'s command: the one the server forked for it, or
    ``proc`` itself where it started fresh."""
    if _socket_path is None or proc.args[:3] != python()[:3]:
        return proc.pid
    record = os.path.join(os.path.dirname(_socket_path), str(proc.pid))
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(record) as f:
                return int(f.read())
        except (FileNotFoundError, ValueError):
            if proc.poll() is not None:  # it ran fresh (the client became the interpreter)
                return proc.pid
            if time.monotonic() > deadline:
                raise TimeoutError(f"no warm process was recorded for {proc.args!r}") from None
            time.sleep(0.01)


def send_signal(proc: subprocess.Popen, signum: int) -> None:
    """Send ``signum`` to the process that runs ``proc``'s command (a rank killed is that
    process killed, not only its client): the client ends as the command does."""
    os.kill(pid_of(proc), signum)


def cli_command() -> list[str]:
    """``python cli_typer.py`` of this checkout, started warm: the command line as a person
    runs it from a checkout, without the import of torch each time."""
    return [*python(), os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "cli_typer.py")]


def _stop_server(server: subprocess.Popen, path: str, owner: int) -> None:
    if os.getpid() != owner:  # a process forked from the test process, ending: not its server
        return
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(timeout=5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    import shutil

    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


# -- the client: what the test started -------------------------------------------------------


def client(socket_path: str, args: list[str]) -> None:
    """Run ``python ARGS`` in the server, or fresh; never returns."""
    flags = [a for a in args[:1] if a.startswith("-") and a not in ("-m", "-c", "-u")]
    if flags or not args:  # an interpreter option the server does not take: run fresh
        _fresh(args)
    # Signals are taken from the start: one that comes before the command's process is
    # known is passed on as soon as it is.
    command: list[int] = []
    pending: list[int] = []

    def forward(signum, frame):
        if not command:
            pending.append(signum)
            return
        try:
            os.killpg(command[0], signum)
        except ProcessLookupError:  # not yet a group of its own: it holds the signal till then
            try:
                os.kill(command[0], signum)
            except ProcessLookupError:
                pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + CONNECT_S
    while True:
        try:
            sock.connect(socket_path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                _fresh(args, pending)
            time.sleep(0.02)
    umask = os.umask(0)
    os.umask(umask)
    env = {k: v for k, v in os.environ.items()}
    _send(sock, {"args": args, "cwd": os.getcwd(), "env": env, "umask": umask}, [0, 1, 2])
    answer, _ = _receive(sock)
    if answer is None or "pid" not in answer:
        sock.close()
        _fresh(args, pending)
    command.append(answer["pid"])
    for signum in pending:
        forward(signum, None)
    while True:
        # A signal that comes after Python last looked for one and before a blocking read
        # starts is taken by Python only when that read returns: here, when the command
        # ends, which it may do only once the signal is passed on. So wait with a timeout,
        # and such a signal is passed on within one.
        if not select.select([sock], [], [], _SIGNAL_LOOK_S)[0]:
            continue
        try:
            answer, _ = _receive(sock)
            break
        except InterruptedError:
            continue
    if answer is None:
        sys.stderr.write("warm.py: the server that ran the command went away\n")
        os._exit(127)
    status = answer["status"]
    if os.WIFSIGNALED(status):  # end as the command ended: killed by the same signal
        signum = os.WTERMSIG(status)
        if signum not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be handled
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        time.sleep(5)
    os._exit(os.waitstatus_to_exitcode(status))


def _fresh(args: list[str], pending: list[int] | None = None) -> None:
    """Become ``python ARGS`` (a signal already taken ends this process as it would have)."""
    for signum in FORWARDED:
        signal.signal(signum, signal.SIG_DFL if signum != signal.SIGINT
                      else signal.default_int_handler)
    for signum in pending or ():
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    os.execv(sys.executable, [sys.executable, *args])


# -- the server --------------------------------------------------------------------------------


def serve(socket_path: str, parent: int) -> None:
    """Import once, then fork a process for each client's command until the test process
    that started this one ends."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    for name in PRELOAD:
        __import__(name)
    base_env = dict(os.environ)
    base_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(
        os.pathsep)]
    clients: dict[int, tuple[socket.socket, int]] = {}  # fd -> (connection, pid)
    by_pid: dict[int, socket.socket] = {}
    records: dict[int, str] = {}  # pid -> the file that names it after its client's pid
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    log = open(os.path.join(os.path.dirname(socket_path), "server.log"), "a", buffering=1)

    def start(conn: socket.socket) -> None:
        """Fork the command a new client asks for (or tell it to run fresh)."""
        request, fds = _receive(conn, with_fds=3)
        try:
            if request is None or len(fds) != 3:
                return
            if any(base_env.get(k) != request["env"].get(k)
                   for k in set(base_env) | set(request["env"])
                   if k.startswith(IMPORT_TIME_PREFIXES)):
                _send(conn, {"fresh": True})
                return
            client_pid = struct.unpack("3i", conn.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
            # Held from the fork until the command has its own session and handlers: a signal
            # its client passes on at once then reaches the command, not this server's ways.
            held = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
            pid = os.fork()
            if pid != 0:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)
            if pid == 0:
                listener.close()
                for other, _ in clients.values():
                    other.close()
                conn.close()
                log.close()
                _run(request, fds, base_path)  # never returns
            record = os.path.join(os.path.dirname(socket_path), str(client_pid))
            with open(record + ".tmp", "w") as f:
                f.write(str(pid))
            os.replace(record + ".tmp", record)
            clients[conn.fileno()] = (conn, pid)
            by_pid[pid] = conn
            records[pid] = record
            _send(conn, {"pid": pid})  # a client gone already is seen at the next select
        finally:
            for fd in fds:
                os.close(fd)

    while not stopping and os.getppid() == parent:
        ready, _, _ = select.select([listener, *[c for c, _ in clients.values()]], [], [], 0.1)
        for sock in ready:
            if sock is listener:
                conn, _ = listener.accept()
                try:
                    start(conn)
                except OSError as error:  # a client that went away at once
                    log.write(f"{time.ctime()}: a client's request failed: {error!r}\n")
                if conn.fileno() not in clients:
                    conn.close()
            elif sock.fileno() in clients:  # its client ended first: a test's timeout, a kill
                conn, pid = clients.pop(sock.fileno())
                by_pid.pop(pid, None)
                conn.close()
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = by_pid.pop(pid, None)
            try:
                os.unlink(records.pop(pid, ""))
            except OSError:
                pass
            if conn is not None:
                clients.pop(conn.fileno(), None)
                try:
                    _send(conn, {"status": status})
                except OSError:
                    pass
                conn.close()
    log.write(f"{time.ctime()}: stopping ({'SIGTERM' if stopping else 'its test process ended'})\n")
    for pid in list(by_pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _run(request: dict, fds: list[int], base_path: list[str]) -> None:
    """In the forked process: become the command ``python ARGS`` and run it."""
    code = 1
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.umask(request["umask"])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for signum in FORWARDED:
            if signum != signal.SIGINT:
                signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        args = list(request["args"])
        sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        while args and args[0] == "-u":
            unbuffered = True
            args.pop(0)
        _streams(unbuffered)
        import random

        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        import runpy

        if args[:1] == ["-m"]:
            sys.path[:] = [os.getcwd(), *extra, *base_path]
            sys.argv = [args[1], *args[2:]]
            run = lambda: runpy.run_module(args[1], run_name="__main__", alter_sys=True)  # noqa: E731
        elif args[:1] == ["-c"]:
            sys.path[:] = ["", *extra, *base_path]
            sys.argv = ["-c", *args[2:]]
            source = args[1]
            run = lambda: exec(compile(source, "<string>", "exec"),  # noqa: E731
                               {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            script = os.path.abspath(args[0])
            sys.path[:] = [os.path.dirname(script), *extra, *base_path]
            sys.argv = list(args)
            run = lambda: runpy.run_path(script, run_name="__main__")  # noqa: E731
        try:
            run()
            code = 0
        except SystemExit as done:
            if done.code is None:
                code = 0
            elif isinstance(done.code, int):
                code = done.code
            else:
                print(done.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            import traceback

            traceback.print_exc()
            _finish()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        except BaseException:  # as an interpreter reports what its program raised
            import traceback

            traceback.print_exc()
            code = 1
        _finish()
    finally:
        os._exit(code)


def _streams(unbuffered: bool) -> None:
    import io

    encoding, _, chosen_errors = os.environ.get("PYTHONIOENCODING", "").partition(":")
    encoding = encoding or "utf-8"

    def stream(fd: int, errors: str, line: bool):
        errors = chosen_errors or errors
        raw = io.FileIO(fd, "rb" if fd == 0 else "wb", closefd=False)
        if fd == 0:
            return io.TextIOWrapper(io.BufferedReader(raw), encoding=encoding, errors=errors)
        buffered = raw if unbuffered else io.BufferedWriter(raw)
        return io.TextIOWrapper(buffered, encoding=encoding, errors=errors,
                                line_buffering=line or os.isatty(fd),
                                write_through=unbuffered)

    sys.stdin = sys.__stdin__ = stream(0, "strict", False)
    sys.stdout = sys.__stdout__ = stream(1, "strict", False)
    sys.stderr = sys.__stderr__ = stream(2, "backslashreplace", True)


def _finish() -> None:
    """What an interpreter does as it ends: wait for threads, run atexit, flush."""
    import threading

    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except Exception:
        pass
    try:
        atexit._run_exitfuncs()
    except Exception:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1:2] and sys.argv[1].startswith("--socket="):
        client(sys.argv[1].split("=", 1)[1], sys.argv[2:])
    else:
        sys.exit("usage: warm.py serve SOCKET PARENT_PID | warm.py --socket=PATH ARGS...")
