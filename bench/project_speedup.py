"""Project time per step and speedup to 2..64 hosts, and check the model against measurements.

The model is ``distributed/planning/projection.py`` (ring all-reduce and all-gather
cost models; see its docstring). Its inputs are measured: the compute time of
one step on one host, the time one host needs per minibatch when it does all
the work alone, and the link's goodput and round trip. Give them either as the
JSON that ``python -m bench.multihost`` writes, which also holds the N-host
measurements the projection is validated against, or as flags:

    python -m bench.project_speedup --results runs/multihost/latest/results.json
    python -m bench.project_speedup --num-params 3257856 --compute-s 0.31 \\
        --throughput 11.0e6 --strategies ddp,diloco:100,sparta:0.005 --hosts 2,4,8,64

Strategies are written ``ddp``, ``diloco[:H]``, ``streaming_diloco[:H[:F]]``,
``sparseloco[:H]`` (it needs the results JSON: its payload is sized per tensor),
``sparta[:p]``, ``demo[:topk]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.harness.strategies import StrategyCase, parse_strategies
from bench.harness.tables import markdown_table, print_table
from distributed.planning.projection import predict_step_time, project, speedup
from tests.netbed import rate_bits

DEFAULT_HOSTS = (2, 4, 8, 16, 32, 64)
def parse_hosts(text: str) -> list[int]:
    """``2,4,8`` -> ``[2, 4, 8]``."""
    try:
        hosts = [int(h) for h in text.split(",") if h.strip()]
    except ValueError:
        raise ValueError(f"--hosts must be whole numbers separated by commas, got {text!r}") \
            from None
    if not hosts or min(hosts) < 1:
        raise ValueError(f"--hosts must list host counts >= 1, got {text!r}")
    return hosts


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Link:
    """A link as the model sees it: payload goodput per host and one-way latency."""

    name: str
    throughput_bytes_per_s: float
    latency_s: float = 0.0


@dataclass(frozen=True)
class Inputs:
    """Everything the projection needs.

    Args:
        num_params: trainable parameters.
        shapes: their tensors' shapes (for DeMo), if known.
        compute_s: seconds per step on one host without communication, per
            compute kind (``adamw``, ``demo``).
        compute_sd_s: the standard deviation of those from step to step.
        minibatch_s: seconds one host needs per minibatch when it does all the work.
        links: the links to project for.
        cases: the strategies.
        demo_payload: DeMo's bytes per host per step when ``shapes`` is unknown.
    """

    num_params: int
    shapes: list[list[int]] | None
    compute_s: dict[str, float]
    minibatch_s: float
    links: list[Link]
    cases: list[StrategyCase]
    demo_payload: float | None = None
    compute_sd_s: dict[str, float] = field(default_factory=dict)

    def settings(self, case: StrategyCase) -> dict[str, Any]:
        """The projection's keyword arguments for ``case``, the compute spread included."""
        sd = self.compute_sd_s.get(case.compute, self.compute_sd_s.get("adamw", 0.0))
        return {**case.projection_settings(self.shapes, self.demo_payload), "compute_sd_s": sd}

    def compute_for(self, case: StrategyCase) -> float:
        """The compute time of ``case``'s step (``adamw`` when its own is unknown)."""
        return self.compute_s.get(case.compute, self.compute_s.get("adamw", 0.0))


def case_from_run(run: dict[str, Any]) -> StrategyCase:
    """The :class:`StrategyCase` a results-file run was made with."""
    return StrategyCase(run["label"], run["strategy"], dict(run["settings"]), run["period"],
                        run["compute"])


def inputs_from_results(results: dict[str, Any]) -> Inputs:
    """Projection inputs from ``bench.multihost``'s results JSON."""
    baselines = results["baselines"]
    reference = baselines["reference"]
    cases: dict[str, StrategyCase] = {}
    for run in results["runs"]:
        cases.setdefault(run["label"], case_from_run(run))
    return Inputs(
        num_params=int(results["model"]["num_params"]),
        shapes=results["model"].get("shapes"),
        compute_s={k: v["step_s"] for k, v in baselines.items() if k != "reference"},
        compute_sd_s={k: v.get("step_sd_s", 0.0) for k, v in baselines.items()
                      if k != "reference"},
        minibatch_s=reference["step_s"] / reference["minibatches"],
        links=[Link(link["rate"], link["goodput_bytes_per_s"], link["rtt_s"] / 2)
               for link in results["links"]],
        cases=list(cases.values()),
    )


