# Two commands do all set-up: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kiln-installed

.PHONY: demo test test-avx2 install bench clean conformance fuzz proto

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,serve,serve-test,explorer]'
	@$(PY) -m pip install --quiet -e '.[onednn]' || \
	  echo "warning: could not install oneDNN's C API (kiln's 'onednn' tactic source is then not offered)"
	@command -v dot >/dev/null || apt-get install -y -q graphviz >/dev/null 2>&1 || \
	  (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q graphviz >/dev/null 2>&1) || \
	  echo "warning: could not install graphviz (kiln draw/report need 'dot'); its tests will be skipped"
	@test -x /usr/bin/chromium || apt-get install -y -q chromium >/dev/null 2>&1 || \
	  echo "warning: could not install chromium (the headless report test will be skipped)"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m kiln.demo --out demo_out

test: $(STAMP)
	$(PY) -m pytest -n 2 tests

# the suite as on an AVX2-only CPU (no AVX-512/VNNI/AMX as kiln sees it; needs root for `unshare -m`)
test-avx2: $(STAMP)
	.ci/as-avx2 $(PY) -m pytest -n 2 tests

# ONNX backend conformance (onnx==1.23.2 node tests for kiln's ops; also part of `make test`)
conformance: $(STAMP)
	$(PY) -m pytest -n 2 tests/conformance

# coverage-guided fuzzing (atheris) of the engine loader, the ONNX importer and the TensorRT readers
FUZZ_SECONDS ?= 60
fuzz: $(STAMP)
	$(PY) -m pip install --quiet atheris
	for t in engine onnx trt; do $(PY) fuzz/run_atheris.py $$t -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=4096 || exit 1; done

# after editing kiln/serve/proto/grpc_predict_v2.proto: recompile its descriptor (grpcio-tools' protoc)
proto: $(STAMP)
	$(PY) -m kiln.serve.proto.generate

bench: $(STAMP)
	$(PY) benchmarks/compare.py

clean:
	rm -rf $(VENV) demo_out build *.egg-info
