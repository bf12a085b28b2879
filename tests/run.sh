#!/bin/bash
# The test command of the README: installs what is needed, then runs the CPU test suite.
# Extra arguments go to pytest (e.g. `bash tests/run.sh -m "not slow"`); the 25 slowest tests are listed at the end.
# The installation is skipped when this Python already holds it: a stamp in the environment's prefix
# records the hash of the files that decide what is installed (set FORCE_INSTALL=1 to redo it).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
inputs="setup.py pyproject.toml requirements.txt tools/install.sh megatron/core/data/helpers.cpp"
wanted="$(cat $inputs | sha256sum | cut -d' ' -f1) $PWD"
stamp="$($py -c 'import sys; print(sys.prefix)')/.megatron-deepspeed-3d-installed"
if [ "${FORCE_INSTALL:-0}" = 1 ] || [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ] \
        || ! $py -c "import deepspeed, megatron" >/dev/null 2>&1; then
    bash tools/install.sh
    echo "$wanted" > "$stamp" || echo "note: cannot write $stamp; the next run installs again"
fi
exec $py -m pytest -q --durations=25 "$@"
