# gpupool: `make run` starts a pool on this machine, `make test` checks everything.
# Both work on a fresh clone with nothing but Python >= 3.11: the first target that needs the
# virtual environment builds it (gpupool is installed into its own venv; see README).

PYTHON ?= $(shell command -v python3.11 || command -v python3.12 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install run test lint typecheck pytest test-packages chaos bench clean

# Debian packages that some tests drive for real (zsh and fish run the completion scripts; slurm-wlm
# and munge a one-node Slurm cluster on loopback for the pilot workers, tests/support/slurm.py, and
# slurm-wlm-torque the PBS commands (qsub, qstat, qdel) over it, for the PBS pilots;
# chromium and chromium-driver a headless browser for the dashboard, tests/support/browser.py;
# prometheus its promtool for docs/prometheus/alerts.yml).
# Installed when this runs as root with apt-get, as CI does; elsewhere those tests skip, saying why.
TEST_PACKAGES := zsh fish slurm-wlm slurm-wlm-torque munge chromium chromium-driver prometheus

install: $(STAMP)

$(STAMP): pyproject.toml setup.py daemon/worker/_spawn.c
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	# One resolver run for everything: aiobotocore pins a narrow botocore range.
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test,dev]'
	@touch $(STAMP)

run: $(STAMP)
	$(BIN)/poold $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP) test-packages
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-packages:
	@missing=$$(for p in $(TEST_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing the Debian packages tests use:" $$missing; \
		apt-get install -y -qq --no-install-recommends $$missing >/dev/null 2>&1 || \
		{ apt-get update -qq >/dev/null 2>&1 && \
		  apt-get install -y -qq --no-install-recommends $$missing >/dev/null 2>&1; } || \
		echo "make: could not install" $$missing "- the tests that need them will skip"; \
	fi

test: lint typecheck pytest

chaos: $(STAMP)
	$(BIN)/python -m pytest -m slow tests/chaos $(PYTEST_ARGS)

bench: $(STAMP)
	# The peers (Celery, RQ, SAQ, Dramatiq) are the bench extra, in one resolver run with the rest.
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test,dev,bench]'
	$(BIN)/python -m bench $(ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
