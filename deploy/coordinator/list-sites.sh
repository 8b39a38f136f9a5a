#!/usr/bin/env bash
# The registered sites (name -> node id) and Flower's node list with their status.
set -euo pipefail
cd "$(dirname "$0")"
docker compose run --rm --no-deps register list
