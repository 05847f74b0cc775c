"""Counting in Envoy: the Lua filter, the events cluster and the gRPC access log that replace the
accounting ext_proc filter (`extproc envoy render --count-in-envoy`, `serve --envoy-events`).

With the accounting ext_proc filter, Envoy relays every response chunk to the service as a gRPC
message, and most of the CPU under streaming load goes there (docs/benchmarks.md, "Counting in
Envoy instead"). Here Envoy counts the chunks itself and tells the service only what it uses:

* the request passes (right after its admission): `POST /attach/<id>`, so its capacity stays
  held until it ends, as an accounting stream's attach holds it;
* the first chunk: `POST /first/<id>` with the output seen so far (the first token: prefill
  pacing, the TTFT δ);
* every `EVERY` chunks: `POST /output/<id>` with the output seen so far and the longest gap
  (microseconds, Envoy's clock) between two chunks with output since the last call (fair-share
  charges as the output passes; the inter-token gaps the δ objectives watch);
* the end, however it ends (a client that leaves mid-stream included): the access-log entry
  Envoy sends the service's gRPC access-log sink, with the count and the engine's usage the
  script stored in the stream's dynamic metadata (namespace `gw`) after every chunk, and when
  the first chunk passed (Envoy's clock, µs), for a response whose end overtakes its `/first`
  call.

The calls are asynchronous: Envoy does not wait for their answers, and a lost call costs a
charge's timing, never a count (the end carries the final one). The count is the engine's own
`usage` when the response carries it (the admission asks every stream for it), otherwise one
token per chunk with non-empty `content`, `reasoning_content` or `text`, as
extproc.sse counts. The service side is extproc.service.envoy_counts.
"""

from __future__ import annotations

import re
from datetime import timedelta

from envoy_data_plane.envoy.config.accesslog.v3 import AccessLog, AccessLogFilter, MetadataFilter
from envoy_data_plane.envoy.config.core.v3 import (
    ApiVersion,
    DataSource,
    GrpcService,
    GrpcServiceEnvoyGrpc,
)
from envoy_data_plane.envoy.extensions.access_loggers.grpc.v3 import (
    CommonGrpcAccessLogConfig,
    HttpGrpcAccessLogConfig,
)
from envoy_data_plane.envoy.extensions.filters.http.lua.v3 import Lua
from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
    HttpFilter,
)
from envoy_data_plane.envoy.type.matcher.v3 import (
    MetadataMatcher,
    MetadataMatcherPathSegment,
    StringMatcher,
    ValueMatcher,
)
from envoy_data_plane.google.protobuf import Any as AnyProto

from extproc.types import GATEWAY_REQUEST_ID_HEADER

EVENTS_CLUSTER = "extproc_events"
COUNTING_FILTER = "extproc.counting"
METADATA_NAMESPACE = "gw"
ACCESS_LOG_NAME = "extproc-counts"
EVERY = 16
"""Chunks between two `/output` calls: about half the Envoy CPU of a call per chunk
(docs/benchmarks.md)."""

_SCRIPT = (
    r"""
local EVENTS = "__CLUSTER__"
local NS = "__NS__"
local EVERY = __EVERY__

local function post(handle, path, body)
  handle:httpCall(EVENTS, {[":method"] = "POST", [":path"] = path,
                           [":authority"] = "extproc-events"}, body, 1000, true)
end

function envoy_on_request(handle)
  local id = handle:headers():get("__ID_HEADER__")
  if id == nil or not string.match(id, "^[%w%-_]+$") then
    return
  end
  handle:streamInfo():dynamicMetadata():set(NS, "id", id)
  post(handle, "/attach/" .. id, "")
end

local function number(text, key)
  local value = string.match(text, '"' .. key .. '":%s*(%d+)')
  if value then
    return tonumber(value)
  end
  return nil
end

function envoy_on_response(handle)
  local gw = handle:streamInfo():dynamicMetadata():get(NS)
  if gw == nil or gw["id"] == nil then
    return
  end
  local id = gw["id"]
  local base, since, chunks, carry = 0, 0, 0, ""
  local last_at, largest = nil, 0
  for chunk in handle:bodyChunks() do
    local size = chunk:length()
    if size > 0 then
      local text = chunk:getBytes(0, size)
      local _, a = string.gsub(text, '"content":"[^"]', "")
      local _, b = string.gsub(text, '"text":"[^"]', "")
      since = since + a + b
      if a + b > 0 then
        local at = tonumber(handle:timestampString(EnvoyTimestampResolution.MICROSECOND))
        if last_at ~= nil and at - last_at > largest then
          largest = at - last_at
        end
        last_at = at
      end
      local window = carry .. text
      local metadata = handle:streamInfo():dynamicMetadata()
      if string.find(window, '"completion_tokens":', 1, true) then
        local completion = number(window, "completion_tokens")
        if completion then
          base, since = completion, 0
          metadata:set(NS, "completion", completion)
          local prompt = number(window, "prompt_tokens")
          if prompt then metadata:set(NS, "prompt", prompt) end
          local total = number(window, "total_tokens")
          if total then metadata:set(NS, "total", total) end
          local cached = number(window, "cached_tokens")
          if cached then metadata:set(NS, "cached", cached) end
        end
      end
      carry = string.sub(text, -96)
      local count = base + since
      metadata:set(NS, "tokens", count)
      chunks = chunks + 1
      if chunks == 1 then
        post(handle, "/first/" .. id, tostring(count))
        local first_us = handle:timestampString(EnvoyTimestampResolution.MICROSECOND)
        metadata:set(NS, "first_us", tonumber(first_us))
      elseif chunks % EVERY == 0 then
        post(handle, "/output/" .. id, string.format("%d %d", count, largest))
        largest = 0
      end
    end
  end
end
""".replace("__NS__", METADATA_NAMESPACE)
    .replace("__EVERY__", str(EVERY))
    .replace("__ID_HEADER__", GATEWAY_REQUEST_ID_HEADER)
)
_CLUSTER_NAME = re.compile(r"[A-Za-z0-9_.|:/-]+")


