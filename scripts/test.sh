#!/usr/bin/env bash
# The test command: set up .venv (when needed), lint, then run the tests.
#   bash scripts/test.sh [PYTEST ARGS]       what CI runs: every test but the opt-in sets (`extended`,
#                                            `cluster`, `bench`: tests/conftest.py), the 25 slowest listed
#   bash scripts/test.sh fast [PYTEST ARGS]  the tests not marked `slow`: no engine, Ray cluster or
#                                            subprocess starts (tests/conftest.py fails a test that
#                                            starts one unmarked)
#   bash scripts/test.sh full [PYTEST ARGS]  everything, the opt-in sets too (an hour on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
export WANDB_MODE=offline VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}

if [ "${1:-}" = full ]; then
    shift
    VIME_TESTS=full exec .venv/bin/python -m pytest --durations=25 "$@"
fi
if [ "${1:-}" != fast ]; then
    exec .venv/bin/python -m pytest --durations=25 "$@"  # tests/ (pyproject testpaths) unless paths are given
fi
shift
rc=0
.venv/bin/python -m pytest -m "not slow" --durations=10 "$@" || rc=$?
if [ "$rc" = 5 ]; then  # pytest collected nothing: were there tests, all of them slow?
    if .venv/bin/python -m pytest --collect-only -q "$@" >/dev/null 2>&1; then
        echo "[test] every test selected is marked slow: run them with: bash scripts/test.sh $*" >&2
        exit 0
    fi
    echo "[test] no test matched the selection: $*" >&2
fi
exit "$rc"
