# Thin wrapper over CMake/ctest: the README's commands.
BUILD ?= build
JOBS ?= 2
CMAKE_FLAGS ?=
PYTHON_TORCH ?= /usr/bin/python3

.PHONY: all deps build demo test bench gpu-check gpu-rehearse soak mutate install clean

all: build

deps:
	@.ci/install-deps

build: deps
	@cmake -S . -B $(BUILD) -DFERRY_WERROR=ON $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(BUILD) -j$(JOBS) -- --no-print-directory

# The main job on a bundled default: synthesize a Qwen3-14B fine-tune (seq
# 8192, FSDP over 8) that does not fit an 80 GB H100 without offloading,
# dry-run default/layers/budget on h100, find the cheapest policy that fits
# (--fit device), print it with the commands to check and use it; the HTML
# report (report.html), JSON, Chrome trace, SVG and fit.lua go to $(BUILD)/demo/.
# Then a real run: a small GPT-style model trains a few steps on CPU through
# ferry.torch.offload (Debian's torch), recording its trace, which the
# simulator replays beside the synthesized one (its report: gpt-cpu.html).
demo: build
	$(BUILD)/bin/ferry sim --demo $(BUILD)/demo
	PYTHONPATH=$(BUILD)/python $(PYTHON_TORCH) examples/train_gpt.py --steps 4 --trace $(BUILD)/demo/gpt-cpu.jsonl
	$(BUILD)/bin/ferry sim --trace $(BUILD)/demo/gpt-cpu.jsonl --policy policies/default.lua,policies/budget.lua --hw h100 --steps 3 --html $(BUILD)/demo/gpt-cpu.html

# Every suite: ctest (host, pool arena, CUDA double), sanitizers, valgrind,
# install, busted, pytest.
test: build
	@BUILD=$(BUILD) JOBS=$(JOBS) tests/run_all.sh

bench: build
	$(BUILD)/bin/ferry_bench --json $(BUILD)/bench.json
	@py=$$(.ci/python-env 2>/dev/null | tail -1); [ -x "$$py" ] || py=$(PYTHON_TORCH); \
	  echo "[torch] $$py"; $$py -c 'import torch, sys; sys.exit(int(torch.__version__.split(".")[0]) < 2)' 2>/dev/null || \
	    echo "[torch 2.x] no torch 2.x interpreter (.ci/python-env failed): the *_torch2 metrics stay missing"; \
	  PYTHONPATH=$(BUILD)/python $$py bench/bench_torch.py --json $(BUILD)/bench.json && \
	  PYTHONPATH=$(BUILD)/python $$py bench/bench_step.py --json $(BUILD)/bench.json && \
	  PYTHONPATH=$(BUILD)/python $$py bench/bench_checkpoint.py --json $(BUILD)/bench.json && \
	  PYTHONPATH=$(BUILD)/python $$py bench/bench_optim.py --json $(BUILD)/bench.json && \
	  PYTHONPATH=$(BUILD)/python $$py bench/bench_arena_training.py --json $(BUILD)/bench.json
	@py=/usr/bin/python3; \
	  if [ -x "$$py" ] && $$py -c 'import torch, sys; sys.exit(int(torch.__version__.split(".")[0]) != 1)' 2>/dev/null; then \
	    echo "[torch 1.x] $$py"; PYTHONPATH=$(BUILD)/python $$py bench/bench_torch.py --json $(BUILD)/bench.json && \
	    PYTHONPATH=$(BUILD)/python $$py bench/bench_step.py --json $(BUILD)/bench.json; \
	  else echo "[torch 1.x] skipped: $$py has no torch 1.x (the *_torch1 metrics stay missing)"; fi
	@python3 bench/targets.py $(BUILD)/bench.json

# On a machine with a GPU (CI has none): every GPU check in one run,
# tests/gpu/on-device.sh (unpacks gpu-carry, gathered here by
# tests/gpu/gather.sh, into a private prefix, builds build-gpu/ with CUDA,
# runs each check under its own bound; summary.json and logs in $(BUILD)/gpu).
gpu-check:
	@[ -f gpu-carry/debs/LIST ] || tests/gpu/gather.sh
	tests/gpu/on-device.sh $(BUILD)/gpu

# The same run rehearsed without a GPU (a stage of `make test`): it must
# unpack, configure, build, and report every GPU step as "no GPU".
gpu-rehearse:
	BUILD=$(BUILD) tests/gpu/rehearse.sh

# Longer runs than make test affords: fault injection over 200,000 seeded
# rounds (make test runs 1,500) and the concurrency stress for 20,000 steps
# per thread (make bench runs 200). About eight minutes on 2 cores.
SOAK_FAULT_ROUNDS ?= 200000
SOAK_STRESS_STEPS ?= 20000
soak: build
	FERRY_FAULT_ROUNDS=$(SOAK_FAULT_ROUNDS) $(BUILD)/bin/ferry_tests faults_lose_nothing
	FERRY_STRESS_STEPS=$(SOAK_STRESS_STEPS) $(BUILD)/bin/ferry_bench --only stress --json $(BUILD)/soak.json
	@python3 bench/targets.py $(BUILD)/soak.json | grep -E '^(target|stress_)|passed'

# Mutation testing (tests/mutate/): plants each mutant, rebuilds build-mutate,
# runs the suite that should catch it; writes $(BUILD)/mutate.json. Not part
# of `make test` (about half a minute per mutant).
mutate: build
	@py=$$(.ci/python-env 2>/dev/null | tail -1); [ -x "$$py" ] || py=$(PYTHON_TORCH); \
	  FERRY_MUTATE_PYTHON=$$py JOBS=$(JOBS) python3 tests/mutate/run.py --json $(BUILD)/mutate.json

install: build
	cmake --install $(BUILD)

clean:
	rm -rf $(BUILD) build-asan build-tsan build-nocuda
