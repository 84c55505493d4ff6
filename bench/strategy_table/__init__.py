"""Every strategy on one task, measured: bytes, final loss, wall time and simulated time.

Each strategy (DDP, DiLoCo, Streaming DiLoCo, SparseLoCo, SPARTA, SPARTA-DiLoCo,
FedAvg, DeMo, MuLoCo, DES-LOC, and AsyncDiLoCo where this checkout has it)
trains chargpt (``distributed.tasks.builtin.chargpt_task``) with K simulated
ranks, the same initial weights, data, inner steps and samples, under a
simulated 100 Mbit/s network (``fit(network=...)``)::

    python -m bench.strategy_table --quick                 # tiny model, seconds
    python -m bench.strategy_table --jobs 4                # 3.3M parameters, K=4
    python -m bench.strategy_table --jobs 4 --resume       # continue after a stop
    python -m bench.strategy_table --only diloco,sparta    # a subset (DDP always runs)
    python -m bench.strategy_table --report-only           # table and plot from results.json

1. **Sweep**: each strategy's main setting (``H``; ``p_sparta``; DeMo's and
   SparseLoCo's top-k; DES-LOC's ``H_params`` with its moments at 3x and 6x) at
   three values, first seed only (:mod:`bench.strategy_table.grid` lists them).
2. **Choice** (the budget rule): the lowest final validation loss among the
   values that send at most ``--budget`` (default 0.1) of DDP's bytes; when none
   does, the value that sends least.
3. **Seeds**: the chosen value at every seed (the seed sets the initial weights,
   the data order and the strategy's randomness); figures are means, the loss
   also with its standard deviation and range.

Columns: bytes per rank relative to DDP (the comm module's counters: the
payload handed to collectives), the final validation loss of the averaged
model and its ratio to DDP's, the wall time of ``fit``, and the simulated end of
the run at 100 Mbit/s (the run's clock) and at 1 Gbit/s. The 1 Gbit/s time is
derived from the same run: with synchronous collectives and no latency, the
network's share of the clock scales with 1/bandwidth and the rest (compute,
waits for the slowest rank) does not, so ``T(1 Gbit/s) = T(100 Mbit/s) - 0.9 *
network share`` (:mod:`bench.strategy_table.child` says how the share is read).
Where collectives overlap compute (Streaming DiLoCo's ``fragment_delay``,
AsyncDiLoCo) the rule does not hold, and the chosen value runs again at every
seed under 1 Gbit/s: the table marks those times ``(sim)``.

Outputs in ``--out`` (default ``runs/strategy_table``, ``--quick``:
``runs/strategy_table_quick``), each written atomically: ``results.json``
(every run, written after each one finishes, so a stop loses only the runs in
flight; ``--resume`` skips the finished ones), ``table.md`` and
``loss_vs_bytes.png`` (the Pareto front: no other strategy has both fewer
bytes and a lower loss).

Its parts: :mod:`~bench.strategy_table.grid` (scales, strategies, runs),
:mod:`~bench.strategy_table.child` (one run in a worker),
:mod:`~bench.strategy_table.runner` (workers), :mod:`~bench.strategy_table.results`
(choice, rows, front), :mod:`~bench.strategy_table.plot`, ``__main__`` (the command line).
"""
