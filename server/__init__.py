"""The kvplan gRPC service (needs the server extra)."""
