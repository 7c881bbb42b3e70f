"""Shared fixtures: ``dist`` runs a function on N gloo processes (reused across tests)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def dist():
    from megalite.testing import PoolManager

    manager = PoolManager()
    yield manager
    manager.close()
