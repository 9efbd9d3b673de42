#!/usr/bin/env bash
# Sets up everything elastic_ext needs on a Debian 12 machine (run as root):
# Debian packages, the virtual environment at .venv, the Python stack, a
# Horovod 0.28.1 build with PyTorch, TensorFlow, Gloo and MPI, and
# elastic_ext itself in editable mode.
#
#   bash tools/setup.sh [--stack previous|current] [--venv DIR]
#
# --stack picks the tested set of versions (docs/environment.md):
#   current (default)   Python 3.12, torch 2.15.0, TF 2.21.0, Keras 3.15,
#                       numpy 2.5, tools/requirements-current.txt, Horovod
#                       built from its sdist with tools/horovod_patches/*.patch;
#   previous            Python 3.11, torch 2.13.0, TF 2.17.1, numpy 1.26,
#                       tools/requirements-previous.txt, Horovod built as released
#                       with the tools/cxx17 compiler wrapper (for users who
#                       cannot move yet; the benchmarks' torchft peer needs it).
# --venv is where the virtual environment goes (default .venv); a venv made
# with another Python than the stack's is refused, not overwritten.
#
# Idempotent: a second run checks each step and skips what is already done.
# The Horovod wheel is built once per (Horovod, torch, TF, Python) combination
# and cached in $ELASTIC_EXT_CACHE (default ~/.cache/elastic_ext), so a fresh
# clone on the same machine installs it in seconds instead of rebuilding.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STACK=current
VENV="$ROOT/.venv"
while [ $# -gt 0 ]; do
    case "$1" in
        --stack) STACK="${2:-}"; shift 2 || shift ;;
        --stack=*) STACK="${1#--stack=}"; shift ;;
        --venv) VENV="${2:-}"; shift 2 || shift ;;
        --venv=*) VENV="${1#--venv=}"; shift ;;
        *) printf 'setup: unknown argument "%s" (expected --stack previous|current, --venv DIR)\n' "$1" >&2; exit 2 ;;
    esac
done
case "$STACK" in
    previous)
        PY_VERSION=3.11
        REQUIREMENTS="$ROOT/tools/requirements-previous.txt"
        UNWANTED=()
        PATCHES=() ;;
    current)
        PY_VERSION=3.12
        REQUIREMENTS="$ROOT/tools/requirements-current.txt"
        # triton comes with PyPI's CUDA torch and is only used on GPUs. It bundles
        # its own LLVM, as TF does: once TF is loaded, the first torch optimizer
        # (torch._dynamo imports triton) aborts the process with "LLVM ERROR:
        # inconsistency in registered CommandLine options". torch runs without it.
        UNWANTED=(triton)
        PATCHES=("$ROOT"/tools/horovod_patches/*.patch) ;;
    *)
        printf 'setup: unknown stack "%s" (expected previous or current)\n' "$STACK" >&2; exit 2 ;;
esac
[ -n "$VENV" ] || { echo "setup: --venv needs a directory" >&2; exit 2; }
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
PY="$VENV/bin/python"
HOROVOD_VERSION=0.28.1
CACHE="${ELASTIC_EXT_CACHE:-$HOME/.cache/elastic_ext}"
DEB_PACKAGES=(
    build-essential cmake git python3 python3-venv python3-dev
    libopenmpi-dev openmpi-bin
    munge slurmctld slurmd slurm-client
    procps iproute2
    openssh-server openssh-client nftables
)

step() { printf '\n== setup: %s\n' "$*" >&2; STEP="$*"; }
fail() {
    printf '\nsetup FAILED at step "%s": %s\n' "$STEP" "$1" >&2
    [ $# -gt 1 ] && printf 'what to do: %s\n' "$2" >&2
    exit 1
}
START_S=$(date +%s)

step "Debian packages"
missing=()
for pkg in "${DEB_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
    [ "$(id -u)" = 0 ] || fail "missing packages: ${missing[*]}" "run this script as root, or apt-get install them yourself"
    echo "installing: ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null || fail "apt-get update failed" "check network access to the Debian mirrors"
    # Installing a daemon (openssh-server) must not start it: the test cluster (tools/testcluster.py)
    # runs its own sshd inside network namespaces, and nothing may listen on the machine's interfaces.
    no_start=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && no_start=1
    fi
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
    installed=$?
    [ -n "$no_start" ] && rm -f /usr/sbin/policy-rc.d
    [ "$installed" = 0 ] || fail "apt-get install ${missing[*]} failed" "run the same apt-get command by hand to see why"
else
    echo "all present" >&2
fi

step "Python interpreter ($STACK stack: Python $PY_VERSION)"
# Prefer an interpreter on PATH, then one pyenv installed but did not activate
# (its shim then fails), then Debian's python3; take the first that is $PY_VERSION.
is_py_version() { "$1" -c 'import sys; sys.exit("%d.%d" % sys.version_info[:2] != sys.argv[1])' "$PY_VERSION" 2>/dev/null; }
BASE_PY=""
for cand in "$(command -v "python$PY_VERSION")" \
        $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$PY_VERSION".*/bin/"python$PY_VERSION" 2>/dev/null | sort -V -r) \
        "$(command -v python3)"; do
    if [ -n "$cand" ] && is_py_version "$cand"; then BASE_PY="$cand"; break; fi
