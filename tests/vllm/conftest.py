"""vLLM tests: run with the vLLM environment's python (``../vllm-env/bin/python -m pytest -q -m vllm
tests/vllm``). Where vLLM is not installed (the main environment) nothing here is collected, so the default
``pytest -q`` run neither collects nor skips them."""
import importlib.util

# pytest puts tests/ on sys.path, where this folder itself is a namespace package named "vllm": only a
# regular package (one with an origin) is vLLM
_spec = importlib.util.find_spec("vllm")
if _spec is None or _spec.origin is None:
    collect_ignore_glob = ["test_*.py"]
