"""Marks an engine passes to ``apply_async`` to say how a publish is admitted (popped by
``LedgerTask.apply_async``; never sent). Plain values, below the engines and the adapters
that share them (a trigger's watcher, the workflow engine's steps, the task class)."""

from __future__ import annotations

# Marks a publish of a job already admitted and known (a trigger's job whose ``queued``
# record exists, its message sent again): no backpressure, no dedupe.
ADMITTED = "ledger_admitted"
# Marks a publish of a started workflow's step: no backpressure (the workflow was admitted when
# it started), and otherwise a first publish: with dedupe on publish its ``queued`` record is
# written first. That record is what tells the engine that a step still waits behind a backlog
# (a step with none looks lost after a few checks and is published again: the long chaos soak's
# queues held two or three copies of many steps, each a claim, when steps skipped the record),
# and a step whose message is lost is then the reconciler's, as any queued job's.
WORKFLOW_STEP = "ledger_workflow_step"
# Marks a publish whose caller waits and tries again rather than have its job shed: a
# change-stream trigger's (a shed change's job would be recorded dead while its stream moved
# past it). Above the mark, under any policy, it gets ``Backpressure``.
NEVER_SHED = "ledger_never_shed"
