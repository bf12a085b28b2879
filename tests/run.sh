#!/bin/bash
# The test command of the README: installs what is needed, then runs the CPU test suite.
# Extra arguments go to pytest (e.g. `bash tests/run.sh -m "not slow"`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh
py=${PYTHON:-python3}
exec $py -m pytest -q "$@"
