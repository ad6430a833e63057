#!/usr/bin/env bash
# Headless Chromium from Debian for the playground's end-to-end test (Playwright drives it).
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then exit 0; fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq chromium >/dev/null
