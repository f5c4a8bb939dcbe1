"""Multi-adapter serving (an application on the public API): a CPU server of the tiny GPT with
many LoRA adapters, continuous batching, an HTTP API, a fleet + router, workloads, a digital
twin of one server, a learned performance model and adapter placement."""
