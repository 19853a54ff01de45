"""Small Celery apps the benchmarks start workers with, one module per configuration.

Each module builds its app lazily from the environment (``BENCH_*``, ``LEDGER_*``) when the
worker asks for ``app``; the benchmark builds its own producer-side copy with ``build(env)``.
"""
