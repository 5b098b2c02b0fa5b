"""Every test process, and every process it launches, runs with the CPU environment of tests/launch_utils.py."""

import os

from launch_utils import CPU_ENV

os.environ.update(CPU_ENV)
