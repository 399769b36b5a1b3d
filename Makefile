# Two commands for a fresh machine:
#   make run   - create .venv, install Keel, start `keel up` (SQLite, offline model, web page)
#   make test  - create .venv, install with test extras, lint, type-check, run every test
# For developers: make check - lint, type-check and the fast tier of the tests
# (no SIGKILL matrices, no browser, no PostgreSQL outage), in a few minutes.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.keel-installed
BUF_VERSION := 1.75.0
BUF := .tools/node_modules/.bin/buf

.PHONY: run test check install lint typecheck protos proto-lint pytest pytest-fast clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/keel up

test: install proto-lint lint typecheck pytest

check: install lint typecheck pytest-fast

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: install
	$(VENV)/bin/mypy

# buf ships as an npm package with a prebuilt binary; lint STANDARD, and
# breaking FILE against the previous commit when there is one.
$(BUF):
	npm install --silent --no-save --no-audit --no-fund --prefix .tools @bufbuild/buf@$(BUF_VERSION)

proto-lint: $(BUF)
	$(BUF) lint
	@if git rev-parse --verify --quiet HEAD~1 >/dev/null && \
	    git cat-file -e HEAD~1:buf.yaml 2>/dev/null; then \
	  $(BUF) breaking --against '.git#ref=HEAD~1'; \
	fi

protos: install
	$(PY) scripts/gen_protos.py

# pytest exits 5 when it collected nothing; that is a failure here too,
# but with a clear message rather than a silent pass.
define run_pytest
@$(VENV)/bin/pytest $(1); code=$$?; \
if [ $$code -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; \
exit $$code
endef

# Every test, in two runs: the fast tier on pytest-xdist workers (as `make
# check` runs it), then the rest (SIGKILL matrices, real seconds, the
# browser, PostgreSQL outages) in one process, where their timings and
# their processes do not compete with each other. Both run whatever the
# first gave, and the slowest of each are listed, so CI shows where time
# goes. Exit 5 (nothing collected) fails, as in run_pytest.
SLOW_TIER := slow or browser or outage
pytest: install
	@$(VENV)/bin/pytest -m "$(FAST_TIER)" -n $(PYTEST_WORKERS) --dist worksteal --durations=10; \
	fast=$$?; \
	$(VENV)/bin/pytest -m "$(SLOW_TIER)" --durations=25; slow=$$?; \
	for code in $$fast $$slow; do \
	  if [ $$code -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; \
	done; \
	if [ $$fast -ne 0 ]; then exit $$fast; fi; \
	exit $$slow

# The fast tier: the markers are registered in pyproject.toml. Its tests
# spend much of their time waiting on servers of their own (each has its own
# PostgreSQL schema and ports), so they run in parallel: one pytest-xdist
# worker per CPU ("auto"; PYTEST_WORKERS=0 runs them in this process).
FAST_TIER := not slow and not browser and not outage
PYTEST_WORKERS ?= auto
pytest-fast: install
	$(call run_pytest,-m "$(FAST_TIER)" -n $(PYTEST_WORKERS) --dist worksteal)

clean:
	rm -rf $(VENV) .tools .keel .mypy_cache .pytest_cache .ruff_cache

# The container image (deploy/Dockerfile), tagged with the project's version
# and `dev` (the tag the dev overlay runs). Needs a working docker or podman.
.PHONY: image
KEEL_VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)
IMAGE ?= keel:$(KEEL_VERSION)
image:
	@engine="$${CONTAINER_ENGINE:-$$(command -v docker || command -v podman)}"; \
	if [ -z "$$engine" ]; then \
	  echo "make image: no container engine here (install docker or podman)" >&2; exit 1; \
	fi; \
	if ! "$$engine" info >/dev/null 2>&1; then \
	  echo "make image: $$engine is installed but cannot build here (no daemon or no permission)" >&2; \
	  exit 1; \
	fi; \
	"$$engine" build -f deploy/Dockerfile -t $(IMAGE) -t keel:dev .
