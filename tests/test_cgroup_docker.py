"""A real container CPU quota: `docker run --cpus 1.5` (the test's own dockerd, tests/dockerd.py) and
trainer.hostenv reading it from inside, from whichever cgroup version the engine gives the container."""

from __future__ import annotations

import pytest

from tests.dockerd import BASE_IMAGE
from tests.helpers import REPO

READ = "import sys; sys.path.insert(0, '/opt/t'); from trainer import hostenv; print(hostenv.cgroup_cpu_limit())"


@pytest.mark.timeout(300)
def test_a_docker_cpus_quota_is_what_hostenv_reads_inside(node_docker):
    mount = f"{REPO / 'trainer'}:/opt/t/trainer:ro"
    args = ("run", "--rm", "--network", "host", "-v", mount)
    limited = node_docker.docker(*args, "--cpus", "1.5", BASE_IMAGE, "python3", "-c", READ, timeout=120)
    assert limited.stdout.decode().strip() == "1.5", limited.stderr.decode()[-2000:]
    free = node_docker.docker(*args, BASE_IMAGE, "python3", "-c", READ, timeout=120)
    assert free.stdout.decode().strip() == "None", free.stderr.decode()[-2000:]
