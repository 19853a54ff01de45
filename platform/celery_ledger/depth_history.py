"""The last hour of queue depths, per minute: what the console's queue-depth chart draws.

A queue's depth is a number of the moment (one ``LLEN``); nothing else keeps its past. Every
worker's housekeeping samples the tiers' depths every :data:`SAMPLE_EVERY_SECONDS` (the console
also does, at each overview refresh) and records each tier's highest depth in the minute: one
Redis hash per minute (``<namespace>:ledger:depths:<minute>``, fields the tiers), kept for
:data:`KEEP_SECONDS` and written by a small script so that samples from several workers keep
the maximum, whatever their order. Reading the hour is one pipelined round trip of 60
``HGETALL``. A minute no one sampled (no worker running, say) reads as ``None``: a gap in the
chart, never an invented zero.
"""

from __future__ import annotations

from collections.abc import Mapping

import redis

SAMPLE_EVERY_SECONDS = 15.0
KEEP_SECONDS = 65 * 60  # an hour of minutes, and the one being filled

# KEYS[1]: the minute's hash; ARGV: ttl, then field, value pairs. Keeps each field's maximum.
_KEEP_MAX = """
for i = 2, #ARGV, 2 do
  local current = tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '-1')
  if tonumber(ARGV[i + 1]) > current then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  end
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""


def depths_key(namespace: str, minute: int) -> str:
    """The Redis key of one minute's depths (``minute``: unix seconds // 60)."""
    prefix = f"{namespace}:ledger:depths" if namespace else "ledger:depths"
    return f"{prefix}:{minute}"


class DepthHistory:
    """Each tier's highest sampled queue depth per minute, for the last hour (in Redis)."""

    def __init__(self, client: redis.Redis, *, namespace: str = "") -> None:
        self.client = client
        self.namespace = namespace
        self._script = client.register_script(_KEEP_MAX)

    def record(self, depths: Mapping[str, int], *, at: float) -> None:
        """Keep ``depths`` (by tier) sampled at ``at`` (unix seconds, the broker's clock)."""
        if not depths:
            return
        values: list[str | int] = [KEEP_SECONDS]
        for tier, depth in depths.items():
            values += [tier, int(depth)]
        self._script(keys=[depths_key(self.namespace, int(at // 60))], args=values)

    def window(self, *, minutes: int, now: float) -> dict[str, list[int | None]]:
        """Each tier's per-minute depths over the last ``minutes`` minutes ending with the
        minute of ``now``, oldest first; ``None`` where that minute has no sample."""
        last = int(now // 60)
        pipe = self.client.pipeline(transaction=False)
        for minute in range(last - minutes + 1, last + 1):
            pipe.hgetall(depths_key(self.namespace, minute))
        found = pipe.execute()
        tiers = sorted({_text(k) for sample in found for k in sample})
        return {tier: [_depth(sample, tier) for sample in found] for tier in tiers}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _depth(sample: Mapping[bytes | str, bytes | str], tier: str) -> int | None:
    value = sample.get(tier.encode(), sample.get(tier))
    return None if value is None else int(value)
