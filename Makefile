# Thin wrapper over CMake/ctest: the README's commands.
BUILD ?= build
JOBS ?= 2
CMAKE_FLAGS ?=

.PHONY: all deps build demo test bench install clean

all: build

deps:
	@.ci/install-deps

build: deps
	@cmake -S . -B $(BUILD) -DFERRY_WERROR=ON $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(BUILD) -j$(JOBS)

# The main job on a bundled default: synthesize a Llama-3-8B-like trace,
# dry-run default/layers/budget on an H100 link, write JSON, Chrome trace
# and SVG into $(BUILD)/demo/.
demo: build
	$(BUILD)/bin/ferry sim --demo $(BUILD)/demo

# Every suite: ctest (host, pool arena, CUDA double), sanitizers, valgrind,
# install, busted, pytest.
test: build
	@BUILD=$(BUILD) JOBS=$(JOBS) tests/run_all.sh

bench: build
	$(BUILD)/bin/ferry_bench --json $(BUILD)/bench.json
	@if [ -x ../shared/tools/scoreboard ]; then ../shared/tools/scoreboard $(BUILD)/bench.json; fi

install: build
	cmake --install $(BUILD)

clean:
	rm -rf $(BUILD) build-asan build-tsan build-nocuda
