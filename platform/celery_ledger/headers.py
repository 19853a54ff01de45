"""Names of the message headers celery-ledger adds (they travel with every message).

A republished message (a retry, a deferral, the reconciler's or a replay's copy) carries the
ledger's headers of the original, so the job keeps its key, tier, age and retry state.

Each header is either bound by the message's signature (``celery_ledger.signing.BOUND_HEADERS``:
it decides what happens to the job) or listed in ``UNBOUND_HEADERS`` there with the reason it
may change unsigned; a header added here needs its place in one of the two.
"""

from . import tracecontext

KEY = "ledger_key"  # the idempotency key: with the task name, the job's identity
TIER = "ledger_tier"  # the tier the message was routed to
DEFERRALS = "ledger_deferrals"  # how often the job was put off (no attempt used)
PREVIOUS_DELAY = "ledger_previous_delay"  # seconds of the last retry's backoff (decorrelated)
# Unix time the job was first enqueued: its first publish, or its due time when published for
# later (its max age and latency objective count from it).
ENQUEUED_AT = "ledger_enqueued_at"
SENT_AT = "ledger_sent_at"  # unix time of this publish (queue wait metrics)
# A message no worker could run yet (unknown task, arguments that do not bind): when a worker
# first put it off, and how often since (its backoff). Dead-lettered once the window ends.
UNRUNNABLE_SINCE = "ledger_unrunnable_since"
UNRUNNABLE_DEFERRALS = "ledger_unrunnable_deferrals"

# A workflow's step: the workflow to wake once the step's outcome is recorded, and its tier.
WORKFLOW = "ledger_workflow"
WORKFLOW_TIER = "ledger_workflow_tier"

# The message's authentication (see celery_ledger.signing): signed at every publish, never
# carried over (a republish signs again).
SIGNATURE = "ledger_signature"

# A message *property*, not a header: true on a job's first publish when no ledger record was
# written for it (``apply_async`` without ``dedupe_on_publish``), so that the first claim is
# tried as an insert, the cheapest write. It says something of this one publish only: a
# property is never copied by a retry or a deferral (Celery copies the headers), and a worker
# of an earlier release ignores a property it does not know, where it refuses an unknown
# ``ledger_`` header (so producers may be upgraded before workers). A hint: wrong either way,
# the claim costs at most two more writes and claims the same.
NEW = "ledger_new"
# A message *property* too: how many deliveries of the job handed the message back alive while
# the ledger was unreachable, so that the ledger could not learn it (their claims still count
# as deliveries without an outcome there). The next claim's poison check does not count them
# as lost workers. Carried by each deferral copy (set again at each, as ``ledger_new`` is
# not), dropped by a retry (its recorded outcome clears the count in the ledger). A property,
# so that a worker of an earlier release, which refuses an unknown ``ledger_`` header, takes
# the message; unsigned, like every property: a forged count only lets a job whose worker
# keeps dying run up to ``MAX_HANDED_BACK`` more times before it is poison.
HANDED_BACK = "ledger_handed_back"
MAX_HANDED_BACK = 100
# A message *property* on the copy of a parked message that a worker took to run (the handoff,
# see celery_ledger.handoff): the parked entry's id, which that worker removes when the copy
# arrives. Unsigned: a forged id only removes a parked entry early, whose message still
# returns to its queue from the delayed set.
PARKED = "ledger_parked"
# A message *property*: the job's tenant (celery_ledger.tenancy), which fair dispatch reads in
# the transport. A property, so that a worker of an earlier release takes the message; set again
# at every publish (from the call, the task's option, the delivery or the kept message, which
# keeps it with the headers it carries). Unsigned: a forged tenant only changes whose turn the
# job waits for. (fairness.TENANT_PROPERTY: the same name, held equal by a unit test.)
TENANT = "ledger_tenant"
PROPERTIES = (NEW, HANDED_BACK, PARKED, TENANT)


# Headers a republish copies from the original message (see KeptMessage); TENANT is kept with
# them, and sent as the property it is.
CARRIED = (
    TENANT,
    KEY,
    TIER,
    ENQUEUED_AT,
    PREVIOUS_DELAY,
    DEFERRALS,
    WORKFLOW,
    WORKFLOW_TIER,
    # The job's W3C trace context (OpenTelemetry's headers, not ours: unsigned, and read by
    # nothing that decides what happens to the job; a malformed one is dropped, never checked).
    *tracecontext.HEADERS,
)