_PER_WORKER = (
    # Each call goes to the events port of the worker that admitted the request, named in
    # its id (extproc.service.processor.request_id_prefix): `<events_cluster>_<i>`.
    (
        "handle:httpCall(EVENTS,",
        'handle:httpCall(EVENTS .. "_" .. string.match(path, WORKER_IN_ID),',
    ),
    (
        '  handle:streamInfo():dynamicMetadata():set(NS, "id", id)\n',
        "  local worker = string.match(id, WORKER_IN_ID)\n"
        "  if worker == nil or tostring(tonumber(worker)) ~= worker\n"
        "      or tonumber(worker) >= WORKERS then\n"
        "    return\n"
        "  end\n"
        '  handle:streamInfo():dynamicMetadata():set(NS, "worker", worker)\n'
        '  handle:streamInfo():dynamicMetadata():set(NS, "id", id)\n',
    ),
    (
        "local function post(handle, path, body)\n",
        'local WORKERS = __WORKERS__\nlocal WORKER_IN_ID = "w(%d+)%-%d+$"\n\n'
        "local function post(handle, path, body)\n",
    ),
)


def counting_script(events_cluster: str = EVENTS_CLUSTER, workers: int = 1) -> str:
    """The script, posting its calls to `events_cluster`: the rendered `extproc_events`, or the
    cluster a mesh made for the service's events port (Istio's
    `outbound|50053||extproc.llm-gateway.svc.cluster.local`). With `workers` > 1 (`serve
    --workers N --worker-ports distinct`), a request's calls go to `<events_cluster>_<i>`,
    worker i's events port, i read from the request id, and its end to the access log
    `counts_access_log(..., worker=i)`: every event of a request reaches the process that
    admitted it. An id that names no worker below `workers` is not followed."""
    if not _CLUSTER_NAME.fullmatch(events_cluster):
        raise ValueError(f"not a cluster name for the counting script: {events_cluster!r}")
    script = _SCRIPT
    if workers > 1:
        for old, new in _PER_WORKER:
            if script.count(old) != 1:
                raise AssertionError(f"the counting script changed: {old!r}")
            script = script.replace(old, new)
        script = script.replace("__WORKERS__", str(workers))
    return script.replace("__CLUSTER__", events_cluster).lstrip("\n")


def worker_events_cluster(index: int) -> str:
    """Worker `index`'s events cluster, when several workers count in Envoy."""
    return f"{EVENTS_CLUSTER}_{index}"


COUNTING_SCRIPT = counting_script()
"""Notes on the script, each a trap found in the real Envoy (tests/dataplane):
the count is stored after every chunk, since a client that leaves mid-stream ends the script
where it stands; the metadata handle is taken afresh per chunk (one kept across the script's
yields stores nothing); `carry` keeps the previous chunk's tail, so usage split across two
chunks is still found. Only request ids of the gateway's own alphabet go into a path."""


def counting_filter(events_cluster: str = EVENTS_CLUSTER, workers: int = 1) -> HttpFilter:
    """The Lua filter, placed after the admission filter (it reads the request id the
    admission set) and before the router. On every route: a request without the id (the
    header-mutation filter removes client copies) costs one header lookup."""
    config = Lua(
        default_source_code=DataSource(inline_string=counting_script(events_cluster, workers)),
        stat_prefix="counting",
    )
    return HttpFilter(name=COUNTING_FILTER, typed_config=AnyProto.pack(config))


def counts_access_log(extproc_cluster: str, worker: int | None = None) -> AccessLog:
    """The end of every stream the script followed, sent as it happens (no batching: capacity
    is released on it) to the service's access-log sink on the ext_proc cluster. Only those:
    a request refused at admission, or any other traffic of a shared gateway, has no request
    id in the metadata, and each entry would cost the service a message to read and drop
    (under a flood of 429s, one per refusal). With `worker`, only the ends of the requests
    that worker admitted (the script's per-worker form), to its own cluster."""
    key, value = ("id", ValueMatcher(present_match=True))
    if worker is not None:
        key, value = ("worker", ValueMatcher(string_match=StringMatcher(exact=str(worker))))
    followed = MetadataFilter(
        matcher=MetadataMatcher(
            filter=METADATA_NAMESPACE, path=[MetadataMatcherPathSegment(key=key)], value=value
        ),
        match_if_key_not_found=False,
    )
    config = HttpGrpcAccessLogConfig(
        common_config=CommonGrpcAccessLogConfig(
            log_name=ACCESS_LOG_NAME,
            grpc_service=GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=extproc_cluster)),
            transport_api_version=ApiVersion.V3,
            buffer_size_bytes=0,
            buffer_flush_interval=timedelta(milliseconds=100),
        )
    )
    return AccessLog(
        name="envoy.access_loggers.http_grpc",
        filter=AccessLogFilter(metadata_filter=followed),
        typed_config=AnyProto.pack(config),
    )


__all__ = [
    "ACCESS_LOG_NAME",
    "COUNTING_FILTER",
    "COUNTING_SCRIPT",
    "EVENTS_CLUSTER",
    "EVERY",
    "METADATA_NAMESPACE",
    "counting_filter",
    "counting_script",
    "counts_access_log",
    "worker_events_cluster",
]
