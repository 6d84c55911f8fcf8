"""Pure-function model definitions: functions over parameter pytrees, no module framework."""

from jaxinfer.models.transformer import compute_logits, forward, init_cache

__all__ = ["compute_logits", "forward", "init_cache"]
