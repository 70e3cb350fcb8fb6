#!/usr/bin/env bash
# `make test`'s pytest, in two passes: every test but the `serial` ones in TEST_WORKERS processes
# (pytest-xdist, whole modules per process), then the `serial` ones alone, so that a test bounding
# a latency never measures another test's server starting beside it. Both passes run whatever the
# first one answers, so one run reports every failure; a pass that selects nothing (PYTEST_ARGS
# naming one file, say) is not a failure unless neither selects anything.
#
#   scripts/run_tests.sh PYTHON WORKERS [pytest arguments...]
set -u
py=$1
workers=$2
shift 2
common=(--ignore=tests/experiments)

status=0
empty=0
pass() {
    "$py" -m pytest "${common[@]}" "$@"
    local rc=$?
    if [ "$rc" -eq 5 ]; then
        empty=$((empty + 1))
    elif [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then
        status=$rc
    fi
}

pass -m "not image and not serial" -n "$workers" --dist loadfile "$@"
pass -m "serial and not image" "$@"
if [ "$empty" -eq 2 ]; then
    echo "run_tests.sh: neither pass selected a test" >&2
    exit 5
fi
exit "$status"
