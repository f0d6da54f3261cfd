# Targets CI runs too (.ci/run calls `make test`). The Python of ./.venv when there is one
# (the one .ci/run creates), else python3.
PYTHON ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)

.PHONY: install lint typecheck unit test oracle-519 transformers-519 sglang-server-deps \
	sglang-server-tests demo

# installs the project with its dev extra unless everything it asks for is already there
install:
	@$(PYTHON) .ci/dev_installed.py || $(PYTHON) -m pip install -e '.[dev]'

lint: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

typecheck: install
	$(PYTHON) -m mypy

unit: install
	$(PYTHON) -m pytest tests/unit -q

# transformers 5.19.0, the version SGLang 0.5.23 pins, beside the venv's newer one: the oracle
# test's SGLang runs with it, and oracle-519 runs tokenmill with it too
TRANSFORMERS_519 := .cache/transformers-5.19.0
transformers-519:
	@test -d $(TRANSFORMERS_519)/transformers || $(PYTHON) -m pip install --quiet --no-deps \
		--target $(TRANSFORMERS_519) 'transformers==5.19.0'

# the deployment-exact oracle test again, with transformers 5.19.0 first on the path
oracle-519: transformers-519
	PYTHONPATH=$(TRANSFORMERS_519):$(CURDIR) $(PYTHON) -m pytest -q -p no:cacheprovider \
		tests/integration/test_sglang_oracle.py tests/integration/test_sglang_oracle_images.py

# SGLang 0.5.23's own HTTP server with a fake scheduler (tests/support/sglang_http): the wheel's
# sglang package extracted, and the server's pure-Python dependencies tokenmill does not install
# (FastAPI, uvicorn, pyzmq, ...) put into .cache/sglang-server-deps by pip
sglang-server-deps:
	$(PYTHON) -c 'from tests.support.sglang_http import harness; harness.server_deps(); harness.sglang_source()'

# the e2e tests on that server (they are in the default pytest run too)
sglang-server-tests: sglang-server-deps
	$(PYTHON) -m pytest -q -p no:cacheprovider tests/e2e/test_sglang_server.py

# two pytest workers, a test file's tests in one of them (each session has its own database
# and redis-server); PYTEST_WORKERS=0 runs the suite in one process. The files go out in
# collection order (chaos, e2e, integration, unit), not most tests first: the long files with
# few tests start early and the many short unit files fill both workers at the end
PYTEST_WORKERS ?= 2
test: lint typecheck transformers-519 sglang-server-deps
	$(PYTHON) -m pytest -q -p no:cacheprovider --durations=15 -n $(PYTEST_WORKERS) --dist loadfile \
		--no-loadscope-reorder
	$(MAKE) oracle-519

demo:
	tokenmill demo
