"""Replay a recorded run in the simulator, and ask "what if" of the same cluster.

``cli_typer.py replay RUN_DIR`` reads a run's folder (``trace.jsonl``,
``summary.json``, ``run.json``; :mod:`exogym.report.trace`) and simulates the
run again on this machine (:func:`replay`):

- **the same run**: the profile and every setting from the run's identity
  (``run.json``: its fingerprint must be the trace's), so the same seed and data
  order, and as many steps as the run made;
- **the same ranks**: each rank's own seconds at each step as recorded (across
  hosts a step's wall time less its collectives; with a simulated clock the
  compute it charged) as the clock's ``compute_schedule``, so the clock charges
  every rank what it took, step by step (a machine busier in one part of the run
  than in another included); ``rank_speeds`` (on ``compute_time_s``, the fastest
  rank's mean) say each rank's mean speed;
- **the same links**: ``network=`` from each host's pre-flight link rate and
  latency across hosts (the trace's ``hosts``), or the simulation's own network;
- **the same events**: the recorded membership timeline (hosts lost and
  readmitted) as ``rank_failures``.

Evaluation and the hand-over of the state to a readmitted rank cost a real run
time that the simulated clock does not charge: the seconds one evaluation added
to the recorded run (:func:`eval_seconds`, apart for an evaluation that ends a
round and one inside a round, which must first gather the ranks' models) are
added to the replay's timeline at each evaluation, by where it falls in the
replayed strategy's rounds, and each recorded hand-over's seconds at the replay's
readmission of the same order (:func:`hand_over_seconds`).

Figures (:class:`Timeline`), for the recorded run and each replay, on one rank's
clock (the lowest rank present at every step; wall seconds across hosts, simulated
seconds in a clocked simulation): total time, the time of every round (the
strategy's ``round_steps``: ``H``, or one step), the time each membership change
cost (the rounds around it beyond the median round) and the validation loss at
each evaluation.

**What if** (:func:`plan_variants`): the same cluster, links and events under
other strategies or settings; each is ranked by the simulated time it takes to
reach the recorded run's final validation loss, or said never to reach it within
the run's samples. Every variant is checked before the first replay starts.

The modules, by role:

- :mod:`.load`: read and check a run's folder (JSON only, nothing unpickled; code
  it names is imported only when the person's own profiles name it too);
- :mod:`.recording`: the recorded run and what its cluster was (each rank's time per
  step, the links, the absences);
- :mod:`.timelines`: a run's :class:`Timeline` from its trace lines;
- :mod:`.variants`: the replays to run, the what-ifs checked;
- :mod:`.running`: each replay simulated here;
- :mod:`.report`: the comparison as JSON, as a page and as terminal tables.
"""

from __future__ import annotations

from exogym.base.terminal import stdout_to_stderr

from .load import (
    NEEDED_VERSION,
    load_recording,
    one_timeline,
    rebuild_profile,
    round_steps_of,
    untrusted_code,
)
from .recording import Recording, ReplayError
from .report import (
    REPLAY_FOLDER,
    ReplayResult,
    ReplayTables,
    describe_cluster,
    replay_tables,
    write_outputs,
)
from .running import replay, simulate
from .timelines import (
    Timeline,
    absences,
    detection_waits,
    eval_seconds,
    hand_over_seconds,
    membership_lines,
    reference_rank,
    time_to_loss,
    timeline,
)
from .variants import RECORDED_KEYS, Variant, plan_variants, replay_profile

__all__ = ["NEEDED_VERSION", "RECORDED_KEYS", "REPLAY_FOLDER", "Recording", "ReplayError",
           "ReplayResult", "ReplayTables", "Timeline", "Variant", "absences", "describe_cluster",
           "detection_waits", "eval_seconds", "hand_over_seconds", "load_recording",
           "membership_lines", "one_timeline", "plan_variants", "rebuild_profile",
           "reference_rank", "replay", "replay_profile", "replay_tables", "round_steps_of",
           "simulate", "stdout_to_stderr", "time_to_loss", "timeline", "untrusted_code",
           "write_outputs"]
