#!/bin/sh
# Makes a private CA and the certificates for TLS between the platform and its servers:
#
#   ops/tls/make-certs.sh DIR [EXTRA_NAME ...]
#
# DIR/ca.pem                 the CA certificate every client trusts (ca.key: keep it offline)
# DIR/redis.pem, redis.key   the broker's certificate (names: redis, localhost, 127.0.0.1)
# DIR/mongo.pem              the ledger's certificate and key in one file, as mongod reads it
#                            (names: mongo, localhost, 127.0.0.1)
# DIR/client.pem, client.key a client certificate, for servers that require one
# EXTRA_NAME: more DNS names for both servers (the hosts clients use, e.g. redis.internal).
#
# Keys are 0600 and never leave DIR; certificates last 825 days (rerun to renew; the CA is
# reused when DIR/ca.key exists). docker-compose.tls.yml mounts DIR (TLS_CERTS_DIR) into the
# servers and workers; see README "TLS".
set -eu
dir=${1:?usage: make-certs.sh DIR [EXTRA_NAME ...]}
shift
mkdir -p "$dir"
chmod 700 "$dir"
umask 077
days=825

if [ ! -s "$dir/ca.key" ]; then
  openssl req -x509 -new -nodes -newkey rsa:3072 -sha256 -days 3650 \
    -subj "/CN=celery-ledger private CA" -keyout "$dir/ca.key" -out "$dir/ca.pem" 2>/dev/null
fi

issue() {  # issue NAME USAGE DNS...
  name=$1; usage=$2; shift 2
  sans="IP:127.0.0.1"
  for host in "$@"; do sans="$sans,DNS:$host"; done
  openssl req -new -nodes -newkey rsa:2048 -sha256 -subj "/CN=$name" \
    -keyout "$dir/$name.key" -out "$dir/$name.csr" 2>/dev/null
  printf 'subjectAltName=%s\nextendedKeyUsage=%s\nbasicConstraints=CA:FALSE\n' "$sans" "$usage" \
    > "$dir/$name.ext"
  openssl x509 -req -in "$dir/$name.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" \
    -CAcreateserial -days "$days" -sha256 -extfile "$dir/$name.ext" -out "$dir/$name.pem" 2>/dev/null
  rm -f "$dir/$name.csr" "$dir/$name.ext"
}

issue redis serverAuth redis localhost "$@"
issue mongo serverAuth mongo localhost "$@"
issue client clientAuth client
cat "$dir/mongo.key" >> "$dir/mongo.pem"  # mongod reads certificate and key from one file
rm -f "$dir/mongo.key" "$dir/ca.srl"
# The servers' processes read these inside their containers as other users: certificates are
# public, the keys readable by the owner only (the compose file runs the servers as root).
chmod 644 "$dir/ca.pem" "$dir/redis.pem" "$dir/client.pem"
chmod 600 "$dir/ca.key" "$dir/redis.key" "$dir/mongo.pem" "$dir/client.key"
echo "certificates in $dir: ca.pem, redis.pem/.key, mongo.pem, client.pem/.key"
