#!/usr/bin/env bash
# Install the two engines the engine tests run (tests/test_megatron.py, tests/test_deepspeed.py)
# into the active environment, pinned to the versions those tests were written against.
#
# Neither install may replace the torch already installed (pip would pull a CUDA build of
# several GB): both go in with --no-deps, after the pure-Python packages they import.
# DeepSpeed builds from its sdist (no wheel on PyPI) without build isolation, so that its
# setup.py sees this torch, and with DS_BUILD_OPS=0: no C++/CUDA op is compiled (the tests
# need none). About half a minute in all.
set -euo pipefail

MEGATRON_CORE=0.16.1
DEEPSPEED=0.19.8

pip install numpy "packaging>=24.2" einops hjson msgpack ninja psutil py-cpuinfo "pydantic>=2" tqdm
pip install --no-deps "megatron-core==${MEGATRON_CORE}"
DS_BUILD_OPS=0 pip install --no-deps --no-build-isolation "deepspeed==${DEEPSPEED}"
