# Every target sets itself up: a fresh clone needs nothing but Python 3.10+ and make.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test install model lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: unpinned, pip would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(PY) -m radixserve.cli model pull

serve: model
	$(PY) -m radixserve.cli serve $(ARGS)

test: model
	$(PY) -m pytest -q $(ARGS)

bench: model
	$(PY) benchmarks/peers.py $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check radixserve tests benchmarks

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
