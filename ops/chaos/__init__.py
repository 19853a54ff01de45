"""Chaos soak: ``python -m ops.chaos.soak --profile ci|long`` (see ``ops/chaos/soak.py``)."""
