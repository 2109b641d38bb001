"""One local Ray cluster per test module, for the Ray deployment's stack tests (test_ray_deploy.py,
test_ray_replicas.py). Starting Ray (its GCS, raylet and worker pool) takes seconds to tens of seconds
on a loaded 2-core machine; a RayDeployment started in a process already connected to Ray uses that
connection and, when it stops, removes its actors and placement groups and leaves Ray up for the next."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from free_ports import free_port  # noqa: F401  (the Ray tests import it from here)


@contextmanager
def ray_cluster(num_cpus: int):
    """For a module fixture: this process connected to a new local Ray cluster of ``num_cpus``
    logical CPUs (loopback only, as RayDeployment starts one), shut down after the module."""
    from temper.deploy.ray_cluster import GCS_PORT_WAIT, LOOPBACK_ONLY, NAMESPACE

    with pytest.MonkeyPatch.context() as env:
        env.setenv(LOOPBACK_ONLY, "0")  # read when Ray is first imported, and by the raylet this starts
        env.setenv(*GCS_PORT_WAIT)
        import ray

        ray.init(num_cpus=num_cpus, include_dashboard=False, namespace=NAMESPACE)
        try:
            yield ray
        finally:
            ray.shutdown()
