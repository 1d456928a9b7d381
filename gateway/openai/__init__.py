"""The gateway's OpenAI-compatible HTTP API over the same GatewayEngine the gRPC servicer serves.

gateway.openai.api     the endpoints (/v1/models, /v1/completions, /v1/chat/completions, vLLM's /tokenize and
                       /detokenize, /metrics, /health, /version) and their server
gateway.openai.schema  the bodies: requests (validated, turned into GenerateRequest) and replies
"""
