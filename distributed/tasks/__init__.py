"""tasks: the built-in training tasks (digits, chargpt) and tasks/whisper.

A task is ``f(**settings) -> (model, train_dataset, val_dataset)``. May import
exogym only; never hosts, profiles, planning, launch, rank or app.
"""
