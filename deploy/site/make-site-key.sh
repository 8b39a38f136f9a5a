#!/usr/bin/env bash
# Create this site's keys and print their public halves:
#   - the SuperNode key pair (KEYS_DIR/site.key): send the public key to the coordinator;
#   - the secure-aggregation identity key (KEYS_DIR/identity.pem): send its public key to the
#     federation's registry as SITE_ID.pem; every site pins it in its peers folder.
#   ./make-site-key.sh [KEYS_DIR]      (default: PRISM_KEYS_DIR from .env, else ./keys)
# The private keys (mode 0600) never leave this host; back up identity.pem with the site's
# state. Existing keys are kept. It also creates the (empty) peers folder PRISM_PEERS_DIR.
# Uses the prism-fl image (no network) or, if installed, the local Python package.
# The key belongs to the user the site's container runs as: your own user, or, when you run
# this as root, PRISM_UID:PRISM_GID of .env (default 10001; containers never run as root).
set -euo pipefail
cd "$(dirname "$0")"
setting() { grep -E "^$1=" .env 2>/dev/null | tail -n 1 | cut -d= -f2- || true; }
KEYS_DIR="${1:-${PRISM_KEYS_DIR:-$(setting PRISM_KEYS_DIR)}}"
KEYS_DIR="${KEYS_DIR:-./keys}"
PEERS_DIR="${PRISM_PEERS_DIR:-$(setting PRISM_PEERS_DIR)}"
PEERS_DIR="${PEERS_DIR:-./peers}"
SITE_ID="${PRISM_SITE_ID:-$(setting PRISM_SITE_ID)}"
SITE_ID="${SITE_ID:-site}"
VARIANT="${PRISM_VARIANT:-$(setting PRISM_VARIANT)}"
if [ "$(id -u)" = 0 ]; then
    OWNER_UID="${PRISM_UID:-$(setting PRISM_UID)}"
    OWNER_GID="${PRISM_GID:-$(setting PRISM_GID)}"
    OWNER="${OWNER_UID:-10001}:${OWNER_GID:-10001}"
else
    OWNER="$(id -u):$(id -g)"
fi
case "$OWNER" in
    0:* | *:0)
        echo "PRISM_UID/PRISM_GID must not be 0 (found $OWNER): the site's container never" \
            "runs as root; keep 10001 in .env" >&2
        exit 2
        ;;
esac
mkdir -p "$KEYS_DIR" "$PEERS_DIR"
chmod 700 "$KEYS_DIR"
chmod go-w "$PEERS_DIR"  # the pinned keys: writable by this site's operator alone
if python3 -c "import deploy.pki" 2>/dev/null; then
    python3 -m deploy.pki site-key --out "$KEYS_DIR" --name "$SITE_ID"
    if [ "$(id -u)" = 0 ]; then
        chown -R "$OWNER" "$KEYS_DIR"
    fi
else
    if [ "$(id -u)" = 0 ]; then
        chown "$OWNER" "$KEYS_DIR"
    fi
    docker run --rm --network none --user "$OWNER" \
        --volume "$(realpath "$KEYS_DIR"):/keys" --entrypoint python \
        "prism-fl:${VARIANT:-cpu}" -m deploy.pki site-key --out /keys --name "$SITE_ID"
fi
