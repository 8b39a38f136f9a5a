#!/usr/bin/env bash
# Allow a site to join: register the public key it sent you (its site.pub) under its name.
#   ./register-site.sh SITE_NAME PATH/TO/site.pub
set -euo pipefail
cd "$(dirname "$0")"
if [ "$#" -ne 2 ]; then
    echo "usage: $0 SITE_NAME PATH/TO/site.pub" >&2
    exit 2
fi
pub="$(realpath "$2")"
docker compose run --rm --no-deps --volume "$pub:/incoming/site.pub:ro" \
    register add /incoming/site.pub --name "$1"
