"""Tools that work on runs and machines, outside the training library: nothing in ``zerotrain`` imports them.

* :mod:`tools.compare` — compare runs: loss curves, throughput, a summary table, a loss-parity check
  (``python -m tools.compare``, installed as ``zerotrain-compare``);
* :mod:`tools.emulate` — N emulated nodes with shaped links on one Linux host (``sudo python -m tools.emulate``,
  installed as ``zerotrain-emulate``);
* :mod:`tools.launcher` — how the tests and the benchmarks start processes (a command, torchrun, N emulated nodes)
  without ever leaving one behind.

Like the library they are installed with the package (``pip install -e .``), so they run from any directory.
"""
