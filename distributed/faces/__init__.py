"""faces: the command line (``exogym``, ``cli_typer.py``) and the wizard (``exogym wizard``,
``wizard.py``). They parse, ask and print; everything they do is in ``app/``."""
