PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install test lint demo bench mutants clean

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

# Mutation testing (not part of `make test`: ~N min on 2 cores). What is mutated and which tests
# judge it: [tool.mutmut] in pyproject.toml. A fresh run every time, so the score is today's.
MUTMUT_JOBS ?= 2
mutants: $(STAMP)
	$(PIP) install --quiet -c constraints/cpu.txt mutmut  # the dev extra; version pinned in constraints
	rm -rf mutants && mkdir mutants
	OMP_NUM_THREADS=1 $(VENV)/bin/mutmut run --max-children $(MUTMUT_JOBS) > mutants/run.log 2>&1 \
		|| (tail -30 mutants/run.log; false)
	$(PY) -m tests.mutation_score

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache mutants
