"""pytest fixtures for tests/comm: the 2-node x 2-rank launches shared by test_grad_reduce.py and test_comm_bytes.py
(comm_launches.py), once per session."""

from __future__ import annotations

import pytest
from comm_launches import launch


@pytest.fixture(scope="session")
def comm_launches_results(shakespeare, tmp_path_factory) -> dict:
    """Every stage of both launches: test_grad_reduce.py's sections and ``comm`` (test_comm_bytes.py's)."""
    return launch(shakespeare, tmp_path_factory.mktemp("comm_launches"))