done
[ -n "$BASE_PY" ] || fail "no Python $PY_VERSION found (the $STACK stack's wheels are for $PY_VERSION)" \
    "install Python $PY_VERSION (Debian package or pyenv install $PY_VERSION)"
echo "$BASE_PY" >&2

step "virtual environment at $VENV"
if [ ! -x "$PY" ]; then
    "$BASE_PY" -m venv "$VENV" || fail "python -m venv failed" "apt-get install python3-venv"
fi
is_py_version "$PY" \
    || fail "$VENV is not a Python $PY_VERSION environment (made for another stack?)" \
        "delete $VENV, or pass --venv DIR to put the $STACK stack elsewhere"
"$PY" -m pip --version >/dev/null || fail "pip is missing in $VENV" "delete $VENV and run again"

req_name="tools/$(basename "$REQUIREMENTS")"
step "Python packages ($req_name)"
# A stamp of the requirements files makes the repeated run skip pip entirely.
stamp="$VENV/.requirements.sha256"
want=$(cat "$REQUIREMENTS" "$ROOT/tools/requirements-common.txt" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    "$PY" -m pip install -q --disable-pip-version-check -r "$REQUIREMENTS" 2>&1 \
        | grep -v "^WARNING: Location .* is ignored" >&2
    [ "${PIPESTATUS[0]}" = 0 ] \
        || fail "pip install -r $req_name failed" "read pip's message above; the pins in $req_name are the tested ones"
    if [ ${#UNWANTED[@]} -gt 0 ]; then
        "$PY" -m pip uninstall -y -q --disable-pip-version-check "${UNWANTED[@]}" >&2 \
            || fail "pip uninstall ${UNWANTED[*]} failed" "read pip's message above"
    fi
    echo "$want" >"$stamp"
else
    echo "all present (stamp matches $req_name)" >&2
fi

# The names of this stack's patches, as the build records them in horovod/elastic_ext_patches.py.
PATCH_NAMES=""
for p in "${PATCHES[@]}"; do PATCH_NAMES="$PATCH_NAMES $(basename "$p" .patch)"; done
# And of their contents: a patch changed in place makes a new build too.
PATCH_SHA=none
[ ${#PATCHES[@]} -gt 0 ] && PATCH_SHA=$(cat "${PATCHES[@]}" | sha256sum | cut -c1-12)

horovod_ok() {
    # Horovod is usable only if it imports with every framework we need, was
    # built against the torch/TF now installed, and carries exactly this
    # checkout's patches, as they are now (a venv built before a patch was
    # added or changed is rebuilt).
    "$PY" - "$PATCH_SHA" $PATCH_NAMES <<'PYEOF' 2>/dev/null
import sys
import horovod, horovod.torch, horovod.tensorflow
from horovod.common.util import gloo_built, mpi_built
assert horovod.__version__ == "0.28.1", horovod.__version__
assert gloo_built() and mpi_built()
try:
    from horovod import elastic_ext_patches as built
except ImportError:
    built = None
assert tuple(getattr(built, "PATCHES", ())) == tuple(sys.argv[2:])
assert getattr(built, "PATCHES_SHA256", "none") == sys.argv[1]
PYEOF
}

step "Horovod $HOROVOD_VERSION (PyTorch, TensorFlow, Gloo, MPI)"
if horovod_ok; then
    echo "already built and importable" >&2
else
    key=$("$PY" -c 'import sys, torch, tensorflow as tf; print(f"py{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__}-tf{tf.__version__}")' 2>/dev/null) \
        || fail "cannot import torch and tensorflow to key the Horovod build" "run this script again; the previous step should have installed them"
    if [ ${#PATCHES[@]} -gt 0 ]; then
        # A change to any patch makes a new wheel.
        key="$key-patches$PATCH_SHA"
    fi
    wheel_dir="$CACHE/horovod-$HOROVOD_VERSION-$key"
    wheel=$(ls "$wheel_dir"/horovod-*.whl 2>/dev/null | head -n 1)
    if [ -z "$wheel" ]; then
        echo "building from sdist (about 9 minutes on 2 cores); log: $CACHE/horovod-build.log" >&2
        mkdir -p "$wheel_dir" "$CACHE"
        rm -rf "$wheel_dir.partial"
        source_arg="horovod==$HOROVOD_VERSION"
        build_env=(CC=gcc)
        if [ ${#PATCHES[@]} -gt 0 ]; then
            # The sdist, unpacked and patched (tools/horovod_patches/, one file per problem),
            # in a directory of its own: unpacked inside the wheel's output directory
            # (a path with "+cu132" in it) the built .so files landed outside horovod/
            # in the wheel.
            src="$CACHE/horovod-$HOROVOD_VERSION-src"
            rm -rf "$src" && mkdir -p "$src" "$wheel_dir.partial"
            "$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
                -d "$wheel_dir.partial" "horovod==$HOROVOD_VERSION" >"$CACHE/horovod-build.log" 2>&1 \
                || fail "downloading the Horovod $HOROVOD_VERSION sdist failed" "see $CACHE/horovod-build.log"
            tar -xzf "$wheel_dir.partial/horovod-$HOROVOD_VERSION.tar.gz" -C "$src" --strip-components=1 \
                || fail "unpacking the Horovod sdist failed" "delete $wheel_dir.partial and run again"
            for p in "${PATCHES[@]}"; do
                echo "applying $(basename "$p")" >&2
                patch -d "$src" -p1 --batch --forward --quiet <"$p" >>"$CACHE/horovod-build.log" 2>&1 \
                    || fail "patch $p does not apply to the Horovod $HOROVOD_VERSION sdist" "see $CACHE/horovod-build.log"
            done
            # What the build carries, for this script's check above and for elastic_ext's launcher
            # (elastic_ext.control.horovod_seam.build_patches).
            { echo "# Written by elastic_ext's tools/setup.sh: the patches this Horovod was built with."
              printf 'PATCHES = ('; for n in $PATCH_NAMES; do printf '"%s", ' "$n"; done; echo ')'
              echo "PATCHES_SHA256 = \"$PATCH_SHA\"  # the first 12 hex digits of their contents' sha256"
            } >"$src/horovod/elastic_ext_patches.py"
            source_arg="$src"
            # The patches make the build C++17 where torch needs it; torch counts as a
            # CPU build even when it is PyPI's CUDA wheel (03-torch-cuda-wheel-cpu-plugin.patch).
            build_env+=(HOROVOD_GPU=NONE)
        else
            # tools/cxx17 swaps -std=c++14 for -std=c++17; see that file for why.
            build_env+=(CXX="$ROOT/tools/cxx17")
        fi
        env "${build_env[@]}" \
            HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 \
            HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
            "$PY" -m pip wheel --no-build-isolation --no-deps --no-cache-dir \
                -w "$wheel_dir.partial" "$source_arg" >>"$CACHE/horovod-build.log" 2>&1 \
            || { rm -rf "$wheel_dir.partial"; fail "Horovod build failed" "see the end of $CACHE/horovod-build.log"; }
        [ ${#PATCHES[@]} -gt 0 ] && rm -rf "$src"
        mv "$wheel_dir.partial"/horovod-*.whl "$wheel_dir"/ && rm -rf "$wheel_dir.partial"
        wheel=$(ls "$wheel_dir"/horovod-*.whl | head -n 1)
    else
        echo "using cached wheel $wheel" >&2
    fi
    "$PY" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$wheel" \
        || fail "installing $wheel failed" "delete $wheel_dir and run again to rebuild"
    # Horovod's own runtime dependencies (its wheel was installed --no-deps).
    "$PY" -m pip install -q --disable-pip-version-check cloudpickle psutil pyyaml packaging \
        || fail "installing Horovod's runtime dependencies failed" "read pip's message above"
    horovod_ok || fail "Horovod installed but does not import with torch, TF, Gloo and MPI" \
        "delete $wheel_dir and run again; check $CACHE/horovod-build.log"
fi

step "elastic_ext (editable)"
# (run from / so that a checkout in the working directory does not count as installed)
# The checkout goes on sys.path by a plain path in a .pth file (setuptools' compat mode), not by the
# import hook of its default editable mode: that hook is imported at every interpreter start, and
# took 13 of the 27 ms of CPU of a bare `python -c pass` (the suite starts some 4,500 Python processes).
if ! (cd / && "$PY" -c 'import elastic_ext, os, sys; sys.exit(0 if os.path.dirname(os.path.dirname(elastic_ext.__file__)) == sys.argv[1] else 1)' "$ROOT" 2>/dev/null) \
        || "$PY" -c 'import glob, site, sys; sys.exit(0 if any(glob.glob(p + "/__editable___elastic_ext*finder.py") for p in site.getsitepackages()) else 1)' \
        || [ ! -x "$VENV/bin/elastic-ext-discover-static" ] || [ ! -x "$VENV/bin/elastic-horovodrun" ]; then
    # (the console scripts come from setup.py's entry points: a venv installed before they existed lacks them)
    "$PY" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation \
            --use-pep517 --config-settings editable_mode=compat -e "$ROOT" \
        || fail "pip install -e . failed" "read pip's message above"
else
    echo "already installed" >&2
fi
# An editable install compiles nothing, and where the environment sets PYTHONDONTWRITEBYTECODE (or the
# checkout is read-only) no import writes a .pyc: every worker, launcher and discovery run would compile
# the checkout's modules again (the package's 138 take 0.16 s of CPU; a discovery run took 90 ms, 60 with
# them compiled; a suite runs about 1,650). Only the stale or missing ones are compiled.
"$PY" -m compileall -q -j 0 "$ROOT/elastic_ext" "$ROOT/host_discovery" "$ROOT/devkit" "$ROOT/tests" \
    "$ROOT/bench" "$ROOT/examples" >/dev/null \
    || fail "compiling the checkout's Python failed" "run $PY -m compileall on the paths above to see which file"
# pytest rewrites the asserts of each test module it imports and caches the result beside the module, but
# only where bytecode may be written: under PYTHONDONTWRITEBYTECODE each pytest-xdist worker rewrote all
# the suite's test modules while collecting (4.6 of its 11.3 s of CPU). One collection here, with writing
# allowed, leaves the rewritten modules cached; pytest rewrites a module again once its source changes.
(cd "$ROOT" && env -u PYTHONDONTWRITEBYTECODE "$PY" -m pytest --collect-only -q -p no:cacheprovider -n 0 tests \
    >/dev/null) || fail "collecting the suite failed" "run $PY -m pytest --collect-only tests to see why"

printf '\nsetup done (%s stack) in %ss: activate with  source %s/bin/activate\n' "$STACK" "$(( $(date +%s) - START_S ))" "$VENV" >&2
