"""jaxinfer: a JAX/XLA LLM inference engine.

    import jaxinfer
    llm = jaxinfer.LLM()                     # the embedded SmolLM2-135M-Instruct
    out = llm.generate([[{"role": "user", "content": "What is the capital of France?"}]])
    print(out[0].text)

Heavy modules load on first attribute access, so `import jaxinfer` is cheap
and the CLI can report bad arguments before JAX starts.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "jaxinfer.llm",
    "RequestOutput": "jaxinfer.llm",
    "SamplingParams": "jaxinfer.sampling",
    "StructuredOutput": "jaxinfer.structured",
    "ModelConfig": "jaxinfer.config",
    "Tokenizer": "jaxinfer.tokenizer",
    "JaxinferError": "jaxinfer.errors",
    "CheckpointError": "jaxinfer.errors",
    "InvalidRequestError": "jaxinfer.errors",
    "ModelNotFoundError": "jaxinfer.errors",
    "TokenizerError": "jaxinfer.errors",
    "UnsupportedModelError": "jaxinfer.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  if name in _EXPORTS:
    return getattr(importlib.import_module(_EXPORTS[name]), name)
  raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")
