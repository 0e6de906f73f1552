"""Helpers for the tests: fakes, real-engine launchers, workflow copies, tokenizers."""
