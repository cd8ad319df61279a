"""The control plane's gRPC surface: servicers, auth, error mapping, server, clients."""
