# Targets CI runs too (.ci/run calls `make test`). The Python of ./.venv when there is one
# (the one .ci/run creates), else python3.
PYTHON ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)

.PHONY: install lint typecheck unit test demo

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

test: lint typecheck
	$(PYTHON) -m pytest -q -p no:cacheprovider --durations=15

demo:
	tokenmill demo
