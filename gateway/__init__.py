"""gateway: the public gRPC service; owns session state (gateway.store) and assigns runs. The same engine also
serves an OpenAI-compatible HTTP API (gateway.openai)."""
