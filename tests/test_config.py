"""daskdist's settings live in dask.config (defaults from daskdist.yaml)."""

import dask

from daskdist import config


def test_defaults_are_loaded_into_dask_config():
    assert dask.config.get("daskdist.liveness.lease-timeout") == "30s"
    assert config.seconds("liveness.lease-timeout") == 30.0
    assert config.seconds("collective.formation-retry") == 0.2
    assert int(config.get("worker.prefetch")) == 16


def test_user_overrides_win():
    with dask.config.set({"daskdist.scheduler.poll-interval": "250ms"}):
        assert config.seconds("scheduler.poll-interval") == 0.25
    assert config.seconds("scheduler.poll-interval") == 2.0
