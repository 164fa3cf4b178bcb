PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install test lint demo bench clean

$(STAMP): pyproject.toml constraints/cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints/cpu.txt -e '.[model,cluster,test]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP) lint
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) -m cluster.demo

bench: $(STAMP)
	$(PY) -m bench.lookup

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
