"""profiles: named runs in config.ini, and the files the wizard writes.

A profile is resolved once into the task, the strategy and the run keys every
consumer uses. May import tasks and exogym; never hosts, launch, worker or app.
"""
