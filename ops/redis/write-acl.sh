#!/bin/sh
# Writes the broker's ACL file (one user per role, no default user) from the environment and
# prints nothing secret. The compose file runs it in the Redis container before the server
# starts; the tests run this same script against a real server.
#
#   REDIS_WORKER_PASSWORD   user "ledger": workers, producers, the CLI (the app's one user)
#   REDIS_FLOWER_PASSWORD   user "flower": Flower (events, inspect/control; reads any key)
#   REDIS_HEALTH_PASSWORD   user "health": the healthcheck (PING only)
#   REDIS_ADMIN_PASSWORD    optional user "admin": an operator's redis-cli (every command)
#   REDIS_REPLICA_PASSWORD  optional user "replica": a replica's link to its primary (Sentinel)
#   REDIS_SENTINEL_PASSWORD optional user "sentinel": the sentinels' watch and failover commands
#
# usage: write-acl.sh OUTPUT_FILE
# A password is stored as its SHA-256 (Redis's "#<hash>" form), never in clear; a missing one
# or a .env.example placeholder (change-me*) stops here with exit 78, before any server runs.
set -eu
out=${1:?usage: write-acl.sh OUTPUT_FILE}

secret() {  # secret NAME: the SHA-256 of the password in $NAME, or exit 78
  eval "value=\${$1:-}"
  case "$value" in
    "") echo "$1 is not set: set it in .env" >&2; exit 78 ;;
    change-me*) echo "$1 is the .env.example placeholder: set a real secret in .env" >&2; exit 78 ;;
  esac
  printf %s "$value" | sha256sum | cut -d' ' -f1
}

worker=$(secret REDIS_WORKER_PASSWORD)
flower=$(secret REDIS_FLOWER_PASSWORD)
health=$(secret REDIS_HEALTH_PASSWORD)
admin=""
if [ -n "${REDIS_ADMIN_PASSWORD:-}" ]; then admin=$(secret REDIS_ADMIN_PASSWORD); fi
replica=""
if [ -n "${REDIS_REPLICA_PASSWORD:-}" ]; then replica=$(secret REDIS_REPLICA_PASSWORD); fi
sentinel=""
if [ -n "${REDIS_SENTINEL_PASSWORD:-}" ]; then sentinel=$(secret REDIS_SENTINEL_PASSWORD); fi

umask 077
tmp="$out.tmp.$$"
{
  # No anonymous access: a client must say who it is.
  echo "user default off resetkeys resetchannels -@all"
  # The app's user: everything a broker client needs (queues, the delayed set, breakers'
  # scripts, pub/sub for events and control), nothing that configures, wipes or watches the
  # server (@dangerous: FLUSHALL, CONFIG, KEYS, MONITOR, DEBUG, SHUTDOWN, CLIENT KILL, ...).
  echo "user ledger on #$worker ~* &* +@all -@dangerous -@admin"
  # Flower: a Celery client for events and inspect/control. It may read every key
  # but write only kombu's bindings, the control replies and events: it cannot put a
  # job on a queue, take one off kombu's unacknowledged bookkeeping (it runs with
  # LEDGER_RESTORE_UNACKED=false), touch the delayed set or a breaker, and nothing
  # dangerous. It can still send control commands (revoke, shutdown): its web UI's
  # authentication guards that.
  echo "user flower on #$flower resetkeys %R~* ~_kombu.* ~*.reply.celery.pidbox* ~celeryev* &* +@all -@dangerous -@admin"
  echo "user health on #$health resetkeys resetchannels -@all +ping"
  if [ -n "$admin" ]; then echo "user admin on #$admin ~* &* +@all"; fi
  # A failover group (docker-compose.sentinel.yml): a replica replicates and nothing else; a
  # sentinel runs the commands Redis's Sentinel documentation lists for it, and reads no key.
  if [ -n "$replica" ]; then echo "user replica on #$replica resetkeys resetchannels -@all +psync +replconf +ping"; fi
  if [ -n "$sentinel" ]; then echo "user sentinel on #$sentinel resetkeys allchannels -@all +multi +slaveof +replicaof +ping +exec +subscribe +config|rewrite +role +publish +info +client|setname +client|kill +script|kill"; fi
} > "$tmp"
mv "$tmp" "$out"
