#!/usr/bin/env bash
# Mutation testing of the pure cores with cargo-mutants: each core's code is broken one way at a
# time (a condition negated, an operator swapped, a function's body replaced by a default) and
# the tests that cover it must fail. Not part of `.ci/run`: it builds once per mutant.
#
#   scripts/mutants.sh                  every core, one after another
#   scripts/mutants.sh grant recovery   some of them: grant, schedule, semaphore, recovery
#
# Each core is judged by the tests that cover it, not by the whole suite, so that a mutant costs
# an incremental build and seconds of tests: the grant rule by its model test and the crate's
# unit tests (which hold the simulated lock workloads, feature `testkit`), the schedules and the
# semaphore by their own test files, the worker's recovery by the simulated workloads and the
# PostgreSQL tests.
# Results go to mutants.out/<core>/mutants.out/ (caught.txt, missed.txt, timeout.txt, ...);
# the counts are printed at the end. Needs `cargo install cargo-mutants`.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! cargo mutants --version >/dev/null 2>&1; then
    echo "cargo-mutants is not installed: cargo install cargo-mutants" >&2
    exit 2
fi

core_args() {
    case "$1" in
    grant) echo "--file src/lock/grant.rs -- --lib --test lock_model" ;;
    schedule) echo "--file src/schedule.rs -- --lib --test schedule" ;;
    semaphore) echo "--file src/semaphore.rs -- --lib --test semaphore" ;;
    # Its acquisitions decided in one call (`find_lost_requests`) are PostgreSQL's alone: the
    # PostgreSQL tests judge those, on a server of their own (`testkit::postgres`).
    recovery) echo "--features postgres --file src/lock/worker/recovery.rs -- --lib --test lock_postgres" ;;
    *)
        echo "no core named $1 (grant, schedule, semaphore, recovery)" >&2
        exit 2
        ;;
    esac
}

cores=("$@")
[ ${#cores[@]} -gt 0 ] || cores=(grant schedule semaphore recovery)
for core in "${cores[@]}"; do
    args=$(core_args "$core")
    echo "=== $core"
    mkdir -p "mutants.out/$core"
    # Exit 2 says mutants were missed and 3 that some timed out: the counts below say which.
    # Anything else (the baseline failed, a bad argument) stops here.
    status=0
    # shellcheck disable=SC2086 # the arguments are words
    cargo mutants --features testkit --output "mutants.out/$core" $args || status=$?
    case $status in
    0 | 2 | 3) ;;
    *) exit "$status" ;;
    esac
done

echo
echo "core       caught  missed  timeout  unviable"
for core in "${cores[@]}"; do
    dir="mutants.out/$core/mutants.out"
    count() { [ -f "$dir/$1.txt" ] && wc -l <"$dir/$1.txt" || echo 0; }
    printf '%-10s %6s  %6s  %7s  %8s\n' "$core" "$(count caught)" "$(count missed)" \
        "$(count timeout)" "$(count unviable)"
done
