"""Serving: the gRPC batching server (`jaxinfer.v1.Inference`) and its client.

    jaxinfer serve --port 50051                 # the embedded default model
    from jaxinfer.serving import Client
    Client("127.0.0.1:50051").generate("Hello", max_tokens=16).text

See server.py for the threading model and status codes, proto/inference.proto
for the wire API.
"""

from jaxinfer.serving.client import Client, GenerateResult
from jaxinfer.serving.server import InferenceServer, ServerConfig, serve

__all__ = ["Client", "GenerateResult", "InferenceServer", "ServerConfig", "serve"]
