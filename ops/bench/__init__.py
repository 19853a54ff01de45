"""Benchmarks against plain Celery: ``python -m ops.bench.throughput | roundtrips | scale``."""
