# shellcheck shell=bash
# Sourced by scripts/test and scripts/demo: makes .venv in the checkout, installs the project
# and its dependencies into it, and checks the system tools the project needs: setup_demo for
# the main job (Java for Spark, util-linux), setup_test for the tests as well (iproute2,
# chromium, man-db, systemd, strace, prometheus for promtool), setup_bench for the benchmarks
# (util-linux, iproute2). What apt and pip print goes to out/setup.log.
# Idempotent: a second run only checks.
set -euo pipefail

# --help (or -h) of the script that sources this: its header, and nothing set up or run.
case "${1:-}" in
    -h|--help)
        sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"
        exit 0 ;;
esac

RQP_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RQP_VENV=${RQP_VENV:-$RQP_ROOT/.venv}
RQP_EXTRAS=${RQP_EXTRAS:-test,spark}

say() { printf '[setup] %s\n' "$*" >&2; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

# What apt and pip print goes to a log, not the terminal: the steps are what a user reads.
RQP_SETUP_LOG=${RQP_SETUP_LOG:-$RQP_ROOT/out/setup.log}
mkdir -p "$(dirname "$RQP_SETUP_LOG")"
logged() {  # logged COMMAND... : run it with its output in the log; on failure show the end
    printf '\n$ %s\n' "$*" >> "$RQP_SETUP_LOG"
    local status=0
    "$@" >> "$RQP_SETUP_LOG" 2>&1 || status=$?
    [ "$status" != 0 ] || return 0
    printf '[setup] failed: %s (exit %s); the end of %s:\n' "$*" "$status" "$RQP_SETUP_LOG" >&2
    tail -n 20 "$RQP_SETUP_LOG" | sed 's/^/    /' >&2
    return "$status"
}

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
        logged as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q || return 1
        RQP_APT_UPDATED=1
    fi
    logged as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
        --no-install-recommends "$@"
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
        logged "$RQP_VENV/bin/python" -m pip install --disable-pip-version-check --upgrade pip ||
            die "could not upgrade pip in $RQP_VENV (log: $RQP_SETUP_LOG)"
        logged "$RQP_VENV/bin/python" -m pip install --disable-pip-version-check \
            -e "$RQP_ROOT[$RQP_EXTRAS]" ||
            die "could not install the project into $RQP_VENV (log: $RQP_SETUP_LOG)"
        printf '%s\n' "$want" > "$stamp"
    fi
}

setup_demo() {  # what the main job needs: the project, Java for Spark, unshare
    say "setting up (details in $RQP_SETUP_LOG)"
    setup_venv
    check_java
    check_tool unshare util-linux "the demo runs in its own IPC namespace"
}

setup_bench() {  # what the benchmarks need: the project, unshare, ip (not the test tools:
    # a trial's scripts/bench installed chromium, prometheus, gcc and strace it never used)
    say "setting up (details in $RQP_SETUP_LOG)"
    setup_venv
    check_tool unshare util-linux "the benchmark runs in its own IPC namespace"
    check_tool ip iproute2 "scripts/bench --scale --hosts builds network namespaces with it"
}

setup_test() {  # and what the tests need besides
    setup_demo
    check_tool ip iproute2 "the multi-host tests build network namespaces with it"
    # (gcc without recommends has no C library headers: libc6-dev brings stdio.h and sys/msg.h)
    if ! command -v gcc >/dev/null 2>&1 || [ ! -e /usr/include/stdio.h ]; then
        apt_install gcc libc6-dev || die "a C compiler with the C library headers is missing (the tests compile C producers and consumers against rqp.h). Install the Debian packages gcc and libc6-dev and run this again."
    fi
    check_tool chromium chromium "the report's browser test renders the HTML with it"
    # systemd-analyze verify looks up each unit's Documentation=man: page with man(1).
    check_tool man man-db "the unit test runs systemd-analyze verify, which calls man"
    check_tool systemd-analyze systemd "the unit test verifies the systemd units with it"
    check_tool strace strace "a durability test watches the sending MCA's system calls with it"
    # RUNLEVEL=1: the package's Prometheus service is not started (only promtool is used)
    RUNLEVEL=1 check_tool promtool prometheus "the monitoring test checks config/prometheus-rules.yaml with it"
}
