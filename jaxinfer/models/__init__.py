"""Pure-function model definitions: functions over parameter pytrees, no module framework."""

from jaxinfer.models.cache import init_cache
from jaxinfer.models.transformer import compute_logits, forward

__all__ = ["compute_logits", "forward", "init_cache"]
