"""The host side of serving: KV pages, scheduling, the device step, the engine loop.

    kv_manager.KVManager   page pool, prefix cache, KV events
    scheduler.Scheduler    which requests run each step, and with how many tokens
    runner.pack            scheduled sequences -> one StepBatch (tokens, pages, logits rows)
    runner.ModelRunner     the jitted, bucketed ragged step
    spec_decode            speculative decoding: SpeculativeConfig, drafters, draft acceptance
    engine.LLMEngine       add_request / step / abort (what LLM and servers drive)
"""
