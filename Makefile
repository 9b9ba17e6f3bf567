# gpupool: `make run` starts a pool on this machine, `make test` checks everything.
# Both work on a fresh clone with nothing but Python >= 3.11: the first target that needs the
# virtual environment builds it (gpupool is installed into its own venv; see README). Each installs
# what it needs and no more: `make run` the package and its dependencies, `make test` the test and
# dev extras too (pyproject.toml), several times as large.

PYTHON ?= $(shell command -v python3.11 || command -v python3.12 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
RUN_STAMP  := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
TEST_EXTRAS  := [test,dev]
BENCH_EXTRAS := [test,dev,bench]

.PHONY: install run test lint typecheck pytest test-packages chaos bench clean

# Debian packages that some tests drive for real (zsh and fish run the completion scripts; slurm-wlm
# and munge a one-node Slurm cluster on loopback for the pilot workers, tests/support/slurm.py, and
# slurm-wlm-torque the PBS commands (qsub, qstat, qdel) over it, for the PBS pilots;
# chromium and chromium-driver a headless browser for the dashboard, tests/support/browser.py;
# prometheus its promtool for docs/prometheus/alerts.yml; openssh-server an sshd of bench/interactive.py's
# own, beside which it measures the pool's relay).
# Installed when this runs as root with apt-get, as CI does; elsewhere those tests skip, saying why.
TEST_PACKAGES := zsh fish slurm-wlm slurm-wlm-torque munge chromium chromium-driver prometheus openssh-server

# $(call venv_with,EXTRAS): the venv, made if missing, with gpupool in it (editable) and EXTRAS.
# One resolver run for everything: aiobotocore pins a narrow botocore range.
define venv_with
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.$(1)'
endef

install: $(RUN_STAMP)

$(RUN_STAMP): pyproject.toml setup.py daemon/worker/_spawn.c
	$(call venv_with,)
	@touch $@

# what running needs is part of it: a venv made for the tests needs no second install to run
$(TEST_STAMP): pyproject.toml setup.py daemon/worker/_spawn.c
	$(call venv_with,$(TEST_EXTRAS))
	@touch $@ $(RUN_STAMP)

run: $(RUN_STAMP)
	$(BIN)/poold $(ARGS)

lint: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(TEST_STAMP)
	$(BIN)/mypy

# The suite in PYTEST_WORKERS processes, each file's tests in one (module fixtures stay shared).
# Its tests mostly wait (on servers, leases, subprocesses): on 2 cores, two processes ran it in
# 650 s where one took 1092 s, on the same loaded machine. PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 2
pytest: $(TEST_STAMP) test-packages
	$(BIN)/python -m pytest $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile) $(PYTEST_ARGS)

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

chaos: $(TEST_STAMP)
	$(BIN)/python -m pytest -m slow tests/chaos $(PYTEST_ARGS)

bench: $(TEST_STAMP)
	# The peers (Celery, RQ, SAQ, Dramatiq) are the bench extra, in one resolver run with the rest.
	$(call venv_with,$(BENCH_EXTRAS))
	$(BIN)/python -m bench $(ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
