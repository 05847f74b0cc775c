"""How the two ext_proc filters tell the service which role a stream plays.

The accounting filter (observability mode) sends this pair in the gRPC stream's initial
metadata, so the service dispatches a stream before reading its first message.
"""

ROLE_METADATA = "x-extproc-role"
ACCOUNTING_ROLE = "accounting"
