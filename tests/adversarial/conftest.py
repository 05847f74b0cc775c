"""One real gateway (Envoy, ext_proc service, emulated engines) on loopback for the
adversarial tests that need Envoy, with a small body limit so oversized bodies stay cheap."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.adversarial.raw_http import BODY_LIMIT
from tests.conftest import policy_yaml
from tests.dataplane.harness import RunningGateway, running_gateway


@pytest.fixture(scope="session")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    workdir = tmp_path_factory.mktemp("adversarial-gateway")
    extra = f"gateway: {{max_body_bytes: {BODY_LIMIT}}}"
    with running_gateway(workdir, lambda short, long_: policy_yaml(short, long_, extra)) as gw:
        yield gw
