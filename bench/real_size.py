"""Models the size users train, measured: GPTs of 23M and 124M parameters on synthetic tokens.

Two parts, each printing a table (and, with ``--json``, writing every figure):

``sim``: the same DiLoCo workload simulated with K = 2, 4, 8 ranks on this
machine, by this project and by exo-explore/gym, one after the other in one
run. For each: the wall time of the whole run (start to final model) and the
peak of the summed proportional set size (PSS) of every process of the run,
sampled every 0.2 s. For this project also the training state a rank holds
as accounted before the run (parameters, gradients, optimizer, strategy) and
each rank's measured peak resident memory. exo-explore/gym is not on PyPI
under a usable name (``exogym`` there is an empty placeholder): point
``--gym`` at a checkout of https://github.com/exo-explore/gym (``git clone``
it anywhere); its ``exogym`` is imported from there in a process of its own (it needs
``einops`` installed). gym binds gloo to ``lo0``, macOS's loopback: on Linux
its runs happen in a network namespace that has an interface of that name
(root needed). Without ``--gym`` only this project runs.

``hosts``: three hosts at 1 Gbit/s: this machine (the launcher and rank 0)
and two network namespaces with an sshd each (:mod:`netbed`), every link
shaped with ``tc tbf``. DiLoCo on the 124M model; per run the median round
time, and the sync efficiency of the round's all-reduce: the ring all-reduce's
bound for its bytes at the link rate (``2 (n-1)/n * bytes / rate``) over the
time rank 0 spent in it. Runs: without ``min_nodes``; with ``--min-nodes 2``;
and with ``--min-nodes 2`` where rank 2's host is killed (its sshd stopped, its
rank ``kill -9``) and answers again after ``--away`` seconds: the time from its
answer to the returning rank's first completed round ("back to work"),
against one round plus the state's transfer time at the link rate plus 10 s.

    sudo python bench/real_size.py sim --gym ../gym
    sudo python bench/real_size.py sim --models 23m --nodes 8 --gym ../gym
    sudo python bench/real_size.py hosts
    sudo python bench/real_size.py sim hosts --gym ../gym --json real_size.json

``hosts`` needs root, iproute2 and sshd (``tests/setup_system.sh``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from io import StringIO
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, Path(__file__).resolve().parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

#: The models: the gpt task's settings.
MODELS = {
    "23m": {"vocab_size": 8192, "n_layer": 6, "n_head": 8, "n_embd": 512},
    "124m": {"vocab_size": 50257, "n_layer": 12, "n_head": 12, "n_embd": 768},
}
#: The simulated workload: sequences, batch, steps and DiLoCo's rounds.
SIM = {"block_size": 64, "batch_size": 4, "max_steps": 12, "H": 4, "lr": 6e-4, "tokens": 100_000}
#: The workload across hosts (124M): short sequences, so that a round is mostly its all-reduce.
HOSTS = {"block_size": 64, "batch_size": 1, "max_steps": 12, "H": 2, "tokens": 50_000}


# -- measuring a process tree -------------------------------------------------------------


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2:].split()[1])
        tree.setdefault(parent, []).append(int(entry.name))
    return tree


def _pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_pss_bytes(root: int) -> tuple[int, dict[int, int]]:
    """The summed PSS of ``root`` and every process below it, and each one's."""
    tree = _children()
    each: dict[int, int] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        each[pid] = _pss_kib(pid) * 1024
        todo.extend(tree.get(pid, []))
    return sum(each.values()), each


def measured(command: list[str], env: dict[str, str], log: Path) -> dict[str, Any]:
    """Run ``command``; its wall time, the peak summed PSS of its processes, its JSON result."""
    result = log.with_suffix(".json")
    started = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen([*command, "--result", str(result)], env=env, stdout=out,
                                stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        peak = 0
        each_peak: dict[int, int] = {}
        while proc.poll() is None:
            total, each = tree_pss_bytes(proc.pid)
            peak = max(peak, total)
            for pid, pss in each.items():
                each_peak[pid] = max(each_peak.get(pid, 0), pss)
            time.sleep(0.2)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}):\n{tail}")
    workers = [pss for pid, pss in each_peak.items() if pid != proc.pid]
    return {"wall_s": wall, "pss_bytes": peak,
            "worker_pss_bytes": max(workers) if workers else each_peak.get(proc.pid, 0),
            **json.loads(result.read_text())}


