"""tasks: the built-in training tasks (digits, chargpt, gpt) and tasks/whisper.

A task is ``f(**settings) -> (model, train_dataset, val_dataset)``. May import
exogym only; never hosts, profiles, planning, launch, worker or app.
"""

#: The names a profile's ``task`` key may give for a built-in task (``builtin.BUILTIN_TASKS``'s
#: keys), known without importing the tasks (and torch).
BUILTIN_TASK_NAMES = ("digits", "chargpt", "whisper", "gpt")
