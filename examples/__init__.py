"""Examples of using exogym and distributed; run each from the project root (see its docstring)."""
