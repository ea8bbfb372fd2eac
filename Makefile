# Two commands do all set-up: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kiln-installed

.PHONY: demo test install bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m kiln.demo --out demo_out

test: $(STAMP)
	$(PY) -m pytest -n 2 tests

bench: $(STAMP)
	$(PY) benchmarks/compare.py

clean:
	rm -rf $(VENV) demo_out build *.egg-info
