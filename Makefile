# The two quickstart commands (README.md). `make run` sets up ./.venv and runs the four
# methods on the embedded synthetic default; `make test` sets up and runs the test suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
export FLWR_TELEMETRY_ENABLED := 0
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup run test test-slow lint clean

$(BIN)/fedudp: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@# CPU machines: take the local CPU wheel of torch first (any other spec pulls CUDA)
	@if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q "torch==2.13.0"; fi
	$(BIN)/pip install -q -e ".[flower,test]"
	touch $(BIN)/fedudp

setup: $(BIN)/fedudp

run: setup
	$(BIN)/fedudp -m method=per_silo,fedavg,full_dp,joint_dp

test: setup
	@# two pytest-xdist workers (2 cores: CI's machine); the tests that may start Ray run on one
	@# worker, one after the other (tests/conftest.py: pytest_xdist_make_scheduler)
	$(BIN)/python -m pytest -q -x -n 2 --timeout=600 --durations=25

# lint, format and types (docs/development.md); the dev extra pins ruff and mypy
lint: setup
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/ruff check fedudp tests scripts examples docs
	$(BIN)/ruff format --check fedudp tests scripts examples docs
	$(BIN)/mypy

test-slow: setup
	$(BIN)/python -m pytest -q -m slow --timeout=1200

clean:
	rm -rf $(VENV) outputs multirun
