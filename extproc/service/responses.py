"""Pure builders for ext_proc ProcessingResponse messages (hot-path xds-protos stubs)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from envoy.config.core.v3.base_pb2 import HeaderValueOption
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    CommonResponse,
    HeaderMutation,
    ImmediateResponse,
    ProcessingResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.duration_pb2 import Duration

from extproc.errors import HttpAnswer

_OVERWRITE = HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
Headers = Mapping[str, str] | Iterable[tuple[str, str]]

# Messages are filled in place (nested fields set on the reply itself): building nested
# messages with keyword arguments and copying them in costs about three times as much, and
# this runs for every request (`extproc bench overhead`).


def fill_header_mutation(
    mutation: HeaderMutation, set_headers: Headers = (), remove: Iterable[str] = ()
) -> None:
    items = set_headers.items() if isinstance(set_headers, Mapping) else set_headers
    options = mutation.set_headers
    for key, value in items:
        option = options.add(append_action=_OVERWRITE)
        option.header.key = key
        option.header.raw_value = value.encode()
    mutation.remove_headers.extend(remove)


def header_mutation(set_headers: Headers = (), remove: Iterable[str] = ()) -> HeaderMutation:
    mutation = HeaderMutation()
    fill_header_mutation(mutation, set_headers, remove)
    return mutation


def _fill_common(
    common: CommonResponse,
    set_headers: Headers,
    remove: Iterable[str],
    clear_route_cache: bool,
    body: bytes | None,
) -> None:
    common.SetInParent()  # an empty reply must still say which phase it answers
    if clear_route_cache:
        common.clear_route_cache = True
    if set_headers or remove:
        fill_header_mutation(common.header_mutation, set_headers, remove)
    if body is not None:
        common.body_mutation.body = body


def continue_request_headers(
    set_headers: Headers = (), remove: Iterable[str] = (), clear_route_cache: bool = False
) -> ProcessingResponse:
    reply = ProcessingResponse()
    _fill_common(reply.request_headers.response, set_headers, remove, clear_route_cache, None)
    return reply


def continue_request_body(
    set_headers: Headers = (),
    remove: Iterable[str] = (),
    clear_route_cache: bool = False,
    body: bytes | None = None,
) -> ProcessingResponse:
    reply = ProcessingResponse()
    _fill_common(reply.request_body.response, set_headers, remove, clear_route_cache, body)
    return reply


def clear_request_chunk() -> ProcessingResponse:
    """A streamed body chunk's reply that drops the chunk (its bytes go in a later one)."""
    reply = ProcessingResponse()
    reply.request_body.response.body_mutation.clear_body = True
    return reply


def fill_metadata(reply: ProcessingResponse, namespace: str, values: Mapping[str, str]) -> None:
    """Dynamic metadata Envoy keeps for the request under `namespace` (the filter must list
    it in metadata_options.receiving_namespaces)."""
    fields = reply.dynamic_metadata.fields[namespace].struct_value.fields
    for key, value in values.items():
        fields[key].string_value = value


def immediate(answer: HttpAnswer) -> ProcessingResponse:
    return ProcessingResponse(
        immediate_response=ImmediateResponse(
            status=HttpStatus(code=answer.status),  # type: ignore[arg-type]
            headers=header_mutation(answer.headers),
            body=answer.body,
        )
    )


def hold(seconds: float) -> ProcessingResponse:
    """Ask Envoy to wait up to `seconds` for the real reply to the current message."""
    whole = int(seconds)
    return ProcessingResponse(
        override_message_timeout=Duration(seconds=whole, nanos=int((seconds - whole) * 1e9))
    )
