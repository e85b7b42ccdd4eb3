# Two commands do all the set-up: `make demo` and `make test` (both create .venv).
PY := .venv/bin/python
export DS_ACCELERATOR ?= cpu
# torch's JIT extensions (DeepSpeed's CPU comm op) per venv: the shared default makes checkouts rebuild for each other
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.venv/torch_extensions
# The venv's tools first (as the tests' launches have them): its ninja builds that op; another ninja on PATH would
# find the build log of a different ninja version and rebuild the op (2-3 minutes) between `make demo` and the tests.
export PATH := $(CURDIR)/.venv/bin:$(PATH)

.PHONY: install demo test cluster-test
install: .venv/.installed

# torch first, from the CPU wheel, so that pip does not pull a multi-GB CUDA build for `torch>=`.
.venv/.installed: pyproject.toml
	python3 -m venv .venv
	.venv/bin/pip install -q torch==2.13.0
	.venv/bin/pip install -q -e '.[test,mpi]' accelerate
	# DeepSpeed's CPU comm op, JIT-built once here (~2.5 min) rather than by the first ranks that start together
	.venv/bin/python -c "from deepspeed.accelerator import get_accelerator; \
get_accelerator().create_op_builder('ShareMemCommBuilder').load()"
	touch $@

demo: install
	.venv/bin/ds-packdpo train --output-dir runs/demo --overwrite --synthetic-pairs 1024 \
		--global-batch-pairs 16 --max-length 256 --max-steps 60 --lr 1e-3 --beta 0.1 \
		--eval-fraction 0.1 --eval-steps 20
	$(PY) -c "import json; a=[json.loads(l) for l in open('runs/demo/metrics.jsonl')]; r=a[-10:]; e=a[-1]; \
print('last 10 steps: loss %.3f  rewards/accuracies %.3f | held out (%d pairs, after step %d): eval_loss %.3f  eval_rewards/accuracies %.3f' \
% (sum(x['loss'] for x in r)/len(r), sum(x['rewards/accuracies'] for x in r)/len(r), e['eval_pairs'], e['step'], e['eval_loss'], e['eval_rewards/accuracies']))"

test: install
	.venv/bin/pytest -q

# Real cluster launches (tests/test_cluster.py: DeepSpeed's PDSH runner over ssh, a Slurm job, a node that dies), in a
# network namespace with only the loopback.  As root it installs their Debian packages and none may be skipped;
# otherwise one line says what is missing and they are skipped with it.
cluster-test: install
	$(PY) tests/cluster.py install
	DS_PACKDPO_CLUSTER_REQUIRED=$$(test "$$(id -u)" = 0 && echo 1) .venv/bin/pytest -q -m cluster
