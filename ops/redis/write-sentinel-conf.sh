#!/bin/sh
# Writes a sentinel's configuration (a failover group: docker-compose.sentinel.yml) from the
# environment and prints nothing secret. Each sentinel watches the primary named MASTER_NAME,
# reaches the data nodes as their "sentinel" user, the other sentinels as "peer", and admits
# clients as "ledger" (workers, producers, the CLI, Flower: the commands that find the primary)
# or "peer". No default user.
#
#   REDIS_SENTINEL_PASSWORD          the data nodes' "sentinel" user (ops/redis/write-acl.sh)
#   SENTINEL_PEER_PASSWORD           user "peer": the sentinels among themselves
#   SENTINEL_CLIENT_PASSWORD         user "ledger": the platform's clients
#   MASTER_NAME (ledger) PRIMARY_HOST (redis) PRIMARY_PORT (6379) QUORUM (2)
#   DOWN_AFTER_MS (5000) FAILOVER_TIMEOUT_MS (60000)
#   ANNOUNCE_HOST: the name the other sentinels and the clients reach this one by
#
# usage: write-sentinel-conf.sh OUTPUT_FILE
# A missing password or a .env.example placeholder (change-me*) stops here with exit 78. The
# sentinel rewrites this file with what it learns (replicas, other sentinels, the epoch): keep
# it on a volume of its own to keep that across restarts.
set -eu
out=${1:?usage: write-sentinel-conf.sh OUTPUT_FILE}

check() {  # check NAME: exit 78 unless $NAME is set and not a placeholder
  eval "value=\${$1:-}"
  case "$value" in
    "") echo "$1 is not set: set it in .env" >&2; exit 78 ;;
    change-me*) echo "$1 is the .env.example placeholder: set a real secret in .env" >&2; exit 78 ;;
  esac
}
check REDIS_SENTINEL_PASSWORD
check SENTINEL_PEER_PASSWORD
check SENTINEL_CLIENT_PASSWORD
name=${MASTER_NAME:-ledger}
if [ -s "$out" ]; then exit 0; fi  # (kept: the sentinel's own state since its first start)

umask 077
client=$(printf %s "$SENTINEL_CLIENT_PASSWORD" | sha256sum | cut -d' ' -f1)
peer=$(printf %s "$SENTINEL_PEER_PASSWORD" | sha256sum | cut -d' ' -f1)
tmp="$out.tmp.$$"
{
  echo "port 26379"
  echo "sentinel resolve-hostnames yes"
  echo "sentinel announce-hostnames yes"
  if [ -n "${ANNOUNCE_HOST:-}" ]; then echo "sentinel announce-ip $ANNOUNCE_HOST"; fi
  echo "user default off resetkeys resetchannels -@all"
  echo "user peer on #$peer allchannels +@all"
  echo "user ledger on #$client resetchannels -@all +auth +hello +ping +client|setname +sentinel|masters +sentinel|master +sentinel|get-master-addr-by-name +sentinel|sentinels +sentinel|replicas +sentinel|slaves"
  echo "sentinel sentinel-user peer"
  echo "sentinel sentinel-pass $SENTINEL_PEER_PASSWORD"
  echo "sentinel monitor $name ${PRIMARY_HOST:-redis} ${PRIMARY_PORT:-6379} ${QUORUM:-2}"
  echo "sentinel auth-user $name sentinel"
  echo "sentinel auth-pass $name $REDIS_SENTINEL_PASSWORD"
  echo "sentinel down-after-milliseconds $name ${DOWN_AFTER_MS:-5000}"
  echo "sentinel failover-timeout $name ${FAILOVER_TIMEOUT_MS:-60000}"
  echo "sentinel parallel-syncs $name 1"
} > "$tmp"
mv "$tmp" "$out"
