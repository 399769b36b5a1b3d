"""Benchmarks (measurements, not timed tests)."""
