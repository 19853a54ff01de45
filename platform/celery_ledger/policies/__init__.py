"""Policies: the platform's decisions, one per module (retry, backoff, deadline, fallback,
schedule, unrunnable, throttle: pure functions and values over what they are given).

Three also hold the fleet's shared state of their decision in Redis, beside the pure part
(each module says which is which): the circuit breakers (``breaker.Breakers``), the shared
rate limits (``rate_limit.RateLimits``) and the queue depths behind backpressure
(``backpressure.QueueDepths``); ``retry`` only names Redis's errors to classify them."""
