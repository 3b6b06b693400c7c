#!/usr/bin/env bash
# A private CA and a server certificate for the home Redis (rediss://) and store proxy (https://).
#   deploy/burst/make-certs.sh home.example.net [OUT_DIR] [MORE_NAMES...]
# Writes ca.crt, ca.key, server.crt, server.key into OUT_DIR (default ./tls). Set TLS_DIR=OUT_DIR in
# compose/.env and BURST_CA_CERT="$(cat OUT_DIR/ca.crt)" on the burst box. Keep ca.key offline.
# A certificate from a public CA for the same name works too and needs no BURST_CA_CERT.
# MORE_NAMES: other names the certificate answers to (a LAN name, an address: 192.168.1.10).
set -euo pipefail
name="${1:?usage: make-certs.sh DNS_NAME [OUT_DIR]}"
out="${2:-tls}"
san="DNS:$name"
for extra in "${@:3}"; do
  if [[ "$extra" =~ ^[0-9.]+$|: ]]; then san+=",IP:$extra"; else san+=",DNS:$extra"; fi
done
mkdir -p "$out" && cd "$out"
umask 077
[[ -f ca.key ]] || openssl req -x509 -newkey rsa:4096 -sha256 -days 3650 -nodes \
  -keyout ca.key -out ca.crt -subj "/CN=burstrl home CA"
openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj "/CN=$name"
openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 825 -sha256 \
  -extfile <(printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\n' "$san") -out server.crt
rm -f server.csr
chmod 0644 ca.crt server.crt
echo "wrote $(pwd)/{ca.crt,server.crt,server.key}; keep ca.key private"
# Redis runs as uid 999 in its image and must read the key; nobody else should.
echo "then: sudo chown 999 $(pwd)/server.key"
