#!/usr/bin/env bash
# ScienceWorld's simulator needs Java 17 or newer. Install it from Debian's packages if it is missing.
set -euo pipefail
version=$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n1 || true)
if [ -n "${version}" ] && [ "${version}" -ge 17 ]; then
  exit 0
fi
echo "Java >= 17 not found (found: ${version:-none}); installing openjdk-17-jre-headless with apt-get" >&2
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends openjdk-17-jre-headless
