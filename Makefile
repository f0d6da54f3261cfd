# Targets CI runs too (.ci/run calls `make test`).
PYTHON ?= python3

.PHONY: install lint typecheck unit test demo

install:
	$(PYTHON) -m pip install -e '.[dev,ops]'

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

typecheck:
	$(PYTHON) -m mypy

unit:
	$(PYTHON) -m pytest tests/unit -q

test: lint typecheck
	$(PYTHON) -m pytest -q -p no:cacheprovider --durations=15

demo:
	tokenmill demo
