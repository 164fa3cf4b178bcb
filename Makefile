PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install test lint demo bench chaos long gpu-check mutants mutants-engine clean

$(STAMP): pyproject.toml constraints/cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints/cpu.txt -e '.[model,cluster,test]'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The multi-host test bed (bench/netbed.py) needs iproute2 (ip, tc) and root, its GCS restart test
# (tests/cluster/test_gcs_restart.py) a redis-server: installed here when missing and possible;
# otherwise those tests skip and say why.
test: $(STAMP) lint
	@command -v ip >/dev/null && command -v tc >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get update -qq && apt-get install -y -qq iproute2 >/dev/null; } || echo "iproute2 missing: the multi-host bed tests skip"
	@command -v redis-server >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; } \
		|| echo "redis-server missing: the GCS restart test skips"
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) -m cluster.demo

# The fault tests too long for make test's 15 minutes (marker `chaos`): node loss, the GCS restart with
# Redis, the chaos soak's short form (tests/cluster/test_chaos.py) and the seven-scenario fault injection
# (tests/cluster/test_faults.py): 12 passed in 6 min 36 s on 6 Dec. Since 7 Dec also controller loss
# (test_controller_restart.py), replicas replaced after a death or a dead engine loop
# (test_replica_restart_ray.py, test_engine_supervision.py), a replica killed under load
# (test_ray_cluster.py), a frozen one (test_control_plane_load.py) and a front door killed mid-load
# (test_frontdoors.py): 20 passed in 7 min 57 s on 7 Dec. The full soak is `python -m bench.chaos --minutes 10`.
# Same needs as test's bed, plus redis-server.
chaos: $(STAMP)
	@command -v redis-server >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get update -qq && apt-get install -y -qq iproute2 redis-server >/dev/null; } \
		|| echo "redis-server missing: the soak's gcs_restart test skips"
	$(PY) -m pytest -q -m chaos tests/cluster

# End-to-end runs too long for make test (marker `long`): the P/D interference load test against a
# mixed and a --pd server (tests/cluster/test_loadtest_interference.py, ~50 s), the control-plane and
# fault benchmarks run from the checkout's root (tests/bench/test_bench_outputs.py, ~55 s), `ray start`
# + `ray job submit` (test_ray_job_submit.py, ~37 s), `loadtest --compare` (~15 s) and the loader RSS
# benchmark (~13 s).
long: $(STAMP)
	$(PY) -m pytest -q -m long tests

bench: $(STAMP)
	$(PY) -m bench.lookup

# A borrowed CUDA machine in one command, within 10 minutes (bench/gpu_check.py): the [cuda] extra, the
# gpu-marked tests, the NCCL transfer vs raw send/recv, bench.engine's concurrency 1 / 32 on the GPU; one
# table, JSON in GPU_CHECK_OUT. The system Python looks for a GPU first: without one it says so and stops
# (exit 0) before anything is installed or run.
GPU_CHECK_OUT ?= out/gpu_check.json

gpu-check:
	@if $(PYTHON) -m bench.gpu_check --find-gpu; then \
		$(MAKE) --no-print-directory install && $(PY) -m bench.gpu_check --out $(GPU_CHECK_OUT); fi

# Mutation testing (not part of `make test`). `make mutants`: cache_service/ judged by the fast
# tests/cache_service ([tool.mutmut] in pyproject.toml says what); `make mutants-engine`: the
# engine's cache manager judged by the engine tests, in a copy of the tracked tree whose
# [tool.mutmut] is rewritten from the two variables below. Each run starts fresh (today's score);
# tests/mutation_score.py prints it and checks tests/MUTANTS.md accounts for every survivor.
MUTMUT_JOBS ?= 2
MUTANTS_ENGINE_PATHS ?= workers/engine/cache_manager.py
MUTANTS_ENGINE_TESTS ?= tests/engine/test_prefix_cache_exact.py tests/engine/test_requests.py tests/engine/test_speculative.py \
	tests/engine/test_preemption.py tests/engine/test_checkpoint_budget.py
MUTMUT := $(abspath $(VENV))/bin/mutmut

mutants: $(STAMP)
	$(PIP) install --quiet -c constraints/cpu.txt mutmut  # the dev extra; its version pinned in constraints
	rm -rf mutants && mkdir mutants
	OMP_NUM_THREADS=1 $(MUTMUT) run --max-children $(MUTMUT_JOBS) > mutants/run.log 2>&1 \
		|| (tr '\r' '\n' < mutants/run.log | tail -30; false)
	tr '\r' '\n' < mutants/run.log | grep -a "mutations/second" || true
	$(PY) -m tests.mutation_score

mutants-engine: $(STAMP)
	$(PIP) install --quiet -c constraints/cpu.txt mutmut
	rm -rf build/mutants-engine && mkdir -p build/mutants-engine
	git ls-files -z | xargs -0 cp --parents -t build/mutants-engine
	$(PY) -m tests.mutation_score --configure build/mutants-engine/pyproject.toml \
		--paths $(MUTANTS_ENGINE_PATHS) --tests $(MUTANTS_ENGINE_TESTS)
	cd build/mutants-engine && mkdir mutants && OMP_NUM_THREADS=1 $(MUTMUT) run --max-children $(MUTMUT_JOBS) \
		> mutants/run.log 2>&1 || (tr '\r' '\n' < mutants/run.log | tail -30; false)
	cd build/mutants-engine && $(abspath $(PY)) -m tests.mutation_score

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache mutants build/mutants-engine
