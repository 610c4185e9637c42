"""driftlab inside vLLM's engine: every steer and every drift measure, per request.

The driftlab process renders conversations and sends token prompts to vLLM (`chat.vllm`);
each request carries its steer as data (`payload.SteerPayload`, in `SamplingParams.extra_args`),
never as code. Inside vLLM's worker (`worker.DriftlabWorker`, vLLM's `worker_cls`), a step plan
(`step`) maps vLLM's flattened token batch onto driftlab's per-row state: the residual stream's
(`activation.state`) through a custom op on every decoder layer's output, attention's
(`attention.state`, `attention.engine`) through an attention backend registered over vLLM's CPU
backend, on the paged KV cache. The math is driftlab's own, shared with the transformers engine;
only the batch layout is mapped here. Nothing here imports vLLM at `import driftlab`.
"""
