"""Turn each kind of file (bootstrap, Istio, Envoy Gateway) into the views the checks read."""
