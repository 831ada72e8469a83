"""tests/integration/test_tenants.py again, on a real three-master Redis Cluster: tenants and API keys (each written with its index in one MULTI), auth and the admin API, through a real
gateway. Every name of that module is taken in; its tests get the cluster where they ask for ``redis_url``."""

import pytest

from tests.integration import test_tenants as _module

globals().update({name: value for name, value in vars(_module).items() if not name.startswith("__")})


@pytest.fixture(scope="session", name="redis_url")
def _cluster_url(redis_cluster) -> str:
    return redis_cluster.url
