# Every target sets itself up: a fresh clone needs nothing but Python 3.10+ and make.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve test test-fast install model model-gemma3 lint bench clean browser claude-code

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: unpinned, pip would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(PY) -m radixserve.cli model pull

# The 32k-context model of the long-prompt tests (Gemma 3 270M, Q4_K_M, 241 MB).
model-gemma3: $(STAMP)
	$(PY) -m radixserve.cli model pull gemma3-270m

serve: model
	$(PY) -m radixserve.cli serve $(ARGS)

# Two workers, each taking whole modules (one model load or server per module, as written):
# much of the suite waits on server processes and Ray, so two overlap on two cores.
TEST_WORKERS ?= 2
test: model model-gemma3 browser claude-code
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(ARGS)

# The modules that need neither the default model nor a server process (markers in pyproject.toml).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not model and not server" $(ARGS)

# The dashboard's browser test drives Debian's chromium (never a downloaded browser): installed
# here where apt-get runs as root (CI); elsewhere that test skips and says how to install it.
browser:
	@command -v chromium >/dev/null || { \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) \
	      || echo "note: installing chromium failed; the dashboard browser test will skip"; \
	  else \
	    echo "note: no chromium and no root apt-get; the dashboard browser test will skip"; \
	    echo "      (apt-get install chromium to run it)"; \
	  fi; }

# The Claude Code test drives the real CLI, pinned, installed with npm into .node/ (git-ignored;
# the package brings its own native binary). Without npm the test skips and says how to run it.
CLAUDE_CODE_VERSION := 2.1.332
CLAUDE := .node/node_modules/.bin/claude
claude-code:
	@[ -x $(CLAUDE) ] && $(CLAUDE) --version 2>/dev/null | grep -q '^$(CLAUDE_CODE_VERSION) ' || { \
	  if command -v npm >/dev/null; then \
	    npm install --prefix .node --no-audit --no-fund --loglevel=error \
	      @anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION) \
	      || echo "note: installing Claude Code failed; its test will skip"; \
	  else \
	    echo "note: no npm; the Claude Code test will skip (install Node.js and npm to run it)"; \
	  fi; }

bench: model
	$(PY) benchmarks/peers.py $(ARGS)

# ruff, and the import structure: no circles, no private-name imports, the floors of
# docs/architecture.md (tests/test_import_floors.py reads the source; it needs no model).
lint: $(STAMP)
	$(VENV)/bin/ruff check radixserve tests benchmarks
	$(PY) -m pytest -q -p no:cacheprovider tests/test_import_floors.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .node
