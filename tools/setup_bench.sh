#!/usr/bin/env bash
# Sets up the benchmarks' second virtual environment, .venv-bench, for the
# torchft peer of bench.compare and bench.chaos (torchft 0.2.0).
#
# Why a second one: torchft's OpenTelemetry dependencies pull protobuf 7,
# which tensorflow-cpu 2.17 (in .venv) refuses (< 5). .venv-bench has its own
# site-packages first (torchft, OpenTelemetry, protobuf 7) and then, through a
# .pth file, those of the main venv: the same torch 2.13.0 (CPU) without a
# second download; any other torch would pull a multi-GB CUDA build, so pip
# runs with the constraint torch==2.13.0 and the script checks which torch
# the new venv imports.
#
# The torchft peer runs on the previous stack's torch 2.13.0 (CPU), so it
# builds on that stack's venv, not the default one:
#   bash tools/setup.sh --stack previous --venv .venv-previous
#   bash tools/setup_bench.sh .venv-previous/bin/python
# (MAIN_VENV_PYTHON defaults to .venv/bin/python of this checkout). Idempotent: seconds when done.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MAIN_PY="${1:-$ROOT/.venv/bin/python}"
BENCH="$ROOT/.venv-bench"
PY="$BENCH/bin/python"
TORCHFT_VERSION=0.2.0
TORCH_VERSION=2.13.0

fail() {
    printf '\nsetup_bench FAILED: %s\n' "$1" >&2
    [ $# -gt 1 ] && printf 'what to do: %s\n' "$2" >&2
    exit 1
}

[ -x "$MAIN_PY" ] || fail "no main venv python at $MAIN_PY" "run bash tools/setup.sh first (or pass the main venv's python)"
main_site=$("$MAIN_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
    || fail "$MAIN_PY does not run" "run bash tools/setup.sh again"
"$MAIN_PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null \
    || fail "$MAIN_PY has no torch $TORCH_VERSION (the previous stack's)" \
        "bash tools/setup.sh --stack previous --venv .venv-previous, then bash tools/setup_bench.sh .venv-previous/bin/python"
base_py=$("$MAIN_PY" -c 'import sys; print(sys._base_executable)')

if [ ! -x "$PY" ]; then
    "$base_py" -m venv "$BENCH" || fail "$base_py -m venv $BENCH failed" "apt-get install python3-venv"
fi
bench_site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# After .venv-bench's own site-packages: the main venv's (torch, numpy, psutil, elastic_ext's needs).
echo "$main_site" >"$bench_site/elastic_ext_main_venv.pth"

installed() {
    "$PY" - "$TORCHFT_VERSION" <<'PYEOF' 2>/dev/null
import sys
from importlib.metadata import version
assert version("torchft") == sys.argv[1]
import torchft._torchft  # the Rust extension: Lighthouse, Manager server
PYEOF
}

if installed; then
    echo "torchft $TORCHFT_VERSION already installed in $BENCH" >&2
else
    constraints="$(mktemp)"
    trap 'rm -f "$constraints"' EXIT
    echo "torch==$TORCH_VERSION" >"$constraints"
    # pip sees the main venv's torch through the .pth file: torch>=2.7 is satisfied, nothing is downloaded for it.
    # (pip then warns that tensorflow in the main venv wants protobuf < 5: that venv is not changed, and this one
    # never imports tensorflow.)
    "$PY" -m pip install -q --disable-pip-version-check -c "$constraints" "torchft==$TORCHFT_VERSION" 2>&1 \
        | grep -v -e "^WARNING: Location .* is ignored" -e "tensorflow" -e "dependency resolver does not" >&2
    [ "${PIPESTATUS[0]}" = 0 ] || fail "pip install torchft==$TORCHFT_VERSION failed" "read pip's message above"
    installed || fail "torchft $TORCHFT_VERSION installed but does not import" "delete $BENCH and run again"
fi

"$PY" - "$main_site" "$TORCH_VERSION" <<'PYEOF' || fail "$BENCH is not as expected (see above)" "delete $BENCH and run again"
import os, sys
import google.protobuf, torch, torchft
main_site, want = sys.argv[1], sys.argv[2]
assert torch.__version__.split("+")[0] == want, f"torch {torch.__version__}, want {want}"
assert os.path.dirname(os.path.dirname(torch.__file__)) == main_site, f"torch from {torch.__file__}, not {main_site}"
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo  # noqa: F401
from torchft._torchft import LighthouseServer  # noqa: F401
print(f"setup_bench: torchft {torchft.__file__}, torch {torch.__version__} from the main venv, "
      f"protobuf {google.protobuf.__version__}", file=sys.stderr)
PYEOF
[ -x "$BENCH/bin/torchft_lighthouse" ] || fail "no torchft_lighthouse in $BENCH/bin" "delete $BENCH and run again"
echo "setup_bench done: $BENCH" >&2
