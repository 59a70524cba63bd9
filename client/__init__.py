"""Thin client: needs only grpcio and protobuf."""
