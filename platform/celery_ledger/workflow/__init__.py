"""Durable workflows: the engine (``engine``), the ``wf`` context (``context``), the log's fold
(``history``) and the public handles (``api``)."""
