"""The arguments of ``fit``, defined once: fields, checks, derived values, and shared parsers."""
