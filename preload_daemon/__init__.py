"""The per-device weight-cache daemon: checkpoint reading, the load plan, slabs, the store, the
gRPC server and its client library."""

__version__ = "0.1.0"
