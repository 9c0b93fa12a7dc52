"""Benchmarks of the engine and the API, with their common module."""
