#!/usr/bin/env bash
# Every GPU figure in one go, under a hard time limit (see benchmarks/device_check.py):
#
#   benchmarks/device_check.sh [--out-dir DIR] [--budget-s 450] [--only NAME ...] [--list]
#
# DEVICE_CHECK_TIMEOUT (seconds, default 480) caps the whole run; device_check's own
# --budget-s (default 450) ends it before that, and on the cap's SIGTERM it stops the
# running step and writes its summary. PYTHON picks the interpreter (default: .venv's
# when there is one, else python3). Exit status: device_check's, or 124 at the cap.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-}
if [[ -z "$py" ]]; then
  if [[ -x .venv/bin/python ]]; then py=.venv/bin/python; else py=python3; fi
fi
export PYTHONUNBUFFERED=1
exec timeout --signal=TERM --kill-after=20 "${DEVICE_CHECK_TIMEOUT:-480}" \
  "$py" -m benchmarks.device_check "$@"
