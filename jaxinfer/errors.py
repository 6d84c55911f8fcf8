"""The exceptions jaxinfer raises on bad input.

Every error a user can cause (a wrong path, a malformed checkpoint, an
unsupported model, an invalid request) is one of these, with a message that
names the file or field and says what is wrong. The CLI prints the message on
one line and exits non-zero; library users catch `JaxinferError`.
"""


class JaxinferError(Exception):
  """Base class of every error jaxinfer raises on purpose."""


class ModelNotFoundError(JaxinferError):
  """A model path does not exist, or is not a model in any format we read."""


class CheckpointError(JaxinferError):
  """A checkpoint file is truncated, corrupted, or has a wrong tensor."""


class UnsupportedModelError(JaxinferError):
  """The architecture, a config option or a quantization type is not supported."""


class TokenizerError(JaxinferError):
  """A tokenizer is missing or malformed, or the request needs one and there is none."""


class InvalidRequestError(JaxinferError, ValueError):
  """A prompt or sampling value is invalid; the message names the field."""


class KVTransferError(JaxinferError):
  """A KV transfer cannot be used: layouts differ, pages are missing or the bytes are short.
  (Here rather than in engine/kv_connector.py, which re-exports it, so that the cache spec
  in jaxinfer.models can raise it without importing the engine.)"""


class ShardingError(JaxinferError):
  """A model cannot be split over a mesh as asked: an axis does not divide, two dimensions of
  one tensor claim the same mesh axis, a rule is malformed, or the mesh needs more devices
  than exist. The message names the tensor, the logical axis, its size and the mesh axes."""
