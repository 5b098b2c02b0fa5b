# The two commands of the README:
#   make demo   set up a fresh machine (virtualenv + pinned packages), prepare the shipped corpus, train tiny Llama
#   make test   set up the same way, then run the whole test suite
# For contributors (CONTRIBUTING.md): make test-fast (no test that starts a process, under a minute), make durations (the whole
# suite, refreshing tests/durations.txt).
# Everything runs on the CPU (DeepSpeed's CPU accelerator, gloo); override NPROC for more or fewer processes.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
NPROC ?= 4
# The suite runs on TEST_WORKERS pytest-xdist workers, tests grouped and ordered by tests/scheduling.py (most of a
# serial run's wall time waits on SLURM, timeouts or one core; two workers fill it). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder)
export DS_ACCELERATOR ?= cpu
export OMP_NUM_THREADS ?= 1
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export TOKENIZERS_PARALLELISM ?= false
# DeepSpeed's CPU shared-memory comm op: JIT-compiled (~90 s) the first time a process group starts on the CPU
# accelerator. `make setup` builds it once, as DeepSpeed's DS_BUILD_OPS would at install, so that neither the first
# training run nor the first test waits for it; a GPU node (DS_ACCELERATOR=cuda) does not need it.
COMM_OP := $(if $(filter cpu,$(DS_ACCELERATOR)),$(TORCH_EXTENSIONS_DIR)/deepspeed_shm_comm/deepspeed_shm_comm.so)

.PHONY: setup data data-llama3 demo test test-fast durations wheelhouse clean

setup: $(VENV)/.installed $(COMM_OP)

$(VENV)/.installed: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $@

$(TORCH_EXTENSIONS_DIR)/deepspeed_shm_comm/deepspeed_shm_comm.so: | $(VENV)/.installed
	@echo "building DeepSpeed's CPU shared-memory comm op into $(TORCH_EXTENSIONS_DIR) (about 90 s, once)"
	$(PY) -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load(verbose=False)"

data: data/prepared/shakespeare/manifest.json

data-llama3: data/prepared/shakespeare_llama3/manifest.json  # the data of recipes/tiny_llama3.yaml

data/prepared/shakespeare_llama3/manifest.json: $(VENV)/.installed data/corpus/shakespeare_milton.txt
	$(PY) data/prepare.py input=data/corpus/shakespeare_milton.txt output=data/prepared/shakespeare_llama3 \
		tokenizer.train_kind=llama3 tokenizer.train_vocab_size=2048 valid_fraction=0.02

data/prepared/shakespeare/manifest.json: $(VENV)/.installed data/corpus/shakespeare_milton.txt
	$(PY) data/prepare.py input=data/corpus/shakespeare_milton.txt output=data/prepared/shakespeare \
		tokenizer.train_vocab_size=2048 valid_fraction=0.02

demo: setup data
	$(PY) -m zerotrain.launch.torchrun --standalone --nproc_per_node=$(NPROC) train.py recipe=tiny_llama $(ARGS)

test: setup
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -m "not launch and not slurm" $(XDIST) $(PYTEST_ARGS)

durations: setup
	$(PY) tools/durations.py --out tests/durations.txt $(XDIST) $(PYTEST_ARGS)

# make wheelhouse PY=3.12: the wheels a GPU node with its own torch and no network needs (tools/wheelhouse.py,
# docs/offline_install.md), into wheelhouse/py312; needs PyPI. Here PY is the target Python version.
wheelhouse:
	test -x $(VENV)/bin/python || $(MAKE) setup PY=$(VENV)/bin/python
	$(VENV)/bin/python tools/wheelhouse.py --python $(if $(filter 3.%,$(PY)),$(PY),3.12) $(WHEELHOUSE_ARGS)

clean:
	rm -rf runs data/prepared .cache
