"""The kvplan gRPC service (needs the `server` extra). Entry point: `kvplan serve`."""
