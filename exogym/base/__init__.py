"""Helpers every part of exogym uses: atomic file writes, the wording of messages, the terminal."""
