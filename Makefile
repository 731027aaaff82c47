# The two commands of the README: `make serve` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Typed strictly (mypy --strict): the nouns, the scheduler, the KV manager and tiers, the store,
# transfer, the weight formats, the cluster simulator, the reply parsers (server/tools), the
# placement presets.
STRICT := hetserve/core hetserve/sched hetserve/kv hetserve/store hetserve/transfer hetserve/quant \
	hetserve/disagg/policy.py hetserve/disagg/instance_checks.py hetserve/disagg/cluster_spec.py hetserve/disagg/costs.py hetserve/disagg/delivery_probe.py hetserve/disagg/index.py \
	hetserve/disagg/kv_wire.py hetserve/disagg/kv_publisher.py hetserve/disagg/kv_subscriber.py \
	hetserve/server/tools hetserve/config.py hetserve/config_sections.py hetserve/errors.py \
	hetserve/envs.py hetserve/sim hetserve/moe/presets.py hetserve/moe/numa.py
# Debian packages the store tests start for real: Redis, and libibverbs that Mooncake links.
SYSTEM_PACKAGES := redis-server libibverbs1

.PHONY: test serve lint system-deps clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first: the pinned CPU wheel is a local file here; anything else pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# Mooncake Store, the peer of the pool backend (tests and bench skip without it).
	$(PY) -m pip install -q -e '.[mooncake]' || echo "mooncake not installed: its tests will skip"
	touch $(STAMP)

test: $(STAMP) system-deps
	$(PY) -m pytest -q -ra

serve: $(STAMP)
	$(VENV)/bin/hetserve serve

lint: $(STAMP)
	$(VENV)/bin/ruff check hetserve tests
	$(VENV)/bin/mypy --strict $(STRICT)

# Services the store tests start for real (Redis, Mooncake's libibverbs). Best-effort: without
# root or apt the tests that need them skip with the reason.
system-deps:
	@bash scripts/system_deps.sh $(SYSTEM_PACKAGES)

clean:
	rm -rf $(VENV) build *.egg-info
