"""gateway: the public gRPC service; owns session state (gateway.store) and assigns runs."""
