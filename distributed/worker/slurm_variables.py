"""SLURM's variables under ``srun`` and its compressed node lists (the rank variables they
imply are :func:`distributed.worker.environment.slurm_rank_variables`'s).

``srun python -m distributed.worker --profile NAME`` starts one process per
task with ``SLURM_PROCID`` (the rank), ``SLURM_NTASKS`` (the world size),
``SLURM_LOCALID`` (the rank on its node) and the job's nodes in a compressed
list such as ``node[01-04,07]`` or ``gpu-a[1-2],gpu-b3``. The master is the
first node of the step (``SLURM_STEP_NODELIST``, else ``SLURM_JOB_NODELIST``):
SLURM places task 0 there. The port is ``MASTER_PORT`` or, when unset, derived
from ``SLURM_JOB_ID`` so every task of a job picks the same one. Node lists
are expanded here, without ``scontrol``, so a rank needs nothing from SLURM
but its environment.
"""

from __future__ import annotations

import re

from exogym.base.plural import plural

#: The variables that make a process a SLURM task: its rank and the number of ranks.
SLURM_TASK_VARIABLES = ("SLURM_PROCID", "SLURM_NTASKS")
#: Where the job's (or step's) nodes are listed, most specific first.
NODELIST_VARIABLES = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
#: Ports derived from the job id fall in [PORT_BASE, PORT_BASE + PORT_SPAN), below Linux's
#: ephemeral range, so a job's port rarely meets one the kernel handed out.
PORT_BASE = 12000
PORT_SPAN = 20000

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list as host names, in order: ``"n[01-02],gpu3"`` -> n01, n02, gpu3.

    Handles ranges with leading zeros (``[08-11]`` keeps two digits), several
    ranges and single numbers in one bracket, several prefixes separated by
    commas, and several bracket groups in one name (``r[1-2]n[1-2]``).

    Raises:
        ValueError: for a list that is not SLURM's form (unbalanced brackets,
            an empty or reversed range, letters in a range), naming the part.
    """
    if not isinstance(nodelist, str) or not nodelist.strip():
        raise ValueError(f"SLURM node list is empty ({nodelist!r}); expected e.g. "
                         "'node[01-04]' or 'gpu-a1,gpu-b3'")
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip(), nodelist):
        hosts.extend(_expand_item(item, nodelist))
    return hosts


def first_node(nodelist: str) -> str:
    """The first host of a compressed node list, where SLURM starts task 0."""
    return expand_nodelist(nodelist)[0]


def _bad(nodelist: str, why: str) -> ValueError:
    return ValueError(f"SLURM node list {nodelist!r} is malformed: {why}; expected SLURM's "
                      "form, e.g. 'node[01-04,07]' or 'gpu-a[1-2],gpu-b3' (set MASTER_ADDR "
                      "to name the master yourself)")


def _split_top_level(text: str, nodelist: str) -> list[str]:
    """Split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise _bad(nodelist, f"nested '[' at position {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise _bad(nodelist, f"']' without '[' at position {i}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise _bad(nodelist, "a '[' is never closed")
    items.append(text[start:])
    for item in items:
        if not item.strip():
            raise _bad(nodelist, "an empty name between commas")
    return [item.strip() for item in items]


def _expand_item(item: str, nodelist: str) -> list[str]:
    """One name with any number of bracket groups: their cartesian product, in order."""
    open_at = item.find("[")
    if open_at < 0:
        if any(ch.isspace() for ch in item):
            raise _bad(nodelist, f"space inside the name {item!r}")
        return [item]
    close_at = item.index("]", open_at)
    prefix, body, rest = item[:open_at], item[open_at + 1:close_at], item[close_at + 1:]
    tails = _expand_item(rest, nodelist) if rest else [""]
    return [prefix + number + tail for number in _expand_ranges(body, nodelist)
            for tail in tails]


def _expand_ranges(body: str, nodelist: str) -> list[str]:
    """``"01-03,7"`` -> 01, 02, 03, 7: each range keeps the width of its first number."""
    numbers: list[str] = []
    for part in body.split(","):
        match = _RANGE.fullmatch(part.strip())
        if not match:
            raise _bad(nodelist, f"[{body}] holds {part!r}, not a number or a range a-b")
        lo, hi = match.group(1), match.group(2)
        if hi is None:
            numbers.append(lo)
            continue
        if int(hi) < int(lo):
            raise _bad(nodelist, f"the range {part!r} runs backwards")
        width = len(lo) if lo.startswith("0") else 0
        numbers.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return numbers


def tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Tasks on node ``node_id`` from ``SLURM_TASKS_PER_NODE`` (``"2(x3),1"``: 2, 2, 2, 1).

    Raises:
        ValueError: for a value not in SLURM's form, or a node beyond it.
    """
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = _TASKS.fullmatch(part.strip())
        if not match:
            raise ValueError(f"SLURM_TASKS_PER_NODE={tasks_per_node!r} is malformed at "
                             f"{part!r}; expected e.g. '2(x3),1'")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if not 0 <= node_id < len(counts):
        raise ValueError(f"SLURM_NODEID={node_id} is beyond SLURM_TASKS_PER_NODE="
                         f"{tasks_per_node!r} ({plural(len(counts), 'node')})")
    return counts[node_id]


def port_for_job(job_id: str) -> int:
    """The port every task of job ``job_id`` derives alike when ``MASTER_PORT`` is unset."""
    try:
        number = int(job_id)
    except ValueError:
        raise ValueError(f"SLURM_JOB_ID={job_id!r} is not a number; set MASTER_PORT "
                         "to choose the port") from None
    return PORT_BASE + number % PORT_SPAN
