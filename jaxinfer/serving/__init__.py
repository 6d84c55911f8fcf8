"""Serving: the batching server (gRPC `jaxinfer.v1.Inference`, optionally the
OpenAI HTTP API on the same engine) and its gRPC client.

    jaxinfer serve --port 50051                 # the embedded default model
    jaxinfer serve --http-port 8000             # + /v1/completions, /v1/chat/completions
    jaxinfer route --model M --workers A,B      # KV-aware router in front of `serve` workers of M
    jaxinfer route --model M --prefill-workers P --decode-workers D   # ... of `serve --role` workers
    from jaxinfer.serving import Client
    Client("127.0.0.1:50051").generate("Hello", max_tokens=16).text

See backend.py for the Backend contract and the threading model, server.py
and openai_api.py for each transport's statuses, router.py for the router,
proto/inference.proto and proto/kv_events.proto for the gRPC wire APIs.
"""

from jaxinfer.serving.client import Client, GenerateResult
from jaxinfer.serving.server import InferenceServer, ServerConfig, serve

__all__ = ["Client", "GenerateResult", "InferenceServer", "ServerConfig", "serve"]
