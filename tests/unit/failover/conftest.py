"""A real in-process TCPStore for the coordinator and liveness tests."""

import datetime

import pytest
import torch.distributed as dist


@pytest.fixture
def store():
    return dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=10),
    )