# --------------------------------------------------------------------------- tables


def predicted(inputs: Inputs, case: StrategyCase, link: Link, hosts: int) -> tuple[float, float]:
    """(seconds per step, speedup) the model predicts for ``case`` on ``hosts`` hosts."""
    settings = inputs.settings(case)
    compute = inputs.compute_for(case)
    step = predict_step_time(case.name, inputs.num_params, hosts, compute,
                             link.throughput_bytes_per_s, link.latency_s, **settings)
    gain = speedup(case.name, inputs.num_params, hosts, compute, link.throughput_bytes_per_s,
                   minibatch_s=inputs.minibatch_s, latency_s=link.latency_s, **settings)
    return step, gain


def validation_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """For every measured run: predicted and measured step time and speedup, relative errors.

    A run that carries the baselines measured next to it (``compute_s``,
    ``compute_sd_s``, ``reference_s``) is predicted from those, so drift of the
    machine's speed between the baselines and the run does not count as error.
    """
    inputs = inputs_from_results(results)
    links = {link.name: link for link in inputs.links}
    rows = []
    for run in results["runs"]:
        case = case_from_run(run)
        own = inputs
        if "compute_s" in run:
            own = replace(inputs, compute_s={case.compute: run["compute_s"]},
                          compute_sd_s={case.compute: run["compute_sd_s"]},
                          minibatch_s=run["reference_s"] / results["hosts"])
        step, gain = predicted(own, case, links[run["rate"]], results["hosts"])
        rows.append({
            "label": run["label"], "rate": run["rate"],
            "predicted_step_s": step, "measured_step_s": run["step_s"],
            "step_error": step / run["step_s"] - 1,
            "predicted_speedup": gain, "measured_speedup": run["speedup"],
            "speedup_error": gain / run["speedup"] - 1,
        })
    return rows


def projection_rows(inputs: Inputs, hosts: Sequence[int]) -> dict[str, list[list[Any]]]:
    """Per link, one row per strategy: the label, then the predicted speedup for each host count."""
    tables = {}
    for link in inputs.links:
        rows = []
        for case in inputs.cases:
            projected = project(case.name, inputs.num_params, hosts, inputs.compute_for(case),
                                link.throughput_bytes_per_s, minibatch_s=inputs.minibatch_s,
                                latency_s=link.latency_s, label=case.label,
                                **inputs.settings(case))
            rows.append([case.label, *projected])
        tables[link.name] = rows
    return tables


def human_rate(bytes_per_s: float) -> str:
    """Bytes per second as ``88.3 Mbit/s``."""
    bits = bytes_per_s * 8
    if bits >= 1e9:
        return f"{bits / 1e9:.2f} Gbit/s"
    return f"{bits / 1e6:.1f} Mbit/s"


def print_tables(inputs: Inputs, hosts: Sequence[int],
                 validation: list[dict[str, Any]] | None = None, measured_hosts: int = 2) -> None:
    """Print the projection per link and, when given, the validation against measurements."""
    from rich.console import Console

    console = Console()
    console.print(f"model: {inputs.num_params:,} parameters; compute per step on one host: "
                  + ", ".join(f"{k} {v:.3f} s (sd {inputs.compute_sd_s.get(k, 0.0):.3f} s)"
                              for k, v in inputs.compute_s.items())
                  + f"; one host alone: {inputs.minibatch_s:.3f} s per minibatch")
    for link, rows in projection_rows(inputs, hosts).items():
        info = next(x for x in inputs.links if x.name == link)
        print_table(f"projected speedup over one host, link {link} (goodput "
                    f"{human_rate(info.throughput_bytes_per_s)}, latency "
                    f"{info.latency_s * 1e3:.2f} ms)",
                    ["strategy", *(f"{n} hosts" for n in hosts)],
                    [(label, *(f"{p.speedup:.2f}x ({p.comm_fraction:.0%} comm)" for p in cells))
                     for label, *cells in rows], left=("strategy",), console=console)
    if validation:
        print_table(f"{measured_hosts}-host check: projection against the measurement",
                    ("strategy", "link", "step predicted", "step measured", "error",
                     "speedup predicted", "speedup measured", "error"),
                    [(row["label"], row["rate"], f"{row['predicted_step_s']:.3f} s",
                      f"{row['measured_step_s']:.3f} s", f"{row['step_error']:+.1%}",
                      f"{row['predicted_speedup']:.2f}x", f"{row['measured_speedup']:.2f}x",
                      f"{row['speedup_error']:+.1%}") for row in validation],
                    left=("strategy", "link"), console=console)
        worst = max(abs(r["step_error"]) for r in validation)
        console.print(f"largest step-time error: {worst:.1%}")


