"""DPara inside other serving engines (docs/engines.md).

``dpara_rt.engines.vllm.DParaProposer``: a vLLM (0.32.x) custom speculative proposer that drives a
``dpara_rt.serving.Speculator`` in DPara mode; vLLM keeps the target, its KV cache, scheduling and its
rejection sampler. The module imports vLLM, so it is imported only where vLLM is installed.
"""
