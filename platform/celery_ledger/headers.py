"""Names of the message headers celery-ledger adds (they travel with every message)."""

KEY = "ledger_key"
TIER = "ledger_tier"
DEFERRALS = "ledger_deferrals"
PREVIOUS_DELAY = "ledger_previous_delay"
ENQUEUED_AT = "ledger_enqueued_at"  # unix time of the job's first publish (max age)
