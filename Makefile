# Two commands matter: `make serve` and `make test`. Both create .venv when missing and install
# everything they need; re-running set-up when nothing changed costs only a stamp check (the C
# extensions are rebuilt by the install when their sources change).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.epd-installed

.PHONY: setup serve test lint typecheck pytest bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py epd_common/native.py scripts/setup_env.sh media_io/preprocess/_patchify.c media_io/_jpeg.c $(wildcard llm_core/_*.c llm_core/_*.h)
	VENV=$(VENV) bash scripts/setup_env.sh
	@touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/epd serve

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

pytest: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q $(PYTEST_ARGS)

test: lint typecheck pytest

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
