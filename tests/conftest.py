"""Fixtures shared by the test modules."""

from sshd_fixture import sshd  # noqa: F401  (a session fixture: one sshd for all tests)
