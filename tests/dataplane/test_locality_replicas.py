"""Client -> real Envoy -> ext_proc (fairness dlpm) -> two emulated engine replicas of one
pool: every turn of a conversation lands on the replica that served its first turn."""

from __future__ import annotations

import orjson
import pytest
import urllib3

from extproc.policy import hash_key
from tests.conftest import TEST_KEYS
from tests.dataplane.harness import running_gateway

pytestmark = pytest.mark.dataplane

HTTP = urllib3.PoolManager(timeout=urllib3.Timeout(connect=2, read=30), retries=False)


def _policy(first: str, second: str) -> str:
    return f"""\
version: 1
tiers: [standard]
tenants:
  globex:
    tier: standard
    api_keys: ["{hash_key(TEST_KEYS["globex"])}"]
pools:
  chat:
    max_total_tokens: 8192
    max_inflight: 8
    max_inflight_tokens: 200000
    endpoints: ["{first}", "{second}"]
    headroom: 0
    adaptive: {{enabled: false}}
fairness: {{policy: dlpm}}
"""


def _turn(topic: str, turns: int) -> bytes:
    messages: list[dict[str, str]] = [{"role": "system", "content": f"You know {topic}. " * 80}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question {turn} on {topic}"})
        messages.append({"role": "assistant", "content": f"answer {turn} " * 30})
    messages.append({"role": "user", "content": "go on"})
    return orjson.dumps({"model": "m", "messages": messages, "max_tokens": 4})


def test_a_conversation_stays_on_the_replica_holding_its_prefix(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    workdir = tmp_path_factory.mktemp("locality")
    with running_gateway(workdir, _policy) as gateway:
        headers = {
            "content-type": "application/json",
            "authorization": f"Bearer {TEST_KEYS['globex']}",
            "x-llm-replica": "1",  # a client's copy is stripped, never routed on
        }
        url = gateway.base_url + "/v1/chat/completions"
        served: dict[str, list[str]] = {}
        for turns in range(1, 4):
            for topic in ("tides", "bridges"):
                response = HTTP.request("POST", url, body=_turn(topic, turns), headers=headers)
                assert response.status == 200, response.data
                served.setdefault(topic, []).append(response.headers["x-engine-id"])
        assert served["tides"] == ["chat-0"] * 3
        assert served["bridges"] == ["chat-1"] * 3
        tenants = orjson.loads(HTTP.request("GET", gateway.admin_url + "/v1/tenants").data)
        rows = tenants["locality"]["pools"]["chat"]
        assert [row["routed"] for row in rows] == [3, 3]
