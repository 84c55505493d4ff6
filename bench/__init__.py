"""Benchmarks: they print figures and assert nothing; run by hand as ``python -m bench.NAME``."""
