"""app: what the faces (cli_typer.py, wizard.py) call.

Run a profile, check hosts, compare strategies, the dashboards, the
NetworkTrainer driver, and the set-up steps the wizard takes. May import
launch, worker, profiles, planning, hosts, tasks and exogym; nothing imports app
but the faces.
"""
