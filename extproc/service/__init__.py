"""The ext_proc gRPC service: Envoy protocol adapter around the gateway's domain logic."""
