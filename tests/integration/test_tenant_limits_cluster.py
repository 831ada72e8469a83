"""tests/integration/test_tenant_limits.py again, on a real three-master Redis Cluster: RPM, TPM and quota limits (one tenant's three counters in one Lua script, on one slot), through a real
gateway. Every name of that module is taken in; its tests get the cluster where they ask for ``redis_url``."""

import pytest

from tests.integration import test_tenant_limits as _module

globals().update({name: value for name, value in vars(_module).items() if not name.startswith("__")})


@pytest.fixture(scope="session", name="redis_url")
def _cluster_url(redis_cluster) -> str:
    return redis_cluster.url
