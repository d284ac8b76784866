# shellcheck shell=bash
# Sourced by scripts/test and scripts/demo: makes .venv in the checkout, installs the project
# and its dependencies into it, and checks the system tools the project needs (Java for Spark,
# iproute2 and util-linux for the multi-host tests). Idempotent: a second run only checks.
set -euo pipefail

RQP_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RQP_VENV=${RQP_VENV:-$RQP_ROOT/.venv}
RQP_EXTRAS=${RQP_EXTRAS:-test,spark}

say() { printf '[setup] %s\n' "$*" >&2; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"
    elif command -v sudo >/dev/null 2>&1; then sudo -n "$@" 2>/dev/null || sudo "$@"
    else return 1
    fi
}

apt_install() {  # apt_install PACKAGE... : install Debian packages when we can, else fail
    command -v apt-get >/dev/null 2>&1 || return 1
    say "installing Debian packages: $*"
    if [ -z "${RQP_APT_UPDATED:-}" ]; then
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 || return 1
        RQP_APT_UPDATED=1
    fi
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >&2
}

find_python() {
    local candidate
    for candidate in ${PYTHON:-} python3.11 python3 python; do
        if command -v "$candidate" >/dev/null 2>&1 &&
           "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            command -v "$candidate"; return 0
        fi
    done
    return 1
}

check_java() {  # Spark needs a Java runtime (8, 11 or 17+)
    if command -v java >/dev/null 2>&1 && java -version >/dev/null 2>&1; then return 0; fi
    say "no Java runtime found; Spark (the dead-letter report) needs one"
    apt_install openjdk-17-jre-headless || apt_install default-jre-headless ||
        die "could not install Java. Install a Java 17 runtime (Debian: apt-get install openjdk-17-jre-headless) and run this again."
}

check_tool() {  # check_tool COMMAND DEBIAN_PACKAGE WHY
    command -v "$1" >/dev/null 2>&1 && return 0
    apt_install "$2" || die "'$1' is missing ($3). Install the Debian package $2 and run this again."
}

setup_venv() {
    local python
    python=$(find_python) || die "Python 3.11 or newer is needed (Debian: apt-get install python3 python3-venv)."
    if [ ! -x "$RQP_VENV/bin/python" ]; then
        say "creating $RQP_VENV with $python"
        "$python" -m venv "$RQP_VENV" 2>/dev/null || {
            apt_install python3-venv || true
            "$python" -m venv "$RQP_VENV"
        } || die "could not create a virtual environment with $python (Debian: apt-get install python3-venv)"
    fi
    local stamp="$RQP_VENV/.rqp-installed" want
    want="$(cat "$RQP_ROOT/setup.cfg" "$RQP_ROOT/pyproject.toml" | sha256sum | cut -c1-16) $RQP_EXTRAS"
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        say "installing the project and its dependencies into $RQP_VENV"
        "$RQP_VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >&2
        "$RQP_VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$RQP_ROOT[$RQP_EXTRAS]" >&2
        printf '%s\n' "$want" > "$stamp"
    fi
}

setup_all() {
    setup_venv
    check_java
    check_tool ip iproute2 "the multi-host tests build network namespaces with it"
    check_tool unshare util-linux "the tests run hosts in their own IPC namespaces"
    check_tool chromium chromium "the report's browser test renders the HTML with it"
}
