"""Shared test helpers: small transformer-shaped parameter sets and stepping a wrapped optimizer."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