# -- the simulated runs (each in a process of its own) -------------------------------------


def child(argv: list[str]) -> None:
    """One simulated run, by this project or by exo-explore/gym (``--which``)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--which", choices=["ours", "gym"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--result", required=True)
    args = parser.parse_args(argv)
    import torch

    from distributed.tasks.tokens import gpt_task

    runtime = _rss_bytes()  # the interpreter and torch, before any model

    model, train, val = gpt_task(block_size=SIM["block_size"], tokens=SIM["tokens"],
                                 **MODELS[args.model])
    activations = 0
    if args.which == "ours":
        activations = activation_bytes(model, train, SIM["batch_size"])
    common = dict(max_steps=SIM["max_steps"], batch_size=SIM["batch_size"],
                  minibatch_size=SIM["batch_size"], val_size=SIM["batch_size"],
                  val_interval=SIM["max_steps"])
    out: dict[str, Any] = {"params": sum(p.numel() for p in model.parameters())}
    started = time.perf_counter()
    if args.which == "ours":
        from exogym import Trainer
        from exogym.memory import RUNTIME_BYTES
        from exogym.strategy import DiLoCoStrategy

        trainer = Trainer(model, train, val, device="cpu")
        trainer.fit(strategy=DiLoCoStrategy(inner_optim="adamw", lr=SIM["lr"], H=SIM["H"]),
                    num_nodes=args.nodes, logger=None, progress=False, **common)
        state = trainer.state_bytes
        processes = trainer.summary.get("processes") or args.nodes
        per_process = -(-args.nodes // processes)
        # A process's ranks' state (one set of gradients: its ranks step in turn), one
        # forward and backward's activations, and the runtime measured here.
        budget = state.on_machine(per_process, 1) - RUNTIME_BYTES + activations + runtime
        out.update(state_bytes=state.per_rank, shared_bytes=state.shared,
                   peak_rss_bytes=trainer.summary.get("peak_rss_bytes_per_rank"),
                   processes=processes, activation_bytes=activations, runtime_bytes=runtime,
                   budget_bytes=budget, final_loss=trainer.history[-1]["train_loss"])
    else:
        import exogym
        from exogym import Trainer
        from exogym.strategy.diloco import DiLoCoStrategy
        from exogym.strategy.optim import OptimSpec

        if "gym" not in str(Path(exogym.__file__).resolve().parents[1]).lower() \
                and Path(exogym.__file__).resolve().parents[1] == ROOT:
            raise SystemExit("--gym: this project's exogym was imported, not exo-explore/gym's")
        trainer = Trainer(model, train, val, device="cpu")
        trainer.fit(num_epochs=1, num_nodes=args.nodes,
                    strategy=DiLoCoStrategy(optim_spec=OptimSpec(torch.optim.AdamW,
                                                                 lr=SIM["lr"]), H=SIM["H"]),
                    run_name="real-size", disable_logging=True, **common)
        out["processes"] = args.nodes
    out["fit_s"] = time.perf_counter() - started
    Path(args.result).write_text(json.dumps(out))


def activation_bytes(model: Any, train: Any, batch_size: int) -> int:
    """One forward and backward's activations: the peak of a step on a copy of ``model``
    (run first thing, in a heap with nothing freed in it yet) less the copy and its
    gradients."""
    import torch

    from exogym.memory import measure_peak

    batch = tuple(torch.stack(parts) for parts in zip(*(train[i] for i in range(batch_size))))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return max(0, measure_peak(model, batch, torch.device("cpu"), False) - 2 * params)


def budget_child(argv: list[str]) -> None:
    """What one rank across hosts is accounted: its state (as ``fit`` accounts it), the
    runtime (this interpreter with torch, before any model) and one forward and
    backward's activations, measured here on the hosts' workload."""
    model_name, result = argv

    from distributed.profiles.profile import load_profile
    from exogym.memory import account_state

    runtime = _rss_bytes()
    overrides = {**MODELS[model_name], "block_size": HOSTS["block_size"],
                 "tokens": HOSTS["tokens"], "H": HOSTS["H"]}
    profile = load_profile("gpt-diloco", overrides=overrides)
    resolved = profile.resolved
    model, train, _ = resolved.task_fn(**resolved.task_kwargs)
    strategy = resolved.strategy_cls(**resolved.strategy_kwargs)
    state = account_state(model, strategy, 3)
    activations = activation_bytes(model, train, HOSTS["batch_size"])
    Path(result).write_text(json.dumps({
        "state_bytes": state.per_rank, "runtime_bytes": runtime,
        "activation_bytes": activations,
        "budget_bytes": state.per_rank + runtime + activations}))


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class GymNamespace:
    """A network namespace where exo-explore/gym can run on Linux.

    gym sets ``GLOO_SOCKET_IFNAME=lo0``, macOS's loopback, before it joins its ranks;
    Linux has no such interface. Inside this namespace ``lo`` is up and a dummy
    interface named ``lo0`` (one end of a veth pair) carries an address of its own.
    Needs root; removed on exit.
    """

    def __init__(self) -> None:
        self.name = f"exogym-gym-{os.getpid()}"

    def __enter__(self) -> GymNamespace:
        if sys.platform != "linux":
            self.name = ""
            return self
        if os.geteuid() != 0:
            raise SystemExit("exo-explore/gym binds gloo to an interface named lo0 (macOS's "
                             "loopback); on Linux this bench runs it in a network namespace "
                             "that has one, which needs root (sudo)")
        for command in (["ip", "netns", "add", self.name],
                        ["ip", "-n", self.name, "link", "set", "lo", "up"],
                        ["ip", "-n", self.name, "link", "add", "lo0", "type", "veth", "peer",
                         "name", "lo0peer"],
                        ["ip", "-n", self.name, "addr", "add", "10.250.0.1/24", "dev", "lo0"],
                        ["ip", "-n", self.name, "link", "set", "lo0peer", "up"],
                        ["ip", "-n", self.name, "link", "set", "lo0", "up"]):
            subprocess.run(command, check=True, capture_output=True)
        return self

    def prefix(self) -> list[str]:
        """What a command runs under to be inside the namespace."""
        return ["ip", "netns", "exec", self.name] if self.name else []

    def __exit__(self, *exc: object) -> None:
        if self.name:
            subprocess.run(["ip", "netns", "delete", self.name], capture_output=True)


def sim(models: list[str], nodes: list[int], gym: Path | None, work: Path) -> list[dict]:
    with GymNamespace() as space:
        return _sim(models, nodes, gym, work, space)


def _sim(models: list[str], nodes: list[int], gym: Path | None, work: Path,
         space: GymNamespace) -> list[dict]:
    rows = []
    base = dict(os.environ)
    for name in models:
        for k in nodes:
            row: dict[str, Any] = {"model": name, "nodes": k}
            command = [sys.executable, __file__, "_child", "--model", name, "--nodes", str(k)]
            env = dict(base, PYTHONPATH=str(ROOT))
            row["ours"] = measured([*command, "--which", "ours"], env,
                                   work / f"ours-{name}-{k}.log")
            print(f"{name} K={k} ours: {row['ours']['wall_s']:.1f} s, "
                  f"{row['ours']['pss_bytes'] / 2**30:.2f} GiB", flush=True)
            if gym is not None:
                env = dict(base, PYTHONPATH=f"{gym}{os.pathsep}{ROOT}")
                row["gym"] = measured([*space.prefix(), *command, "--which", "gym"], env,
                                      work / f"gym-{name}-{k}.log")
                print(f"{name} K={k} gym: {row['gym']['wall_s']:.1f} s, "
                      f"{row['gym']['pss_bytes'] / 2**30:.2f} GiB", flush=True)
            rows.append(row)
    return rows


def sim_tables(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=180)
    gib = 2**30
    table = Table(title=f"simulation: DiLoCo H={SIM['H']}, {SIM['max_steps']} steps of "
                        f"{SIM['batch_size']} x {SIM['block_size']} tokens per rank, this "
                        f"machine ({os.cpu_count()} cores)")
    for col in ("model", "K", "processes", "wall", "summed PSS", "gym wall", "gym PSS",
                "wall vs gym", "PSS vs gym"):
        table.add_column(col, justify="right")
    for r in rows:
        ours, gym = r["ours"], r.get("gym")
        table.add_row(r["model"], str(r["nodes"]), str(ours["processes"]),
                      f"{ours['wall_s']:.1f} s", f"{ours['pss_bytes'] / gib:.2f} GiB",
                      f"{gym['wall_s']:.1f} s" if gym else "-",
                      f"{gym['pss_bytes'] / gib:.2f} GiB" if gym else "-",
                      f"{ours['wall_s'] / gym['wall_s']:.2f}x" if gym else "-",
                      f"{ours['pss_bytes'] / gym['pss_bytes']:.2f}x" if gym else "-")
    console.print(table)
    memory = Table(title="memory of this project's runs: accounted before the run (a process's "
                         "ranks' training state, one forward and backward's activations, the "
                         "runtime) against the peak measured (PSS: shared pages split among "
                         "the processes that share them; RSS counts them whole)")
    for col in ("model", "K", "ranks a process", "state per rank (accounted)",
                "held once a process", "activations", "runtime", "accounted a process",
                "peak PSS a process", "peak / accounted", "peak RSS a process", "summed PSS"):
        memory.add_column(col, justify="right")
    for r in rows:
        ours = r["ours"]
        memory.add_row(r["model"], str(r["nodes"]),
                       str(-(-r["nodes"] // ours["processes"])),
                       f"{ours['state_bytes'] / gib:.2f} GiB",
                       f"{ours['shared_bytes'] / gib:.2f} GiB",
                       f"{ours['activation_bytes'] / gib:.2f} GiB",
                       f"{ours['runtime_bytes'] / gib:.2f} GiB",
                       f"{ours['budget_bytes'] / gib:.2f} GiB",
                       f"{ours['worker_pss_bytes'] / gib:.2f} GiB",
                       f"{ours['worker_pss_bytes'] / ours['budget_bytes']:.2f}x",
                       f"{(ours['peak_rss_bytes'] or 0) / gib:.2f} GiB",
                       f"{ours['pss_bytes'] / gib:.2f} GiB")
    console.print(memory)
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = sorted((r for r in rows if r["model"] == name), key=lambda r: r["nodes"])
        for a, b in zip(mine, mine[1:]):
            grow = (b["ours"]["pss_bytes"] - a["ours"]["pss_bytes"]) / (b["nodes"] - a["nodes"])
            console.print(f"{name}: from K={a['nodes']} to K={b['nodes']} the summed PSS grows "
                          f"{grow / gib:.2f} GiB a rank, against {b['ours']['state_bytes'] / gib:.2f}"
                          " GiB of training state a rank")


# -- three hosts ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def rate_bits(rate: str) -> float:
    from netbed import rate_bits as parse

    return float(parse(rate))


def host_run(bed: Any, model: str, rate: str, min_nodes: int | None, kill: bool,
             away: float, work: Path, max_steps: int) -> dict[str, Any]:
    from rich.console import Console

    from distributed.hosts.ssh import SSHOptions
    from distributed.launch.launcher import Launcher, LaunchOptions, RankProgram
    from netbed import Events

    label = ("kill" if kill else "min_nodes") if min_nodes else "no min_nodes"
    out = work / label.replace(" ", "-")
    events = Events()
    h = HOSTS["H"]
    hosts = {"master": bed.uplink_address, "workers": [x.address for x in bed.hosts],
             "ssh_user": "root", "ssh_key_path": str(bed.key_path),
             "python_env": sys.executable, "project_path": str(ROOT),
             "master_port": _free_port()}
    ssh = SSHOptions(known_hosts_path=bed.known_hosts, ssh_config_path=bed.ssh_config,
                     allow_agent=False, look_for_keys=False, connect_timeout=5)
    overrides = [f"{k}={v}" for k, v in MODELS[model].items()] + [
        f"block_size={HOSTS['block_size']}", f"batch_size={HOSTS['batch_size']}",
        f"tokens={HOSTS['tokens']}", f"H={h}", f"max_steps={max_steps}", "val_size=0",
        "num_threads=1", "checkpoint_interval=None", "num_nodes=3", "warmup_steps=0",
        f"output_dir={out / 'run'}"]
    program = RankProgram.from_profile("gpt-diloco", overrides=overrides)
    job = Launcher(hosts, program, options=LaunchOptions(run_dir=out / "launch", grace_period=2,
                                                         min_nodes=min_nodes),
                   ssh=ssh, console=Console(file=StringIO()), on_output=lambda line: None,
                   on_event=events)
    result: dict[str, Any] = {}
    back = None
    with job:
        runner = threading.Thread(target=lambda: result.setdefault("r", job.run()))
        runner.start()
        if kill:
            events.wait(lambda e: e.get("event") == "step" and e["rank"] == 2
                        and e["step"] >= 2 * h, 900)
            cut = bed.hosts[1]
            bed.stop_sshd(cut)
            from netbed import worker_pid

            os.kill(worker_pid(2, str(out)), signal.SIGKILL)
            events.wait(lambda e: e.get("event") == "membership" and e["ranks"] == [0, 1], 300)
            time.sleep(away)
            bed.start_sshd(cut)
            back = time.monotonic()
        runner.join(timeout=3600)
    launch = result["r"]
    rounds = [(t, e) for t, e in events.of("step", 0) if e["step"] % h == 0]
    gaps = sorted(b[0] - a[0] for a, b in zip(rounds, rounds[1:]))
    comm = sorted(e["comm_s"] for _, e in rounds if e.get("comm_s"))
    bytes_round = rounds[-1][1]["comm_bytes"] / len(rounds) if rounds else 0
    n = 3
    bound = 2 * (n - 1) / n * bytes_round * 8 / rate_bits(rate)
    row = {"run": label, "ok": launch.ok, "rounds": len(rounds),
           "round_s": statistics.median(gaps) if gaps else None,
           "allreduce_s": statistics.median(comm) if comm else None,
           "bytes_per_round": bytes_round, "ring_bound_s": bound,
           "efficiency": bound / statistics.median(comm) if comm else None,
           "describe": launch.describe().splitlines()[0],
           "peak_rss_bytes": {e["rank"]: e.get("peak_rss_bytes") for _, e in events.of("done")}}
    if kill:
        t_join, joined = events.wait(lambda e: e.get("event") == "membership"
                                     and e["ranks"] == [0, 1, 2], 1, after=back)
        t_first, _ = events.wait(lambda e: e.get("event") == "step" and e["rank"] == 2
                                 and e["step"] > joined["step"] and e["step"] % h == 0,
                                 1, after=t_join)
        handed = [e for _, e in events.of("hand_over", 2)]
        transfer = handed[-1]["bytes"] * 8 / rate_bits(rate) if handed else 0.0
        row.update(back_s=t_first - back, joined_s=t_join - back,
                   handed_bytes=handed[-1]["bytes"] if handed else None,
                   handed_s=handed[-1]["seconds"] if handed else None,
                   transfer_at_rate_s=transfer,
                   target_s=(row["round_s"] or 0) + transfer + 10,
                   membership=[len(e["ranks"]) for _, e in events.of("membership")])
    return row


RUNS = {"plain": (None, False), "min_nodes": (2, False), "kill": (2, True)}


def hosts_part(model: str, rate: str, away: float, work: Path, max_steps: int,
               runs: list[str]) -> list[dict]:
    from netbed import Testbed, check_requirements

    missing = check_requirements(pin=False)
    if missing:
        raise SystemExit("cannot build the test bed:\n  " + "\n  ".join(missing))
    budget_file = work / "budget.json"
    subprocess.run([sys.executable, __file__, "_budget", model, str(budget_file)], cwd=ROOT,
                   check=True)
    budget = json.loads(budget_file.read_text())
    print(json.dumps({"accounted_per_rank": budget}), flush=True)
    rows = []
    with Testbed(2, subnet="10.213.95", pin=False) as bed:
        bed.shape(rate)
        bed.shape_uplink(rate)
        for name in runs:
            min_nodes, kill = RUNS[name]
            # A killed host must have rounds left to come back to: three times the steps.
            steps = 3 * max_steps if kill else max_steps
            row = host_run(bed, model, rate, min_nodes, kill, away, work, steps)
            row["accounted"] = budget
            row["peak_over_accounted"] = {
                rank: peak / budget["budget_bytes"]
                for rank, peak in row["peak_rss_bytes"].items() if peak}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def hosts_table(rows: list[dict], model: str, rate: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"3 hosts at {rate}: DiLoCo H={HOSTS['H']} on the {model} model")
    for col in ("run", "round", "vs without min_nodes", "all-reduce", "MiB per round",
                "ring bound", "sync efficiency", "back to work", "target",
                "peak RSS / accounted (rank 0, 1, 2)", "finished"):
        table.add_column(col, justify="right")
    base = next((r["round_s"] for r in rows if r["run"] == "no min_nodes"), None)
    for r in rows:
        table.add_row(r["run"], f"{r['round_s']:.2f} s" if r["round_s"] else "-",
                      f"{r['round_s'] / base:.2f}x" if base and r["round_s"] else "-",
                      f"{r['allreduce_s']:.2f} s" if r["allreduce_s"] else "-",
                      f"{r['bytes_per_round'] / 2**20:.0f}", f"{r['ring_bound_s']:.2f} s",
                      f"{r['efficiency']:.2f}" if r["efficiency"] else "-",
                      f"{r['back_s']:.1f} s" if "back_s" in r else "-",
                      f"{r['target_s']:.1f} s" if "target_s" in r else "-",
                      ", ".join(f"{r['peak_over_accounted'][k]:.2f}x"
                                for k in sorted(r.get("peak_over_accounted", {}))) or "-",
                      str(r["ok"]))
    Console(width=180).print(table)


def main() -> None:
    if sys.argv[1:2] == ["_child"]:
        child(sys.argv[2:])
        return
    if sys.argv[1:2] == ["_budget"]:
        budget_child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="+", choices=["sim", "hosts"])
    parser.add_argument("--models", nargs="+", default=["23m"], choices=sorted(MODELS),
                        help="models simulated (default 23m)")
    parser.add_argument("--nodes", nargs="+", type=int, default=[2, 4, 8],
                        help="ranks simulated (default 2 4 8)")
    parser.add_argument("--gym", type=Path, default=None,
                        help="a checkout of https://github.com/exo-explore/gym to compare with")
    parser.add_argument("--host-model", default="124m", choices=sorted(MODELS))
    parser.add_argument("--rate", default="1gbit", help="every host's link (default 1gbit)")
    parser.add_argument("--away", type=float, default=10.0,
                        help="seconds the killed host stays away (default 10)")
    parser.add_argument("--host-steps", type=int, default=HOSTS["max_steps"],
                        help="steps of a run across hosts (the kill run: three times as many)")
    parser.add_argument("--host-runs", nargs="+", default=list(RUNS), choices=list(RUNS),
                        help="runs across hosts: plain (without min_nodes), min_nodes, kill")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = parser.parse_args()
    if args.gym is not None:
        if not (args.gym / "exogym" / "trainer.py").is_file():
            raise SystemExit(f"--gym {args.gym}: no exogym/trainer.py there; clone "
                             "https://github.com/exo-explore/gym and give its folder")
        tried = subprocess.run([sys.executable, "-c", "import exogym.trainer"], cwd=ROOT,
                               env=dict(os.environ, PYTHONPATH=str(args.gym)),
                               capture_output=True, text=True)
        if tried.returncode != 0:
            raise SystemExit(f"--gym {args.gym}: its exogym does not import here "
                             f"({tried.stderr.strip().splitlines()[-1]}); install what it "
                             "needs (einops, at least: pip install einops)")
    work = Path(tempfile.mkdtemp(prefix="real-size-"))
    print(f"logs in {work}", flush=True)
    report: dict[str, Any] = {"cores": os.cpu_count(), "sim_workload": SIM,
                              "host_workload": HOSTS}
    if "sim" in args.parts:
        report["sim"] = sim(args.models, args.nodes, args.gym, work)
        sim_tables(report["sim"])
    if "hosts" in args.parts:
        report["hosts"] = hosts_part(args.host_model, args.rate, args.away, work,
                                     args.host_steps, args.host_runs)
        hosts_table(report["hosts"], args.host_model, args.rate)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"figures in {args.json}")


if __name__ == "__main__":
    main()
