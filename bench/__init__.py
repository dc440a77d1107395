"""Reproducible benchmarks; each writes JSON (and PNG where a curve says more)."""
