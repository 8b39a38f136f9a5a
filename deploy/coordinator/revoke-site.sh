#!/usr/bin/env bash
# Revoke a site: its SuperNode is refused from now on (by site name or Flower node id).
#   ./revoke-site.sh SITE_NAME
set -euo pipefail
cd "$(dirname "$0")"
if [ "$#" -ne 1 ]; then
    echo "usage: $0 SITE_NAME|NODE_ID" >&2
    exit 2
fi
docker compose run --rm --no-deps register revoke "$1"
