#!/usr/bin/env bash
# Install Debian's headless-capable Chromium (/usr/bin/chromium) for the report test
# (tests/test_lab_report.py opens the HTML report in it). Safe to run again.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
  echo "install-chromium: $(/usr/bin/chromium --version 2>/dev/null || echo chromium) already installed" >&2
  exit 0
fi
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >&2
/usr/bin/chromium --version >&2
