# The two README commands live here: `make demo` (the main job on the built-in demo) and `make test`.
# Both create .venv with Python 3.12 on first use and reinstall only when pyproject.toml changes.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.12 2>/dev/null || echo python3.12)
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: test test-all demo lint install

$(STAMP): pyproject.toml plugins/lerobot_policy_hf_vla/pyproject.toml Makefile
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e ".[test]"
	# the lerobot policy plugin (lerobot imports distributions named lerobot_policy_*): lerobot's tools run hf_vla
	# checkpoints through it
	$(VENV)/bin/python -m pip install -q --no-deps -e plugins/lerobot_policy_hf_vla
	# openpi's own client, for the server tests: its metadata pins numpy<2 and dm-tree, which the websocket client
	# never imports (only its action-chunk broker does), so it is installed without its dependencies.
	$(VENV)/bin/python -m pip install -q --no-deps "openpi-client==0.1.2"
	# Meta-World renders headless through Mesa's EGL (Debian's libegl1 + libgl1-mesa-dri): installed when missing.
	@ldconfig -p | grep -q 'libEGL_mesa.so.0' || { command -v apt-get >/dev/null && \
		(apt-get update -qq && apt-get install -y -qq libegl1 libgl1-mesa-dri) ; } || \
		echo "Meta-World needs Debian's libegl1 and libgl1-mesa-dri; install them to record or evaluate it"
	@touch $(STAMP)

install: $(STAMP)

# The suite runs in TEST_WORKERS pytest-xdist processes, each given whole test files (module fixtures are built once),
# the longest first (tests/conftest.py orders them): alone, pytest keeps about one of two cores busy (interpreter
# start-up of the commands it runs, env workers, 2-process launches). TEST_WORKERS=auto: one per core; 0: in this
# process (pdb, -s).
TEST_WORKERS ?= 2
# `make test` is the default suite, under 20 minutes on a 2-core machine: every module and command, DDP and FSDP2
# launches. The tests marked `slow` (the other engines' launches, elastic resume, further kill moments and attention
# backends, long end-to-end runs; docs/testing.md lists them) run with `make test-all` (everything) or
# `make test TEST_MARKS=slow` (only them); CI runs both tiers (.ci/run).
TEST_MARKS ?= not slow
test: $(STAMP)
	HF_HUB_OFFLINE=1 WANDB_MODE=offline $(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile \
		--no-loadscope-reorder $(if $(TEST_MARKS),-m "$(TEST_MARKS)") $(PYTEST_ARGS)

test-all:
	$(MAKE) test TEST_MARKS=

lint: $(STAMP)
	$(VENV)/bin/ruff check .

demo: $(STAMP)
	HF_HUB_OFFLINE=1 WANDB_MODE=offline $(VENV)/bin/python -m hf_vla.demo