def markdown_projection(inputs: Inputs, hosts: Sequence[int]) -> str:
    """The projection as markdown tables, one per link."""
    parts = []
    for link, rows in projection_rows(inputs, hosts).items():
        parts.append(f"Projected speedup, link {link}:\n")
        parts += markdown_table(["strategy", *(f"{n} hosts" for n in hosts)],
                                [(label, *(f"{p.speedup:.2f}x" for p in cells))
                                 for label, *cells in rows], left=("strategy",))
        parts.append("")
    return "\n".join(parts)


# --------------------------------------------------------------------------- command line


def parse_throughput(text: str) -> float:
    """``11e6``, ``11MB/s``, ``88mbit`` -> bytes per second."""
    value = text.strip().lower()
    for unit, factor in (("gb/s", 1e9), ("mb/s", 1e6), ("kb/s", 1e3), ("b/s", 1.0)):
        if value.endswith(unit):
            return float(value[: -len(unit)]) * factor
    if value.endswith("bit"):
        return rate_bits(value) / 8
    return float(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.project_speedup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", help="results.json written by python -m bench.multihost")
    parser.add_argument("--hosts", default=",".join(map(str, DEFAULT_HOSTS)),
                        help="host counts to project for (default 2,4,8,16,32,64)")
    parser.add_argument("--num-params", type=int, help="trainable parameters")
    parser.add_argument("--compute-s", type=float, help="seconds per step on one host, no comm")
    parser.add_argument("--demo-compute-s", type=float,
                        help="seconds per DeMo step on one host (default: --compute-s)")
    parser.add_argument("--sparta-compute-s", type=float,
                        help="seconds per SPARTA step on one host (default: --compute-s)")
    parser.add_argument("--compute-sd-s", type=float, default=0.0,
                        help="standard deviation of the compute time per step (adds the wait "
                             "for the slowest host)")
    parser.add_argument("--minibatch-s", type=float,
                        help="seconds per minibatch of one host doing all the work "
                             "(default: --compute-s)")
    parser.add_argument("--throughput", help="payload goodput per host: 11e6, 11MB/s or 88mbit")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="one-way latency per round")
    parser.add_argument("--strategies", default="ddp,diloco:10,diloco:100,sparta",
                        help="strategies to project (with flags)")
    parser.add_argument("--demo-payload", type=float,
                        help="DeMo's bytes per host per step (with flags, for demo)")
    args = parser.parse_args(argv)
    try:
        hosts = parse_hosts(args.hosts)
        if args.results:
            path = Path(args.results)
            if not path.is_file():
                raise ValueError(f"--results {str(path)!r} does not exist: run "
                                 "python -m bench.multihost first, or give the inputs as flags")
            results = json.loads(path.read_text())
            print_tables(inputs_from_results(results), hosts, validation_rows(results),
                         results["hosts"])
            return 0
        missing = [flag for flag, value in (("--num-params", args.num_params),
                                            ("--compute-s", args.compute_s),
                                            ("--throughput", args.throughput)) if value is None]
        if missing:
            raise ValueError(f"give --results, or {', '.join(missing)} (see --help)")
        cases = parse_strategies(args.strategies)
        if any(c.name == "demo" for c in cases) and args.demo_payload is None:
            raise ValueError("demo needs --demo-payload (bytes per host per step) with flags; "
                             "the results JSON carries the model's shapes instead")
        compute = {"adamw": args.compute_s}
        if args.demo_compute_s is not None:
            compute["demo"] = args.demo_compute_s
        if args.sparta_compute_s is not None:
            compute["sparta"] = args.sparta_compute_s
        link = Link("given", parse_throughput(args.throughput), args.latency_ms / 1e3)
        inputs = Inputs(args.num_params, None, compute, args.minibatch_s or args.compute_s,
                        [link], cases, demo_payload=args.demo_payload,
                        compute_sd_s={"adamw": args.compute_sd_s})
        print_tables(inputs, hosts)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
