"""Prometheus metrics of the server, shared by gRPC and HTTP (names in the `jaxinfer_` namespace, units in the names).

Latencies are observed on the engine thread when a step's outputs come out,
so they measure the engine plus queueing, not the network. Gauges are set
after every step from `LLMEngine.stats()`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds: from a fast GPU decode step (~5 ms) to a long CPU prefill queue (minutes).
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
  """One registry per server, so several servers (tests) never share counters."""

  def __init__(self):
    r = self.registry = CollectorRegistry()
    self.time_to_first_token = Histogram(
        "jaxinfer_time_to_first_token_seconds", "Request arrival to its first generated token.",
        buckets=_LATENCY_BUCKETS, registry=r)
    self.inter_token_latency = Histogram(
        "jaxinfer_inter_token_latency_seconds", "Time between consecutive tokens of a request.",
        buckets=_LATENCY_BUCKETS, registry=r)
    self.request_latency = Histogram(
        "jaxinfer_request_latency_seconds", "Request arrival to its last token.",
        buckets=_LATENCY_BUCKETS, registry=r)
    self.waiting_requests = Gauge(
        "jaxinfer_waiting_requests", "Queue depth: requests waiting for the engine to run them.",
        registry=r)
    self.running_requests = Gauge("jaxinfer_running_requests", "Requests in the running batch.",
                                  registry=r)
    self.kv_cache_usage = Gauge("jaxinfer_kv_cache_usage_ratio",
                                "Fraction of KV pages held by requests.", registry=r)
    self.prefix_cache_hit_rate = Gauge(
        "jaxinfer_prefix_cache_hit_ratio", "Prompt tokens served by the prefix cache / prompt tokens looked up.",
        registry=r)
    self.prompt_tokens = Counter("jaxinfer_prompt_tokens", "Prompt tokens of admitted requests.",
                                 registry=r)
    self.generation_tokens = Counter("jaxinfer_generation_tokens", "Generated tokens.", registry=r)
    self.prefix_cache_hit_tokens = Counter(
        "jaxinfer_prefix_cache_hit_tokens", "Prompt tokens served by the prefix cache.", registry=r)
    self.finished_requests = Counter("jaxinfer_finished_requests", "Finished requests by finish reason.",
                                     ["finish_reason"], registry=r)
    self.rejected_requests = Counter("jaxinfer_rejected_requests",
                                     "Requests refused before reaching the engine, by status "
                                     "(gRPC's names, whichever transport refused).",
                                     ["code"], registry=r)
    self.preemptions = Gauge("jaxinfer_preemptions", "Requests preempted (recomputed) so far.",
                             registry=r)
    # Speculative decoding (set only by an engine that speculates).
    self.spec_draft_tokens = Gauge("jaxinfer_spec_decode_draft_tokens",
                                   "Draft tokens proposed for verification so far.", registry=r)
    self.spec_accepted_tokens = Gauge("jaxinfer_spec_decode_accepted_tokens",
                                      "Draft tokens accepted so far.", registry=r)
    self.spec_mean_acceptance_length = Gauge(
        "jaxinfer_spec_decode_mean_acceptance_length",
        "Tokens committed per verifying sequence-step (accepted drafts + 1).", registry=r)

    # MoE (set only by an engine whose model has experts).
    self.moe_expert_tokens = Gauge("jaxinfer_moe_expert_tokens",
                                   "Token copies routed to each expert so far, summed over the MoE layers.",
                                   ["expert"], registry=r)
    self.moe_expert_imbalance = Gauge(
        "jaxinfer_moe_expert_imbalance_ratio",
        "The worst MoE layer's busiest expert: its routed tokens over the mean (1 = even).", registry=r)

    # Attention data parallelism (set only by an engine whose KV pool is split over data ranks).
    self.dp_rank_tokens = Gauge("jaxinfer_dp_rank_tokens", "Tokens the last step scheduled on each data rank.",
                                ["rank"], registry=r)
    self.dp_rank_imbalance = Gauge(
        "jaxinfer_dp_rank_imbalance_ratio",
        "The last step's busiest data rank: its scheduled tokens over the mean (1 = even; 0 = idle).", registry=r)

    # Disaggregation: KV pages moved between a prefill worker (direction="sent") and a decode
    # worker (direction="received"), counted per chunk as it goes out / is imported, so a
    # transfer that fails half way counts the pages that did move.
    self.kv_transfer_pages = Counter("jaxinfer_kv_transfer_pages", "KV cache pages transferred.",
                                     ["direction"], registry=r)
    self.kv_transfer_bytes = Counter("jaxinfer_kv_transfer_bytes", "Bytes of KV cache pages transferred.",
                                     ["direction"], registry=r)
    self.kv_transfers = Counter(
        "jaxinfer_kv_transfers", "Completed KV transfers (sent: acknowledged by the decode worker; "
        "received: every page imported).", ["direction"], registry=r)
    self.kv_transfer_duration = Histogram(
        "jaxinfer_kv_transfer_duration_seconds", "First page to last page of a completed transfer "
        "(sent: exported and written; received: the header to the last page imported).", ["direction"],
        buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
        registry=r)
    self.kv_transfer_failures = Counter(
        "jaxinfer_kv_transfer_failures", "KV transfers that did not complete, by reason (sent: refused, "
        "engine_error, cancelled, ack_timeout, no_ack; received: timeout, unavailable, overloaded, "
        "refused, invalid_transfer, prefill_error, cancelled, error).", ["direction", "reason"], registry=r)

  def set_engine_stats(self, stats: dict) -> None:
    self.waiting_requests.set(stats["waiting"])
    self.running_requests.set(stats["running"])
    self.kv_cache_usage.set(stats["kv_usage"])
    self.prefix_cache_hit_rate.set(stats["prefix_hit_rate"])
    self.preemptions.set(stats["preemptions"])
    if "spec_draft_tokens" in stats:
      self.spec_draft_tokens.set(stats["spec_draft_tokens"])
      self.spec_accepted_tokens.set(stats["spec_accepted_tokens"])
      self.spec_mean_acceptance_length.set(stats["spec_mean_acceptance_length"])
    if "moe_expert_tokens" in stats:
      for e, n in enumerate(stats["moe_expert_tokens"]):
        self.moe_expert_tokens.labels(expert=str(e)).set(n)
      self.moe_expert_imbalance.set(stats["moe_expert_imbalance"])
    if "dp_rank_tokens" in stats:
      for rank, n in enumerate(stats["dp_rank_tokens"]):
        self.dp_rank_tokens.labels(rank=str(rank)).set(n)
      self.dp_rank_imbalance.set(stats["dp_rank_imbalance"])

  def exposition(self) -> bytes:
    """The text format Prometheus scrapes (also served over HTTP by the server)."""
    return generate_latest(self.registry)
