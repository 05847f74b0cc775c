"""How the two ext_proc filters tell the service which role a stream plays.

The accounting filter (observability mode) sends this pair in the gRPC stream's initial
metadata, so the service dispatches a stream before reading its first message.
"""

ROLE_METADATA = "x-extproc-role"
ACCOUNTING_ROLE = "accounting"

ADMISSION_METADATA = "extproc.admission"
"""The dynamic-metadata namespace the admission stream's forward writes the client's response
headers into (x-ratelimit-*, x-gateway-queue-ms); Envoy adds them to the response itself, so
the admission stream can end before the engine answers (extproc.envoy_config)."""
