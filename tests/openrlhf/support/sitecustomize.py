"""Loaded at start-up by every Python process with tests/openrlhf/support on PYTHONPATH (the OpenRLHF
test suite's pytest process and its Ray workers): installs the CPU-test stubs. Test code only."""

import rlalign_cpu_test_shims

rlalign_cpu_test_shims.install()
