#!/usr/bin/env bash
# Makes a private CA and certificates for psd's TLS (README "TLS"), with Debian's openssl:
#   deploy/make_tls_certs.sh DIR [NAME|IP ...]
# DIR/ca.pem          the CA: give it to psd (--tls-ca-file) and to every client (tls_ca_file)
# DIR/server.pem/.key psd's certificate (--tls-cert-file/--tls-key-file), valid for localhost,
#                     127.0.0.1 and every NAME or IP given (each shard's cluster address)
# DIR/client.pem/.key a client certificate for mutual TLS (--tls-require-client-cert)
# DIR/ca.key          the CA's key: keep it off the servers. Certificates are valid for 825 days.
set -euo pipefail
dir=${1:?usage: make_tls_certs.sh DIR [NAME|IP ...]}
shift
command -v openssl >/dev/null || { echo "make_tls_certs.sh: openssl is missing (apt-get install openssl)" >&2; exit 2; }
mkdir -p "$dir"
umask 077
san="DNS:localhost,IP:127.0.0.1"
for h in "$@"; do
  if [[ $h =~ ^[0-9.]+$ || $h == *:* ]]; then san+=",IP:$h"; else san+=",DNS:$h"; fi
done
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 825 -subj "/CN=psd test CA" \
  -keyout "$dir/ca.key" -out "$dir/ca.pem" 2>/dev/null
issue() {  # issue NAME EXT
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$1" \
    -keyout "$dir/$1.key" -out "$dir/$1.csr" 2>/dev/null
  openssl x509 -req -in "$dir/$1.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial -days 825 \
    -extfile <(printf '%s\n' "$2") -out "$dir/$1.pem" 2>/dev/null
  rm -f "$dir/$1.csr"
}
issue server "subjectAltName=$san
extendedKeyUsage=serverAuth,clientAuth"
issue client "extendedKeyUsage=clientAuth"
rm -f "$dir/ca.srl"
chmod 644 "$dir/ca.pem" "$dir/server.pem" "$dir/client.pem"
echo "made $dir/{ca,server,client}.pem and keys (server names: $san)"
